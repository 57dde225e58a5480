"""The trainer: an FSDP2 GPT with Rank-Anchored Attention, the seeds' baselines, init regimes and evals.

Four rooms and the command line:

* ``model``: the network: the GPT and its variants (``gpt``, ``config``), its pieces (``rope``,
  ``normalisation``, ``key_rotation``), RAA inside its attention (``rank_anchored``) and the
  initialisation with seed 001's regimes (``init``).
* ``run``: one training run: its config and the recipes, ``setup``, the loop (``train``) and its
  step (``step``, ``optim``), the data, FSDP2 (``parallelize``), preemption and seed 001's
  interventions.
* ``checkpoints``: DCP checkpoints and the qkwatch-gpt export (``checkpoint``), read without
  running them and checked against their checksums (``safety``).
* ``reporting``: the agent seam (``monitoring``), what a step reports (``step_report``),
  ``metrics.jsonl`` (``metrics_log``) and seed 000's evaluations (``evals``).
* ``cli`` (``qkwatch train`` and ``eval``) and ``__main__`` (``python -m qkwatch.trainer``).

Nothing imports ``trainer`` but the ``qkwatch`` command; it may import ``agent``.
"""
