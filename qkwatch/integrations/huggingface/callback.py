"""The Trainer callback: one ``QKWatchCallback`` is one qkwatch run, opened when training begins.

How the callback follows the Trainer's events:

* ``on_train_begin``: :func:`qkwatch.attach` to the model the Trainer trains, unwrapped
  (``accelerate.utils.extract_model_from_parallel``: DDP, DataParallel, ``torch.compile``), on every
  process. The run's config is the ``config`` given over ``training`` (the useful fields of
  ``TrainingArguments``, the world size) and ``model`` (the model config's shape).
* ``on_step_begin``: ``agent.step(state.global_step)``. The Trainer fires it once per optimizer
  step, before the first forward of the gradient-accumulation loop, so the agent measures once per
  optimizer step, on the first micro-batch (the probe keeps the first forward of each layer; the
  other micro-batches and any evaluation pass through untouched). Step ``s`` is the forward made
  with the weights after ``s`` updates; the Trainer logs that forward's loss at ``s + 1``.
* ``on_log`` and ``on_evaluate``: every number the Trainer logs (``loss``, ``learning_rate``,
  ``grad_norm``, ``epoch``, ``eval_*``, the closing ``train_*`` summary) goes to ``agent.log`` at
  ``state.global_step``: each value is stored at the step ``trainer.state.log_history`` shows it at.
  With ``tracker_logs`` (on by default) the same ``on_log`` then adds qkwatch's per-layer values
  to the Trainer's ``logs`` (``qkwatch/qkai/layer_07``, ..., ``qkwatch/step``), so every
  ``report_to`` target receives them: the callback moves itself ahead of the reporters when training
  begins. How, which report and at which step: :mod:`qkwatch.integrations.huggingface.tracker_logs`.
* ``on_train_end``: ``agent.close(status="finished")``.

A training that raises. The Trainer has no exception event (its ``on_train_end`` runs only on
success), so the end of a failed run is caught around it, in two ways:

* the callback is a context manager: ``with QKWatchCallback(...) as qk: ... .train()`` closes the
  run ``crashed`` with ``"RuntimeError: <message>"`` when the block raises, as
  ``with qkwatch.attach(...)`` does. This is the way in notebooks and wherever the exception is caught;
* without the ``with``, while a run is open the callback chains a ``sys.excepthook`` (an exception
  that ends the process closes the run ``crashed`` with its reason, then the previous hook prints
  it) and registers an ``atexit`` handler (a process that exits with the run still open, e.g.
  ``sys.exit`` mid-training or an exception swallowed, closes it ``crashed``, "exited before the
  training ended"). W&B does the same (its ``ExitHooks`` wrap ``sys.excepthook`` and ``sys.exit``);
  MLflow's callback ends its run only in ``on_train_end`` and ``__del__`` (``end_run()``, whose
  default status is FINISHED). A ``train()`` begun again with the same callback closes a run left
  open ``crashed``.

One callback is one run: each ``train()`` with it is an attempt of the same run (the same project
and name resume it; reads show the latest attempt). The run closes when training ends, so a
``trainer.evaluate()`` after ``train()`` is not stored: evaluate during training (``eval_strategy``).

Several processes (``torchrun``, ``accelerate launch``; on the CPU ``torchrun`` with
``TrainingArguments(use_cpu=True)``, as ``accelerate launch --cpu`` starts several processes only
through MPI): the Trainer initialises torch.distributed before ``on_train_begin``, so every process
attaches to the same run: rank 0's run name is agreed by all (the agent's ``RunIdentity``), rank
``r`` measures layers ``l % world == r`` and ships its own spool, and only rank 0 stores the logged
scalars and says "finished" (any rank says "crashed").
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, MutableMapping
from types import TracebackType
from typing import Any

from accelerate.utils import extract_model_from_parallel  # type: ignore[import-untyped]  # no py.typed
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from qkwatch.agent import Agent, Layout, attach, exception_reason
from qkwatch.integrations.huggingface.config_fields import run_config
from qkwatch.integrations.huggingface.logs import scalars
from qkwatch.integrations.huggingface.process_hooks import ProcessHooks
from qkwatch.integrations.huggingface.tracker_logs import TrackerLogs
from qkwatch.integrations.latest import with_sink


class QKWatchCallback(TrainerCallback):
    """Watches a ``Trainer``'s run with the qkwatch agent; see the module's docstring for the events."""

    def __init__(
        self,
        *,
        project: str | None = None,
        run: str | None = None,
        config: Mapping[str, Any] | None = None,
        every: int | None = None,
        url: str | None = None,
        layout: Layout | None = None,
        close_timeout: float = 10.0,
        tracker_logs: bool | Iterable[str] = True,
        **settings: Any,
    ) -> None:
        """Settings for :func:`qkwatch.attach`, used when training begins.

        Args:
            project: the run's project (then ``QKWATCH_PROJECT``, then "default").
            run: the run's name (then ``QKWATCH_RUN``, then ``TrainingArguments.run_name`` when set
                to something other than the output folder, then a generated one).
            config: the run's own config keys; they go over the ``training`` and ``model`` keys the
                callback adds (a ``schedule`` object sets RAA's entropy-floor schedule).
            every: report cadence in optimizer steps (then ``QKWATCH_EVERY``, then 50).
            url: the collector (then ``QKWATCH_URL``; neither: offline, everything stays spooled).
            layout: where the projections are, for a model the agent's adapters do not know.
            close_timeout: seconds the end of the run may spend delivering what is spooled.
            tracker_logs: add qkwatch's per-layer values to the Trainer's logs, which every
                ``report_to`` target receives: True, the catalogue's primary per-layer metrics (QKAI,
                stable rank, attention entropy, logit max, lambda); a list of metric names, those;
                False, none.
            settings: any other keyword of :func:`qkwatch.attach` (``token``, ``spool``, ``tags``,
                ``notes``, ``weight_every``, ``sample_rows``, ...).
        """
        self.project = project
        self.run = run
        """The run's name: the one asked for, then the one agreed on once training began."""
        self.config = dict(config or {})
        self.every = every
        self.url = url
        self.layout = layout
        self.close_timeout = close_timeout
        self.settings = settings
        self.agent: Agent | None = None
        """The agent of the open run; None before training begins and once the run is closed."""
        self._hooks = ProcessHooks(self._uncaught, self._exiting)
        self._tracker = TrackerLogs(tracker_logs)

    # --- the Trainer's events -----------------------------------------------------------------

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if self.agent is not None:
            self.close(status="crashed", reason="trainer.train() began again before this training ended")
        if model is None:
            raise ValueError("QKWatchCallback.on_train_begin: the Trainer passed no model")
        unwrapped = unwrap(model)
        sink = self._tracker.begin(self)  # before attach: the agent is given the sink
        self.agent = attach(
            unwrapped,
            url=self.url,
            project=self.project,
            run=self.run or os.environ.get("QKWATCH_RUN") or _run_name(args),
            every=self.every,
            config=run_config(args, unwrapped, self.config),
            layout=self.layout,
            **with_sink(self.settings, sink),
        )
        self.run = self.agent.run  # later train() calls are attempts of this run
        self._hooks.install()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.agent is not None:
            self.agent.step(state.global_step)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: MutableMapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.agent is not None and logs:
            self.agent.log(state.global_step, **scalars(logs))  # the Trainer's own values, before ours join them
            self._tracker.add_to(logs)

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.agent is not None and metrics:
            self.agent.log(state.global_step, **scalars(metrics))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close(status="finished")

    # --- the end of the run -------------------------------------------------------------------

    def close(self, *, status: str | None = "finished", reason: str | None = None) -> None:
        """Close the open run (idempotent): ``"finished"``, ``"crashed"`` with ``reason``, or None (say nothing)."""
        agent, self.agent = self.agent, None
        self._hooks.remove()
        if agent is not None:
            agent.close(self.close_timeout, status=status, reason=reason)

    def __enter__(self) -> QKWatchCallback:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Leaving the block by an exception closes the open run ``crashed`` with the exception as the reason."""
        if exc is None:
            self.close(status="finished")
        else:
            self.close(status="crashed", reason=exception_reason(exc))

    def _uncaught(self, exc: BaseException) -> None:
        self.close(status="crashed", reason=exception_reason(exc))

    def _exiting(self) -> None:
        self.close(status="crashed", reason="the process exited before the training ended")


def _run_name(args: TrainingArguments) -> str | None:
    """``TrainingArguments.run_name`` when the user set it (older versions default it to the output folder)."""
    name = getattr(args, "run_name", None)
    if not name or name == args.output_dir:
        return None
    return str(name)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP, DataParallel or ``torch.compile`` (Accelerate's own unwrapping)."""
    unwrapped = extract_model_from_parallel(model)
    return getattr(unwrapped, "_orig_mod", unwrapped) if isinstance(unwrapped, nn.Module) else model
