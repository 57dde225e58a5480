"""A tiny LightningModule (a nanoGPT inside, as ``self.net``) for the Lightning integration tests.

Run as a module it trains with ``QKWatchCallback`` under DDP on the CPU (the process Lightning
starts for rank 1 runs this same command)::

    python -m tests.integrations.lightning_tiny URL SPOOL ROOT_DIR STEPS [ddp|ddp_spawn]
"""

from __future__ import annotations

import sys

import lightning.pytorch as L
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from qkwatch.integrations.lightning import QKWatchCallback
from qkwatch.nanogpt import NanoGPT

VOCAB, T = 64, 17


class TinyLM(L.LightningModule):
    """Next-token loss on random tokens; ``fail_at`` raises in the training step of that optimizer step."""

    def __init__(self, n_layer: int = 2, lr: float = 3e-3, fail_at: int | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.net = NanoGPT(vocab=VOCAB, d_model=32, n_head=4, n_layer=n_layer, block=32)

    def loss(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(tokens[:, :-1])  # (B, T-1, vocab)
        target = tokens[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
        return loss, (logits.argmax(-1) == target).float().mean()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.hparams.fail_at is not None and self.global_step == self.hparams.fail_at:
            raise RuntimeError(f"loss is nan\nat step {self.global_step}")
        loss, _ = self.loss(batch[0])
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        loss, acc = self.loss(batch[0])
        self.log("val_loss", loss)
        self.log("val top-1 acc", acc)  # a name the collector's alphabet lacks: stored as val_top-1_acc

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))  # a new lr every step
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def loader(sequences: int, seed: int = 0) -> DataLoader:
    tokens = torch.randint(0, VOCAB, (sequences, T), generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(tokens), batch_size=4)


def trainer(root: str, steps: int, callbacks: list, **kwargs) -> L.Trainer:
    """A quiet CPU trainer that logs every step."""
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        max_epochs=1,
        log_every_n_steps=1,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )


def main(url: str, spool: str, root: str, steps: str, strategy: str = "ddp") -> int:
    torch.manual_seed(0)
    callback = QKWatchCallback(project="tests", run="ddp", every=2, url=url, spool=spool, flush_seconds=0.05)
    lr = L.callbacks.LearningRateMonitor(logging_interval="step")
    fit = trainer(root, int(steps), [callback, lr], devices=2, strategy=strategy, logger=False)
    fit.fit(TinyLM(), loader(4 * 2 * int(steps)), loader(8, seed=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
