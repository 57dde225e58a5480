"""Seed 000's evaluations: passkey retrieval (1 and 5 needles), variable binding, perplexity.

``qkwatch eval CHECKPOINT --task passkey|binding|perplexity`` loads a ``model.pt`` export, a run
folder or a DCP checkpoint folder, runs the tasks at several context lengths, prints a table and
logs each result through the monitor (to the collector when ``QKWATCH_URL`` / ``--collector`` is
set, under the checkpoint's run).

Accuracy is greedy: an answer counts when the argmax at every answer position, with the true
answer's earlier tokens in the context, is the true token (the same as greedy decoding the answer).
Passkey also reports the *digit* accuracy (``passkey{n}_digits_{L}``), the fraction of the key's
tokens predicted right one by one (teacher-forced): a small model that retrieves part of the key, or
none, reads above or at the 1-in-10 of a guessed digit where the exact accuracy reads 0.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from qkwatch.trainer.run.data import DataConfig, TaskSample, TrainData, binding, passkey, passkey_min_length

if TYPE_CHECKING:
    from qkwatch.trainer.model.gpt import GPT

logger = logging.getLogger(__name__)

TASK_NAMES = ("passkey", "binding", "perplexity")


@dataclass
class EvalResult:
    task: str
    """passkey, binding or perplexity."""
    name: str
    """Metric name as logged, e.g. ``passkey5_acc_256``."""
    length: int
    """Context length in tokens."""
    value: float
    n: int
    """Samples (queries, or windows for perplexity)."""


@dataclass
class Loaded:
    model: GPT
    step: int | None
    run: str | None
    project: str | None
    corpus: str
    config: dict[str, Any] = field(default_factory=dict)
    """The run's config.json: what its training sent the collector (empty when the folder has none)."""


# --- loading -----------------------------------------------------------------------------------------


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Loaded:
    """A model.pt export, a run folder (its model.pt, else its latest checkpoint) or a DCP step folder."""
    from qkwatch.trainer.checkpoints.checkpoint import load_exported, load_model_state

    path = Path(path)
    if path.is_dir() and (path / "model.pt").is_file():
        path = path / "model.pt"
    if path.is_file():
        model, step = load_exported(path, device), exported_meta(path).get("step")
        run_dir = path.parent
    elif path.is_dir():
        run_dir, step_dir = _run_and_step_dirs(path)
        model = _model_of(run_dir / "config.json")
        step = load_model_state(step_dir, model)
        model = model.to(device).eval()
    else:
        raise ValueError(f"{path}: no such checkpoint file or folder")
    info = _read_json(run_dir / "run.json")
    config = _read_json(run_dir / "config.json")
    corpus = config.get("data", {}).get("corpus", "pydoc")
    return Loaded(model, step, info.get("run"), info.get("project"), corpus, config)


def exported_meta(path: Path) -> dict[str, Any]:
    """The ``meta`` of a qkwatch-gpt export (read with ``weights_only=True``, as :func:`load_exported` does)."""
    from qkwatch.trainer.checkpoints.checkpoint import read_export

    meta = read_export(path).get("meta", {})
    return meta if isinstance(meta, dict) else {}


def _model_of(config_file: Path) -> GPT:
    """An untrained GPT of the run's ``config.json``; a config that does not describe one is a BadCheckpoint."""
    from qkwatch.trainer.checkpoints.safety import BadCheckpoint
    from qkwatch.trainer.model.config import ModelConfig
    from qkwatch.trainer.model.gpt import GPT

    try:
        return GPT(ModelConfig(**_read_json(config_file)["model"]))
    except BadCheckpoint:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise BadCheckpoint(f"{config_file}: no model this version can build ({type(exc).__name__}: {exc})") from None


def _run_and_step_dirs(path: Path) -> tuple[Path, Path]:
    if (path / ".metadata").is_file():  # a DCP step folder: <run>/checkpoints/step-N
        return path.parent.parent, path
    from qkwatch.trainer.checkpoints.checkpoint import CheckpointConfig, Checkpointer

    latest = Checkpointer(path / "checkpoints", CheckpointConfig()).latest()
    if latest is None or not (path / "config.json").is_file():
        raise ValueError(f"{path} is neither a run folder (config.json and checkpoints/) nor a DCP checkpoint")
    return path, latest


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of the run folder ({} when absent); anything else is a BadCheckpoint naming it."""
    from qkwatch.trainer.checkpoints.safety import BadCheckpoint

    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadCheckpoint(f"{path}: not readable JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(value, dict):
        raise BadCheckpoint(f"{path}: holds a JSON {type(value).__name__}, not an object")
    return value


# --- scoring -------------------------------------------------------------------------------------------


@torch.no_grad()
def accuracy(model: torch.nn.Module, samples: list[TaskSample], batch_size: int = 16) -> float:
    """Fraction of samples whose every answer span is predicted exactly (greedy, teacher-forced)."""
    return accuracies(model, samples, batch_size)[0]


@torch.no_grad()
def accuracies(model: torch.nn.Module, samples: list[TaskSample], batch_size: int = 16) -> tuple[float, float]:
    """``(exact, per token)``: the fraction of samples whose every answer token is predicted, and the
    fraction of all answer tokens predicted (greedy, teacher-forced)."""
    device = next(model.parameters()).device
    correct, hits, tokens_scored = 0, 0, 0
    for i in range(0, len(samples), batch_size):
        chunk = samples[i : i + batch_size]
        tokens = torch.tensor([s.tokens for s in chunk], device=device)  # (b, L)
        pred = model(tokens[:, :-1]).logits.argmax(-1)  # (b, L-1): pred[:, j] guesses tokens[:, j+1]
        for row, sample in enumerate(chunk):
            right = [pred[row, s - 1 : e - 1] == tokens[row, s:e] for s, e in sample.answers]
            correct += all(bool(r.all()) for r in right)
            hits += sum(int(r.sum()) for r in right)
            tokens_scored += sum(r.numel() for r in right)
    return correct / max(1, len(samples)), hits / max(1, tokens_scored)


def passkey_eval(model: torch.nn.Module, lengths: list[int], samples: int, seed: int) -> list[EvalResult]:
    out = []
    for needles in (1, 5):
        for length in lengths:
            if length < passkey_min_length(needles):
                logger.info(
                    "passkey with %d needle(s) needs >= %d tokens: skipping length %d",
                    needles,
                    passkey_min_length(needles),
                    length,
                )
                continue
            rng = random.Random(f"passkey:{seed}:{needles}:{length}")
            contexts = max(1, samples // needles)
            batch = [s for _ in range(contexts) for s in passkey(rng, length + 1, needles)]
            exact, digits = accuracies(model, batch)
            out.append(EvalResult("passkey", f"passkey{needles}_acc_{length}", length, exact, len(batch)))
            out.append(EvalResult("passkey", f"passkey{needles}_digits_{length}", length, digits, len(batch)))
    return out


def binding_eval(
    model: torch.nn.Module, lengths: list[int], samples: int, seed: int, hops: int = 2
) -> list[EvalResult]:
    out = []
    for length in lengths:
        rng = random.Random(f"binding:{seed}:{hops}:{length}")
        try:
            batch = [binding(rng, length + 1, hops) for _ in range(samples)]
        except ValueError as exc:
            logger.info("binding: %s; skipping length %d", exc, length)
            continue
        out.append(EvalResult("binding", f"binding_acc_{length}", length, accuracy(model, batch), len(batch)))
    return out


@torch.no_grad()
def perplexity_eval(model: torch.nn.Module, corpus: str, lengths: list[int], windows: int) -> list[EvalResult]:
    """Perplexity on the held-out tail of the corpus (the training run's validation split)."""
    device = next(model.parameters()).device
    data = TrainData(DataConfig(corpus=corpus), seq_len=max(lengths), global_batch=1, seed=0)
    out = []
    for length in lengths:
        rows = data.val_windows(windows, length).to(device)
        nll, count = 0.0, 0
        for chunk in torch.split(rows, 8):
            logits = model(chunk[:, :-1]).logits
            nll += F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
            count += chunk[:, 1:].numel()
        out.append(EvalResult("perplexity", f"ppl_{length}", length, math.exp(nll / count), len(rows)))
    return out


def default_lengths(task: str, max_len: int) -> list[int]:
    """Passkey at a quarter, half and all of the context; binding at half and all; perplexity short and long."""
    fractions = {"passkey": (4, 2, 1), "binding": (2, 1), "perplexity": (4, 1)}[task]
    return sorted({max(2, max_len // f) for f in fractions})


def evaluate(loaded: Loaded, tasks: list[str], lengths: list[int] | None, samples: int, seed: int) -> list[EvalResult]:
    model = loaded.model.eval()
    max_len = model.config.max_seq_len
    results = []
    for task in tasks:
        task_lengths = lengths or default_lengths(task, max_len)
        too_long = [n for n in task_lengths if n > max_len]
        if too_long:
            raise ValueError(f"lengths {too_long} exceed the model's max_seq_len={max_len}")
        if task == "passkey":
            results += passkey_eval(model, task_lengths, samples, seed)
        elif task == "binding":
            results += binding_eval(model, task_lengths, samples, seed)
        elif task == "perplexity":
            results += perplexity_eval(model, loaded.corpus, task_lengths, samples)
        else:
            raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASK_NAMES)}")
    return results


def format_table(results: list[EvalResult]) -> str:
    lines = [f"{'task':<12}{'metric':<24}{'length':>8}{'value':>12}{'n':>6}"]
    lines += [f"{r.task:<12}{r.name:<24}{r.length:>8}{r.value:>12.4f}{r.n:>6}" for r in results]
    return "\n".join(lines)
