"""What the agent and the collector agree on: the wire format, metric names, thresholds, the schedule.

Both sides import this package and nothing of each other (``tests/test_layering.py``); it imports
only the standard library and pydantic, so the training process pulls in nothing of the collector.

* :mod:`qkwatch.contract.values`: a value on the wire (numbers and ``"nan"``, ``"inf"``), names,
  tags and notes, and the bounds of each;
* :mod:`qkwatch.contract.wire`: the models of what the agent sends (runs, reports, events, status);
* :mod:`qkwatch.contract.responses`: the models of what the collector's API answers, which its
  routers declare and the client parses with (the alert record among them);
* :mod:`qkwatch.contract.names`: the metric names both sides use, their Prometheus names and units,
  and the ``_rank<r>`` suffix of a rank's own series;
* :mod:`qkwatch.contract.thresholds`: the collapse threshold and the entropy floor ``H*``;
* :mod:`qkwatch.contract.scheduling`: the entropy-floor schedule of RAA's weights (its config and formula).
"""
