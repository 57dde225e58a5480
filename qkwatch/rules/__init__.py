"""The alert rules as pure functions: the rule kinds (``kinds``), the rules file (``ruleset``), the
per-layer state machine (``transitions``), the batch evaluator (``evaluator``), the trend
forecast (``forecast``) and the loss-only rules (``loss_rules``).

The collector evaluates them on every batch it stores; ``qkwatch alerts backtest`` replays a
stored history through the very same functions. They read only the contract, so neither side
pulls in the other.
"""
