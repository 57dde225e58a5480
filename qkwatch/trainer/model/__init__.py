"""The network: the GPT, its variants and pieces, RAA inside its attention, and its initialisation.

``gpt`` (``GPT``, ``Attention`` and its seams), ``config`` (``ModelConfig``), ``rope``,
``normalisation`` (sigma-Reparam, qk_norm), ``key_rotation`` (RAA's Householder rotation),
``rank_anchored`` (RAA's config, PAR on the flagged layers and the lambdas that weight it) and
``init`` (``build_model`` and seed 001's query/key regimes).
"""
