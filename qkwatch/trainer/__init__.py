"""The trainer: an FSDP2 GPT with Rank-Anchored Attention, the seeds' baselines, init regimes and evals.

Four rooms, on floors (each imports only the rooms below it: ``tests/test_layering.py``), and the
command line:

* ``reporting`` (the ground floor): the agent seam (``monitoring``: the ``Monitor`` protocol RAA and
  the loop talk to) and ``metrics.jsonl`` (``metrics_log``).

* ``model``: the network: the GPT and its variants (``gpt``, ``config``), its pieces (``rope``,
  ``normalisation``, ``key_rotation``), RAA inside its attention (``rank_anchored``) and the
  initialisation with seed 001's regimes (``init``).
* ``checkpoints``: DCP checkpoints and the qkwatch-gpt export (``checkpoint``), read without
  running them and checked against their checksums (``safety``).
* ``run`` (the top floor): one training run: its config and the recipes, ``setup``, the loop
  (``train``), its step (``step``, ``optim``) and what it reports (``step_report``), the data, FSDP2
  (``parallelize``), preemption, seed 001's interventions and seed 000's evaluations (``evals``).
* ``cli`` (``qkwatch train`` and ``eval``) and ``__main__`` (``python -m qkwatch.trainer``).

Nothing imports ``trainer`` but the ``qkwatch`` command; it may import ``agent``.
"""
