"""The collector ingest benchmark, ``python -m bench.ingest`` (usage in ``__main__.py``): qkwatch against an
MLflow tracking server, same machine, same database kind.

* ``workload``: the reports sent (24 layers x 6 metrics a step) and the fresh databases, shared with the
  other ingest benchmarks (``bench.ab_ingest``, ``bench.ingest_raw``, ``bench.ingest_phases``, ``bench.history``);
* ``collector``: qkwatch's side: ingest and read-back, the heatmap and lambdas queries, concurrent clients;
* ``mlflow_server``: MLflow's side: its server in its own virtualenv, ``log-batch`` and ``get-history``;
* ``__main__``: the command and its tables.
"""
