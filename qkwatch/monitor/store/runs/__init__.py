"""What the store keeps of each run beside its values: the run itself and what it carries.

* :mod:`~qkwatch.monitor.store.runs.lookup`: the runs table read (a run by id or name, locked for a
  write; runs by filters, with their tags);
* :mod:`~qkwatch.monitor.store.runs.lifecycle`: how a run starts, resumes, ends and goes away;
* :mod:`~qkwatch.monitor.store.runs.lambdas`: its running entropies, lambda overrides and their audit;
* :mod:`~qkwatch.monitor.store.runs.events`: its event log;
* :mod:`~qkwatch.monitor.store.runs.alerts`: its alerts (the evaluator's ledger) and their notifications.

The values' modules (:mod:`qkwatch.monitor.store.values`) import these; these import nothing of them.
"""
