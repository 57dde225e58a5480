"""One training run: what it is configured with and the loop that trains it.

``config`` (``RunConfig``, ``--set`` overrides), ``recipes`` (named configs), ``setup`` (``Run``:
what the loop's steps share), ``train`` (``run()``: the loop of named steps), ``step`` (one
optimizer step), ``optim``, ``data``, ``parallelize`` (process group, mesh, FSDP2), ``preemption``
(SIGTERM), ``interventions`` (seed 001's controlled changes to ``W_Q`` and ``W_K``), ``step_report``
(what the loop reports after a step) and ``evals`` (seed 000's evaluations of a checkpoint).
"""
