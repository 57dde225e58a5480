"""``RAATrainer``: a ``Trainer`` whose training loss adds RAA's PAR with its callback's lambdas."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import Trainer

from qkwatch.agent.metrics import TAU_FACTOR
from qkwatch.integrations.huggingface.callback import QKWatchCallback, unwrap
from qkwatch.raa import ParLoss


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
            unwrapped = unwrap(model)
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
