"""The parts of the experiments of docs/reproduction.md: each one's analysis, its section of the page, the math.

The command lines sit one level up (``python -m experiments.seed000``, ``seed001``, ``seed003``,
``qkai_scale`` and ``report``) and import what is here; nothing here imports them. ``<name>_section``
turns an experiment's results into its section of the page (``experiments.report`` asks each for it).
"""
