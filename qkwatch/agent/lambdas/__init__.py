"""The per-layer RAA weights (lambdas) the trainer applies: the collector's, or the local schedule's.

Validation, the bounded change, the local schedule and the exchange between ranks
(:mod:`.lambdas`); rank 0's fetching from the collector (:mod:`.poller`); the wording of the
lambda events and warnings (:mod:`.events`).
"""
