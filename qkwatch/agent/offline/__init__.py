"""Offline analysis, ``qkwatch analyze``: the weight geometry of a checkpoint on disk.

* ``checkpoint``: lazy, read-only access to the tensors of a checkpoint file or model folder;
* ``analyze``: finds the query and key projections (an :class:`qkwatch.agent.models.layouts.Layout`, detected or
  given) and measures them a chunk of layers at a time;
* ``render``: the result as a table, JSON or CSV.
"""
