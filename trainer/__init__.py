"""The trainer: an FSDP2 GPT with Rank-Anchored Attention, the seeds' baselines, init regimes and evals.

``model`` (the GPT and its variants), ``raa`` (PAR, rotation, schedule hookup), ``init`` (weights,
seed 001's regimes), ``interventions`` (seed 001's Table 2), ``data``, ``parallelize`` (FSDP2),
``optim``, ``checkpoint`` (DCP and the qkwatch-gpt export), ``monitoring`` (the agent seam),
``config`` and ``recipes``, ``train`` (the loop), ``evals``, ``cli``. Nothing imports ``trainer``;
it may import ``agent``.
"""
