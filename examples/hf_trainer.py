"""A tiny Llama (grouped-query attention, RoPE) trained with the Hugging Face Trainer, watched by qkwatch
and steered by Rank-Anchored Attention. The model is built from a config: nothing is downloaded.

    python examples/hf_trainer.py                                         # offline: reports wait in the spool
    QKWATCH_URL=http://127.0.0.1:8000 python examples/hf_trainer.py       # into a collector (qkwatch serve)
    torchrun --nproc_per_node 2 examples/hf_trainer.py                    # one run, two ranks (DDP)

Needs ``pip install 'qkwatch[huggingface]'``. The agent's settings come from the environment
(``QKWATCH_URL``, ``QKWATCH_PROJECT``, ``QKWATCH_RUN``, ``QKWATCH_SPOOL``, ...). Without a collector,
``qkwatch sync .qkwatch/spool`` delivers the run later.

Two things make this qkwatch's: ``QKWatchCallback`` attaches the agent when training begins, reports
every ``--every`` optimizer steps, stores every value the Trainer logs and closes the run
``finished`` (or ``crashed`` with the reason: the ``with`` block); ``RAATrainer`` is the Trainer
whose ``compute_loss`` adds ``qkwatch.raa.par_loss(model, agent.lambdas())``, the principal-angle
penalty weighted by the collector's per-layer lambdas, once per optimizer step.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from qkwatch.integrations.huggingface import QKWatchCallback, RAATrainer

logger = logging.getLogger("hf_trainer")


class Copying(Dataset[dict[str, torch.Tensor]]):
    """Random tokens, then the same tokens again: the second half is learnt by attending back (induction)."""

    def __init__(self, size: int, length: int = 32, vocab: int = 64, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        half = torch.randint(0, vocab, (size, length // 2), generator=gen)
        self.tokens = torch.cat([half, half], dim=1)  # (size, length)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def tiny_llama() -> LlamaForCausalLM:
    """4 layers, 4 query heads sharing 2 key/value heads (GQA), width 64."""
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--every", type=int, default=10, help="report every N optimizer steps (default 10)")
    parser.add_argument("--project", default="examples", help="the run's project (default examples)")
    parser.add_argument("--name", help="the run's name (default: QKWATCH_RUN, else a new one)")
    parser.add_argument("--out", default=".qkwatch/hf_trainer", help="the Trainer's output folder")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    torch.manual_seed(0)
    model = tiny_llama()
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=min(20, args.steps // 10),
        logging_steps=max(1, min(10, args.steps // 4)),
        eval_strategy="steps",
        eval_steps=max(1, args.steps // 2),
        per_device_eval_batch_size=16,
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),  # several CPU processes (torchrun) then train with DDP over gloo
        report_to=[],
        disable_tqdm=True,
    )
    watch = QKWatchCallback(project=args.project, run=args.name, every=args.every, config={"example": "hf_trainer"})
    with watch:
        trainer = RAATrainer(
            model=model,
            args=training,
            train_dataset=Copying(512),
            eval_dataset=Copying(64, seed=1),
            callbacks=[watch],
        )
        trainer.train()
    if trainer.is_world_process_zero():
        last = trainer.state.log_history[-1]
        logger.info(
            "qkwatch run %s/%s: %d steps, train loss %.3f",
            args.project,
            watch.run,
            trainer.state.global_step,
            last["train_loss"],
        )


if __name__ == "__main__":
    main()
