"""A run's measured values in the database: written on ingest, read by the queries.

* :mod:`~qkwatch.monitor.store.values.ingest`: a batch of reports in one transaction (points,
  frames, latest values, then the run's schedule state, events and alerts);
* :mod:`~qkwatch.monitor.store.values.points`: the points, insert-or-ignore on their natural key;
* :mod:`~qkwatch.monitor.store.values.frames`: all layer values of one (report, metric) as one
  array, and the heatmap built from them;
* :mod:`~qkwatch.monitor.store.values.reads`: series, heatmaps, latest values, the export;
* :mod:`~qkwatch.monitor.store.values.history`: a run's whole history as steps x layers grids;
* :mod:`~qkwatch.monitor.store.values.means`: bucket means that stay finite.

Metric names and their ids, which both the runs and the values use, are
:mod:`qkwatch.monitor.store.metric_names`.
"""
