"""The trainer: an FSDP2 GPT with Rank-Anchored Attention, the seeds' baselines, init regimes and evals.

``model`` (the GPT and its variants), ``raa`` (PAR, rotation, schedule hookup), ``init`` (builds
the model and initialises its weights, seed 001's regimes), ``interventions`` (seed 001's Table 2),
``data``, ``parallelize`` (FSDP2, activation checkpointing, compile), ``optim``, ``checkpoint``
(DCP and the qkwatch-gpt export), ``monitoring`` (the agent seam), ``config`` and ``recipes``,
``train`` (the loop), ``metrics_log`` (``metrics.jsonl``), ``evals``, ``cli`` (``qkwatch train``
and ``eval``, ``python -m qkwatch.trainer``). Nothing imports ``trainer`` but the ``qkwatch`` command; it
may import ``agent``.
"""
