"""The early-warning experiments' parts: trouble qkwatch did not make, and how early its alerts see it.

The command lines sit one level up (``python -m experiments.instability``, ``experiments.sweep_analysis``,
``experiments.forecast_baseline``, ``experiments.yardstick``); what they share is here, below them:
the detectors scored (``detectors``), the runs' per-step file (``instability_data``), the scoring of
each suite and the pages written from their results (``docs/instability.md``,
``docs/instability-earlier.md``). Nothing here imports a command line.
"""
