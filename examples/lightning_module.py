"""Train a tiny transformer with PyTorch Lightning while qkwatch watches its attention.

    pip install 'qkwatch[torch,lightning]'
    qkwatch serve &                                   # a collector on http://127.0.0.1:8000
    QKWATCH_URL=http://127.0.0.1:8000 python examples/lightning_module.py
    python examples/lightning_module.py --devices 2  # DDP on the CPU: one run, layers from both ranks

Without ``QKWATCH_URL`` the reports wait in ``.qkwatch/spool``; ``qkwatch sync .qkwatch/spool``
delivers them later. The model is a small nanoGPT (``qkwatch.nanogpt.NanoGPT``, a layout the agent
finds by itself) learning to continue sequences that repeat their first half: attention has
something to learn (look back one half-length), so its geometry moves.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from qkwatch.integrations.lightning import QKWatchCallback
from qkwatch.nanogpt import NanoGPT

VOCAB, HALF = 64, 16


class TinyTransformer(L.LightningModule):
    def __init__(self, n_layer: int = 4, d_model: int = 64, n_head: int = 4, lr: float = 3e-3, steps: int = 300):
        super().__init__()
        self.save_hyperparameters()  # qkwatch stores them in the run's config, under "hparams"
        self.model = NanoGPT(vocab=VOCAB, d_model=d_model, n_head=n_head, n_layer=n_layer, block=2 * HALF)

    def _loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens[:, :-1])  # (B, T-1, vocab)
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch[0])
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch[0]), sync_dist=True)

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}


def repeats(n: int, seed: int) -> DataLoader:
    """Sequences ``a b ... a b ...``: a random first half, then the same half again."""
    half = torch.randint(0, VOCAB, (n, HALF), generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(torch.cat([half, half], dim=1)), batch_size=16, shuffle=seed == 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--every", type=int, default=25, help="qkwatch report cadence in steps")
    parser.add_argument("--devices", type=int, default=1, help="CPU processes (2 or more: DDP)")
    parser.add_argument("--project", default="examples")
    parser.add_argument("--run", default=None, help="run name (default: QKWATCH_RUN, else generated)")
    args = parser.parse_args()

    L.seed_everything(0)
    qkwatch = QKWatchCallback(project=args.project, run=args.run, every=args.every)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.steps,
        val_check_interval=min(100, args.steps),
        limit_val_batches=4,
        log_every_n_steps=1,  # what reaches the loggers (qkwatch's too): every step's loss and lr
        logger=CSVLogger("lightning_logs", name="tiny"),  # qkwatch adds its own logger beside yours
        callbacks=[qkwatch, LearningRateMonitor(logging_interval="step")],
        enable_checkpointing=False,
    )
    model = TinyTransformer(steps=args.steps)
    trainer.fit(model, repeats(16 * args.steps, seed=0), repeats(256, seed=1))

    agent = qkwatch.agent
    if trainer.is_global_zero and agent is not None:
        run, spool = f"{agent.cfg.project}/{agent.run}", agent.cfg.spool
        if agent.cfg.url:
            print(f"run {run}: reports sent to {agent.cfg.url}")  # noqa: T201
        else:
            print(f"run {run}: no QKWATCH_URL, so its reports wait in {spool}; `qkwatch sync {spool}` delivers them")  # noqa: T201


if __name__ == "__main__":
    main()
