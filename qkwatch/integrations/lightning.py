"""PyTorch Lightning: watch a LightningModule's attention while ``Trainer.fit`` runs.

    from qkwatch.integrations.lightning import QKWatchCallback

    trainer = L.Trainer(callbacks=[QKWatchCallback(project="p", run="r1", every=50)], log_every_n_steps=1)
    trainer.fit(module)      # QKWATCH_URL names the collector; unset, reports wait in the spool

**A Callback for the hooks, a Logger for the scalars, one agent per fit.** The geometry needs
what only a ``Callback`` sees: the model at fit start, the moment before each optimizer step's
forward, the end of the fit and its exceptions. The scalars are another matter: Lightning's
convention is that what ``self.log(...)`` records goes to the trainer's *loggers*, and
``Logger.log_metrics(metrics, step)`` receives each value once, with its step, at the cadence the
user chose (``log_every_n_steps``; validation and epoch ends), together with what other callbacks
log (``LearningRateMonitor``'s lr): the stream TensorBoard, CSV, W&B and MLflow loggers get. A
callback could only read ``trainer.callback_metrics`` or ``logged_metrics``, running dicts without
steps that keep a value until it is overwritten (the last validation loss sits there at every
later step), so it would have to guess which values are new. So :class:`QKWatchCallback` owns the
agent, and its :class:`QKWatchLogger` (``callback.logger``) hands Lightning's scalars to that same
agent. The callback adds its logger to ``trainer.loggers`` at ``setup`` unless it is there
already (``logger=[TensorBoardLogger(...), callback.logger]`` places it yourself), so
``callbacks=[callback]`` is the whole setup. The logger has no directory of its own: its
``save_dir`` is the trainer's ``default_root_dir`` and its name and version are empty, so even as
the only logger (``logger=False``) it moves no checkpoint and no ``trainer.log_dir``.

**Steps.** ``agent.step(trainer.global_step)`` runs in ``on_train_batch_start`` once per
optimizer step: with gradient accumulation only the window's first micro-batch calls it, and the
probe measures the first forward after it, so each optimizer step is measured once. Lightning
logs a training step's metrics at the same number (its count of optimizer steps before this one),
and a validation run or an epoch's end at the step that ran last before it. Which steps reach
any logger is Lightning's ``log_every_n_steps`` (default 50): 1 stores the loss of every step.
(With manual optimization and several ``optimizer.step()`` calls per batch, ``global_step``
counts every one while the loggers count batches.)

**Into the trainer's loggers** (``tracker_logs``, on by default). The other way round: qkwatch's
per-layer values (``qkwatch/qkai/layer_07``; the catalogue's primary per-layer metrics unless a list
is given) go to every logger of the trainer but the callback's own (TensorBoard, CSV, W&B,
MLflow...), each report at its own step: ``logger.log_metrics(values, step=report.step)``. The
agent hands its reports to a sink of the callback's (``qkwatch.integrations.latest``) on the sinks'
worker thread; ``on_train_batch_end`` takes on the training thread what has arrived and logs it,
and ``on_fit_end`` does once more after closing the agent (which finishes the last report and
waits for the worker), before Lightning finalizes its loggers, so every report step reaches them.
Not ``pl_module.log_dict``: it logs at ``trainer.global_step`` (the report of step ``s`` is finished
only at ``s + 1`` and reaches the sink later still), keeps only the steps ``log_every_n_steps``
lets through, and would hand the values to :class:`QKWatchLogger`, back into the agent. Only rank
0 logs (Lightning's loggers log on rank 0 alone), so under DDP the loggers get rank 0's layers
(``l % world == 0``); the collector has every layer.

**End.** ``on_fit_end`` closes the agent with ``finished``; ``on_exception`` (any exception in the
fit, KeyboardInterrupt included) with ``crashed`` and ``"Type: message"``. Metrics logged outside
``fit`` (``trainer.test`` afterwards) are not stored: the run ended with the fit.

**Ranks.** Under DDP (``strategy="ddp"``, ``"ddp_spawn"``) every process attaches at fit start,
where Lightning has set up ``torch.distributed``: the agent agrees one run name and attempt over
it, each rank measures layers ``l % world == rank`` and ships its own spool, and only rank 0's
scalars are stored (Lightning calls loggers on every rank; the agent keeps rank 0's). One run,
every layer, whatever the number of processes.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from argparse import Namespace
from collections.abc import Iterable, Mapping
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import Logger
except ImportError as exc:  # the extra is optional: say which one
    raise ImportError(
        "qkwatch.integrations.lightning needs PyTorch Lightning (the `lightning` package): "
        "pip install 'qkwatch[lightning]'"
    ) from exc
from torch import Tensor, nn

from qkwatch.agent import Agent, attach, exception_reason
from qkwatch.contract.values import clean_metric_name
from qkwatch.integrations.latest import LatestReports, chosen_metrics, with_sink

__all__ = ["QKWatchCallback", "QKWatchLogger"]

logger = logging.getLogger(__name__)

MAX_HPARAMS_BYTES = 64 * 1024
"""The module's and datamodule's hyperparameters go into the run config up to this size as compact JSON."""


class QKWatchCallback(pl.Callback):
    """Attaches the agent at fit start, steps it once per optimizer step, closes it at the end.

    Args:
        project: the run's project (else ``QKWATCH_PROJECT``, else ``default``).
        run: the run's name; the same project and name resumes the run (else ``QKWATCH_RUN``, else
            a generated name, the same on every rank).
        config: the run's config for the collector (``{"schedule": {...}}`` and anything free-form).
            The LightningModule's and datamodule's ``save_hyperparameters()`` values are added
            under ``"hparams"`` unless ``config`` has that key.
        every: report cadence in optimizer steps (else ``QKWATCH_EVERY``, else 50).
        module: dotted path of the submodule that holds the transformer (``"model"``,
            ``"net.backbone"``); default the LightningModule itself. A ``layout=`` is relative to it.
        close_timeout: seconds ``close`` may spend delivering at the end of the fit.
        tracker_logs: log qkwatch's per-layer values to the trainer's other loggers, each report at
            its step: True, the catalogue's primary per-layer metrics (QKAI, stable rank, attention
            entropy, logit max, lambda); a list of metric names, those; False, none.
        **settings: any other keyword of :func:`qkwatch.attach` (``url``, ``token``, ``spool``,
            ``tags``, ``notes``, ``layout``, ``heads``, ``sample_rows``...).

    After fit start ``callback.agent`` is the :class:`qkwatch.Agent` (``agent.run`` is the run's
    name, ``agent.lambdas()`` the RAA weights); ``callback.logger`` is its :class:`QKWatchLogger`.
    """

    def __init__(
        self,
        project: str | None = None,
        run: str | None = None,
        config: dict[str, Any] | None = None,
        every: int | None = None,
        *,
        module: str | None = None,
        close_timeout: float = 10.0,
        tracker_logs: bool | Iterable[str] = True,
        **settings: Any,
    ) -> None:
        super().__init__()
        self.project = project
        self.run = run
        self.config = dict(config or {})
        self.every = every
        self.module = module
        self.close_timeout = close_timeout
        self.settings = settings
        self.tracker_metrics = chosen_metrics(tracker_logs)
        self.agent: Agent | None = None
        self.logger = QKWatchLogger(self)
        self._latest: LatestReports | None = None
        self._stepped: int | None = None  # the optimizer step last given to agent.step
        self._fitting = False
        self._warned: set[str] = set()

    # --- Lightning's hooks, in the order a fit calls them ----------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Before the loggers are first used: make sure this callback's logger is one of them."""
        self.logger.root_dir_of(trainer)
        if not any(existing is self.logger for existing in trainer.loggers):
            trainer.loggers = [*trainer.loggers, self.logger]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Attach (every rank: the process group is up and the model is on its device)."""
        target = pl_module.get_submodule(self.module) if self.module else pl_module
        config = {**self._hparams(trainer, pl_module), **self.config}
        self._latest = LatestReports(self.tracker_metrics) if self.tracker_metrics else None
        settings = with_sink(self.settings, self._latest)
        self.agent = attach(target, project=self.project, run=self.run, every=self.every, config=config, **settings)
        self._stepped = None
        self._fitting = True

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Before the forward: once per optimizer step (the first micro-batch of an accumulation window)."""
        step = trainer.global_step
        if self.agent is not None and self._fitting and step != self._stepped:
            self._stepped = step
            self.agent.step(step)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._to_loggers(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close("finished", None)
        self._to_loggers(trainer)  # the reports the close finished; the loggers are finalized after this hook

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close("crashed", exception_reason(exception))
        self._to_loggers(trainer)

    # --- what the logger hands over ----------------------------------------------------------------

    def log_scalars(self, metrics: Mapping[str, Any], step: int | None) -> None:
        """Store Lightning's logged values at ``step`` (rank 0's; the agent drops the others')."""
        agent = self.agent
        if agent is None or not self._fitting:
            self._warn_once("outside", "qkwatch: metrics logged outside Trainer.fit (validate, test) are not stored")
            return
        values: dict[str, float | Tensor] = {}
        for name, value in metrics.items():
            number = _number(value)
            if number is None:
                self._warn_once(f"value:{name}", f"qkwatch: {name!r} is not a number ({type(value).__name__}); skipped")
                continue
            stored = clean_metric_name(name)
            if stored != name:
                self._warn_once(f"name:{name}", f"qkwatch: metric {name!r} is stored as {stored!r}")
            values[stored] = number
        if values:
            agent.log((self._stepped or 0) if step is None else step, **values)

    # --- helpers ------------------------------------------------------------------------------------

    def _to_loggers(self, trainer: pl.Trainer) -> None:
        """The reports that have reached the callback's sink, to every other logger at their own steps (rank 0)."""
        if self._latest is None:
            return
        taken = self._latest.drain()
        if not trainer.is_global_zero:
            return
        for step, values in taken:
            for each in trainer.loggers:
                if each is not self.logger:  # ours would hand them back to the agent
                    each.log_metrics(values, step=step)

    def _close(self, status: str, reason: str | None) -> None:
        self._fitting = False
        if self.agent is not None:
            self.agent.close(self.close_timeout, status=status, reason=reason)

    def _hparams(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """``{"hparams": ...}``: what ``save_hyperparameters()`` kept (Lightning's loggers get the same), JSON-safe."""
        params: dict[str, Any] = {}
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None:
            params.update(datamodule.hparams_initial)
        params.update(pl_module.hparams_initial)
        if not params:
            return {}
        plain = _plain(params)
        size = len(json.dumps(plain, separators=(",", ":")))
        if size > MAX_HPARAMS_BYTES:
            logger.warning("qkwatch: hyperparameters (%d bytes as JSON) left out of the run config", size)
            return {}
        return {"hparams": plain}

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


class QKWatchLogger(Logger):
    """Lightning's logged scalars into the agent of a :class:`QKWatchCallback` (``callback.logger``).

    Build it through the callback: it has no agent of its own. Each ``log_metrics`` call stores
    every value at the step Lightning gives; names outside the collector's alphabet are renamed
    (see :func:`qkwatch.contract.wire.clean_metric_name`). Hyperparameters reach the run config at attach, so
    ``log_hyperparams`` has nothing left to do.
    """

    def __init__(self, callback: QKWatchCallback) -> None:
        super().__init__()
        self._callback = callback
        self._root_dir: str | None = None

    @property
    def name(self) -> str:
        """Empty: in checkpoint paths this logger stands for "no logger"."""
        return ""

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str | None:
        """The trainer's ``default_root_dir``, where Lightning writes when there is no logger."""
        return self._root_dir

    def root_dir_of(self, trainer: pl.Trainer) -> None:
        self._root_dir = trainer.default_root_dir

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        self._callback.log_scalars(metrics, step)

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: the callback put them in the run config when it attached (the fit's start)."""


def _number(value: Any) -> float | Tensor | None:
    """A loggable scalar: a real number, or a one-element tensor (copied with the next report)."""
    if isinstance(value, Tensor):
        return value.reshape(()) if value.numel() == 1 else None
    if isinstance(value, numbers.Real):  # numpy scalars too; a bool logs 1.0 or 0.0
        return float(value)
    return None


def _plain(value: Any, depth: int = 0) -> Any:
    """JSON-ready: dicts, lists, strings, finite numbers; anything else (and a non-finite float) as text."""
    if depth > 8:
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, nn.Module):
        return type(value).__name__
    return str(value)
