"""qkwatch in the Hugging Face ``Trainer``: a callback that watches the run, a Trainer that adds RAA's PAR.

    from transformers import Trainer
    from qkwatch.integrations.huggingface import QKWatchCallback, RAATrainer

    with QKWatchCallback(project="llama", run="r1") as qk:       # a train() that raises: crashed, with the reason
        Trainer(model=model, args=args, train_dataset=data, callbacks=[qk]).train()

``RAATrainer`` in place of ``Trainer`` also adds ``sum_l lambda_l PAR_l`` with the collector's
lambdas to the loss (``qkwatch.raa``). Install with ``pip install 'qkwatch[huggingface]'``.

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

import atexit
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

try:
    import torch
    import transformers
    from accelerate.utils import extract_model_from_parallel  # type: ignore[import-untyped]  # no py.typed
    from torch import Tensor, nn
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:
    raise ImportError(
        f"qkwatch.integrations.huggingface needs transformers and accelerate ({exc}); "
        "install them with: pip install 'qkwatch[huggingface]'"
    ) from exc

from qkwatch.agent import Agent, Layout, attach, exception_reason
from qkwatch.raa import TAU_FACTOR, ParLoss

__all__ = ["QKWatchCallback", "RAATrainer", "metric_name", "run_config", "scalars"]

logger = logging.getLogger(__name__)

TRAINING_FIELDS = (
    "output_dir",
    "run_name",
    "seed",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "warmup_ratio",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "max_grad_norm",
    "optim",
    "bf16",
    "fp16",
    "torch_compile",
    "gradient_checkpointing",
    "logging_steps",
    "eval_strategy",
    "eval_steps",
)
"""The ``TrainingArguments`` a run's config keeps (under ``training``), where the installed version has them."""
MODEL_FIELDS = (
    "model_type",
    "_name_or_path",
    "architectures",
    "num_hidden_layers",
    "n_layer",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "hidden_size",
    "n_embd",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "n_positions",
    "rope_theta",
    "dtype",
    "torch_dtype",
)
"""The model config's fields a run's config keeps (under ``model``)."""
_NOT_IN_METRIC_NAME = re.compile(r"[^A-Za-z0-9_.:/-]")


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
        self._hooks = _ProcessHooks(self._uncaught, self._exiting)

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
        unwrapped = _unwrap(model)
        self.agent = attach(
            unwrapped,
            url=self.url,
            project=self.project,
            run=self.run or os.environ.get("QKWATCH_RUN") or _run_name(args),
            every=self.every,
            config=run_config(args, unwrapped, self.config),
            layout=self.layout,
            **self.settings,
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
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.agent is not None and logs:
            self.agent.log(state.global_step, **scalars(logs))

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


class RAATrainer(Trainer):
    """A ``Trainer`` whose training loss adds RAA's PAR with the lambdas of its :class:`QKWatchCallback`.

        trainer = RAATrainer(model=model, args=args, train_dataset=data, callbacks=[QKWatchCallback(...)])

    Once per optimizer step (on its first micro-batch) ``compute_loss`` adds
    ``sum_l lambda_l PAR_l`` (:class:`qkwatch.raa.ParLoss`; ``agent.lambdas()``: the collector's,
    or the agent's local schedule), weighted so that the step's gradient holds it exactly once,
    as in the project's trainer, whether or not the Trainer divides the micro-batch losses by the
    accumulation steps. Evaluation losses are left alone. The Trainer's logged ``loss`` is then
    the loss it optimises (PAR included); ``par`` is logged beside it (the mean over the logging
    window), and the per-layer terms go with the agent's reports (``par``, ``lambda``).

    To add PAR to another Trainer subclass, put this one first: ``class MySFT(RAATrainer, SFTTrainer)``.
    """

    def __init__(self, *args: Any, tau_factor: float = TAU_FACTOR, rank: int | None = None, **kwargs: Any) -> None:
        """``tau_factor`` and ``rank`` as in :class:`qkwatch.raa.ParLoss`; the rest is the Trainer's.

        Raises:
            ValueError: ``callbacks`` holds no QKWatchCallback, or more than one.
        """
        super().__init__(*args, **kwargs)
        found = [c for c in self.callback_handler.callbacks if isinstance(c, QKWatchCallback)]
        if len(found) != 1:
            raise ValueError(
                f"RAATrainer reads its lambdas from one QKWatchCallback in callbacks=[...]; found {len(found)}"
            )
        self.qkwatch: QKWatchCallback = found[0]
        self.tau_factor = tau_factor
        self.par_rank = rank
        self._par: ParLoss | None = None
        self._par_step: int | None = None
        self._par_logged: list[Tensor] = []

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self._par_step = None  # global_step starts again
        return super().train(*args, **kwargs)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Tensor | int | None = None,
    ) -> Any:
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if not (model.training and torch.is_grad_enabled()) or self._par_step == self.state.global_step:
            return out
        self._par_step = self.state.global_step  # the first micro-batch of this optimizer step
        par = self._par_term(model) * self._accumulation_weight(num_items_in_batch)
        if isinstance(out, tuple):  # return_outputs: (loss, outputs)
            return (out[0] + par, *out[1:])
        return out + par

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Adds ``par``, the mean PAR term of the steps since the last log, beside the Trainer's ``loss``."""
        if "loss" in logs and self._par_logged:
            logs["par"] = torch.stack(self._par_logged).mean().item()  # one sync per logging step, as for the loss
            self._par_logged.clear()
        super().log(logs, *args, **kwargs)

    def _par_term(self, model: nn.Module) -> Tensor:
        """``sum_l lambda_l PAR_l`` of this step, its per-layer terms handed to the agent's report."""
        agent = self.qkwatch.agent
        if self._par is None:
            unwrapped = _unwrap(model)
            self._par = ParLoss(unwrapped, tau_factor=self.tau_factor, rank=self.par_rank, layout=self.qkwatch.layout)
        lambdas = agent.lambdas() if agent is not None else None  # every rank, every step: they agree together
        terms = self._par.terms(lambdas) if lambdas is not None else [None] * self._par.n_layers
        computed = [t for t in terms if t is not None]
        total = torch.stack(computed).sum() if computed else self._par(None)
        self._par_logged.append(total.detach())
        if agent is not None:
            per_layer = torch.stack([t.detach() if t is not None else total.new_zeros(()) for t in terms])
            agent.log_layers(self.state.global_step, {"par": per_layer})
        return total

    def _accumulation_weight(self, num_items_in_batch: Tensor | int | None) -> float:
        """What makes one micro-batch's PAR count once in the step's gradient.

        ``Trainer.training_step`` divides a micro-batch's loss by the number of micro-batches of
        the step unless the loss is already normalised over the whole accumulated batch (the
        model takes ``num_items_in_batch``, or a ``compute_loss_func`` computes it; newer versions
        say so in ``loss_is_scaled_for_ga``): the same test, so the division is undone where it
        happens.
        """
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = bool(self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        if scaled:
            return 1.0
        return float(getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps))


# --- what the callback sends ----------------------------------------------------------------------


def run_config(args: TrainingArguments, model: nn.Module, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run's config: ``config`` over ``framework``, ``training`` (``TRAINING_FIELDS``, world size) and ``model``."""
    training = _json_fields(args.to_dict(), TRAINING_FIELDS)  # type: ignore[no-untyped-call]  # unannotated upstream
    training["world_size"] = args.world_size
    out: dict[str, Any] = {"framework": f"transformers {transformers.__version__}", "training": training}
    model_config = getattr(model, "config", None)
    if model_config is not None and callable(getattr(model_config, "to_dict", None)):
        out["model"] = _json_fields(model_config.to_dict(), MODEL_FIELDS)
    return {**out, **(config or {})}


def scalars(logs: Mapping[str, Any]) -> dict[str, float | Tensor]:
    """The numbers of a Trainer's logs (numbers and one-element tensors; booleans and text left out), by metric name."""
    out: dict[str, float | Tensor] = {}
    for key, value in logs.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[metric_name(key)] = float(value)
        elif isinstance(value, Tensor) and value.numel() == 1:
            out[metric_name(key)] = value.detach().reshape(())
    return out


def metric_name(key: str) -> str:
    """A log key as a collector metric name: ``[A-Za-z_][A-Za-z0-9_.:/-]{0,127}`` (others become ``_``)."""
    name = _NOT_IN_METRIC_NAME.sub("_", key)
    if not name or not (name[0].isascii() and (name[0].isalpha() or name[0] == "_")):
        name = "_" + name
    return name[:128]


def _json_fields(values: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """The ``keys`` of ``values`` whose value strict JSON can carry (no NaN or inf, no objects)."""
    return {k: values[k] for k in keys if k in values and _plain(values[k])}


def _plain(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (str, int, bool))


def _run_name(args: TrainingArguments) -> str | None:
    """``TrainingArguments.run_name`` when the user set it (older versions default it to the output folder)."""
    name = getattr(args, "run_name", None)
    if not name or name == args.output_dir:
        return None
    return str(name)


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP, DataParallel or ``torch.compile`` (Accelerate's own unwrapping)."""
    unwrapped = extract_model_from_parallel(model)
    return getattr(unwrapped, "_orig_mod", unwrapped) if isinstance(unwrapped, nn.Module) else model


class _ProcessHooks:
    """While a run is open: an uncaught exception (``sys.excepthook``, chained) or the process's exit closes it."""

    def __init__(self, on_exception: Callable[[BaseException], None], on_exit: Callable[[], None]) -> None:
        self._on_exception = on_exception
        self._on_exit = on_exit
        self._previous: Callable[[type[BaseException], BaseException, TracebackType | None], Any] = sys.excepthook
        self._armed = False

    def install(self) -> None:
        if self._armed:
            return
        self._armed = True
        self._previous = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self._at_exit)

    def remove(self) -> None:
        """Disarm; restore the previous hook unless another was chained on top of ours (ours then only passes on)."""
        if not self._armed:
            return
        self._armed = False
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous
        atexit.unregister(self._at_exit)

    def _excepthook(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous = self._previous
        if self._armed:
            try:
                self._on_exception(exc)
            except Exception:  # the exception being reported matters more than ours
                logger.exception("qkwatch: could not close the run after an uncaught exception")
        previous(exc_type, exc, tb)

    def _at_exit(self) -> None:
        if self._armed:
            self._on_exit()
