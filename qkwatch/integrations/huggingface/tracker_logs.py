"""qkwatch's layers in the Trainer's ``logs``, so that every ``report_to`` target receives them.

**Order.** The Trainer builds its callback list as ``DefaultFlowCallback``, then one callback per
``report_to`` target (TensorBoard, W&B, MLflow, ...), then the user's callbacks, then the progress
printer (``ProgressCallback``, or ``PrinterCallback`` with ``disable_tqdm``) last, and calls
``on_log`` on each in that order with the same ``logs`` dict. A user callback that adds keys there
is too late for the reporters. The Trainer hands no callback its ``CallbackHandler``, but every
event reaches a callback through ``CallbackHandler.call_event``, whose ``self`` is that handler: in
``on_train_begin`` the callback finds it one or two frames up the call stack
(:func:`calling_handler`) and gives the handler a new list (the one being iterated is left as it
is, so this event still reaches every callback once):

* the :class:`QKWatchCallback` first, so its ``on_log`` adds the keys before any other callback,
  every reporter and the user's callbacks included, reads the dict;
* a :class:`DropLayerKeys` right before the progress printer, which removes exactly those keys
  again: the console line stays the Trainer's own (``{'loss': ..., 'grad_norm': ..., ...}``), not
  one number per layer and metric.

A Trainer whose events do not come through a ``CallbackHandler`` (another version, another loop)
gets one warning and no keys: the run is watched as before and the collector has every value.

**Which report, which step.** The agent measures step ``s`` during its forward and finishes the
report at the next ``agent.step`` (``on_step_begin`` of step ``s + 1``); the sinks' worker thread
then hands it to this callback's sink. The Trainer logs after optimizer step ``s`` at
``global_step = s + 1``, before step ``s + 1`` begins, so at a log at ``global_step = G`` the newest
report that can have arrived is that of step ``G - 2`` (with ``every=1``; otherwise the last report
step at or before ``G - 2``), and an earlier one when the worker has not caught up. Each ``on_log``
adds the newest report that arrived since the previous log, once (older ones that arrived in between
are skipped: one dict holds one value per key; a log with no new report gets no keys), with
``qkwatch/step``: the report's own step. The reporters write all of it at ``G``; plot against
``qkwatch/step`` (W&B's ``define_metric(step_metric=...)``) for the report's own step. The reports
finished at the end of training (the last one, and any not yet taken) reach the collector and any
sink given to the agent, not the Trainer's logs, whose last ``on_log`` has passed.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, MutableMapping
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler

from qkwatch.agent import scalar_tag
from qkwatch.integrations.latest import LatestReports, chosen_metrics

logger = logging.getLogger(__name__)

STEP_KEY = scalar_tag("step")
"""``qkwatch/step``: the step of the report whose values a log carries."""
PRINTERS = frozenset({"ProgressCallback", "PrinterCallback", "NotebookProgressCallback"})
"""The Trainer's callbacks that print each log to the console (found by class name, subclasses too)."""
MAX_FRAMES = 8
"""How far up the call stack :func:`calling_handler` looks."""


class TrackerLogs:
    """The part of ``QKWatchCallback`` that adds qkwatch's layers to the Trainer's logs; see the module."""

    def __init__(self, choice: bool | Iterable[str]) -> None:
        self.metrics = chosen_metrics(choice)
        self.sink: LatestReports | None = None
        """The sink of the current training (None: switched off, or the handler was not found)."""
        self._added: list[str] = []  # the keys the last on_log added, for DropLayerKeys
        self._dropper = DropLayerKeys(self)
        self._warned = False

    def begin(self, callback: TrainerCallback) -> LatestReports | None:
        """At ``on_train_begin``: reorder the Trainer's callbacks; the sink to give the agent (None: none)."""
        self.sink = None
        if not self.metrics:
            return None
        handler = calling_handler(callback)
        if handler is None:
            self._warn_once()
            return None
        handler.callbacks = lead(handler.callbacks, callback, self._dropper)
        self.sink = LatestReports(self.metrics)
        return self.sink

    def add_to(self, logs: MutableMapping[str, Any]) -> None:
        """At ``on_log``: the newest report arrived since the last log, with ``qkwatch/step`` (nothing new: nothing)."""
        self._added = []
        if self.sink is None:
            return
        taken = self.sink.drain()
        if not taken:
            return
        step, values = taken[-1]
        values = {**values, STEP_KEY: step}
        logs.update(values)
        self._added = list(values)

    def drop_from(self, logs: MutableMapping[str, Any]) -> None:
        """Before the progress printer: the keys :meth:`add_to` added, removed."""
        for key in self._added:
            logs.pop(key, None)
        self._added = []

    def _warn_once(self) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "qkwatch: the Trainer's events do not come through a transformers CallbackHandler here, so "
                "qkwatch's per-layer values are not added to its logs (report_to); the run is watched as "
                "usual. Give the agent a sink instead: QKWatchCallback(..., sinks=['tensorboard'])"
            )


class DropLayerKeys(TrainerCallback):
    """Placed right before the progress printer: takes qkwatch's keys out of the logs before they are printed."""

    def __init__(self, owner: TrackerLogs) -> None:
        self._owner = owner

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: MutableMapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs is not None:
            self._owner.drop_from(logs)


def calling_handler(callback: TrainerCallback) -> CallbackHandler | None:
    """The ``CallbackHandler`` whose event is calling ``callback`` right now (its ``call_event``'s ``self``)."""
    frame = inspect.currentframe()
    try:
        for _ in range(MAX_FRAMES):
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, CallbackHandler) and any(cb is callback for cb in owner.callbacks):
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame held in a local keeps the whole stack alive


def lead(callbacks: list[TrainerCallback], first: TrainerCallback, dropper: TrainerCallback) -> list[TrainerCallback]:
    """A new list: ``first`` first, ``dropper`` right before the first printer (else last), the rest in order."""
    rest = [cb for cb in callbacks if cb is not first and cb is not dropper]
    at = next((i for i, cb in enumerate(rest) if _prints(cb)), len(rest))
    return [first, *rest[:at], dropper, *rest[at:]]


def _prints(callback: TrainerCallback) -> bool:
    return any(cls.__name__ in PRINTERS for cls in type(callback).__mro__)
