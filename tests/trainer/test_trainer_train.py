"""The training loop: resume, the monitor seam, RAA's effect, the export, the CLI and eval."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qkwatch.agent.metrics import qkai, split_heads
from qkwatch.trainer.checkpoints.checkpoint import FORMAT, export_model, load_exported
from qkwatch.trainer.model.gpt import GPT
from qkwatch.trainer.model.init import init_weights
from qkwatch.trainer.model.rank_anchored import ScheduleConfig
from qkwatch.trainer.reporting.metrics_log import MetricsLog
from qkwatch.trainer.reporting.monitoring import NullMonitor, crash_reason, open_monitor
from qkwatch.trainer.run.train import run

ROOT = Path(__file__).resolve().parents[2]


def _curve(out) -> list[tuple[int, float]]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(x["step"], x["loss"]) for x in lines if "loss" in x]


def test_resumed_run_has_the_uninterrupted_loss_curve(tiny_run, tmp_path):
    # sigma-Reparam (a persistent power-iteration buffer), RAA with its rotation, GQA, warmup+cosine
    cfg = tiny_run(steps=8, model={"variant": "sigma_reparam", "n_kv_heads": 2}, checkpoint={"every": 2, "keep": 1})
    straight = run(cfg, tmp_path / "straight")
    stopped = run(cfg, tmp_path / "resumed", stop_after=5)
    assert stopped.steps == 5
    assert [p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()] == ["step-0000005"]
    resumed = run(cfg, tmp_path / "resumed", resume=True)
    assert straight.steps == resumed.steps == 8
    assert _curve(tmp_path / "straight") == _curve(tmp_path / "resumed")  # bitwise, steps 0..7
    a, b = load_exported(tmp_path / "straight" / "model.pt"), load_exported(tmp_path / "resumed" / "model.pt")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    info = json.loads((tmp_path / "resumed" / "run.json").read_text())
    assert [x["start_step"] for x in info["attempts"]] == [0, 5]  # the same collector run, a new attempt


def test_without_a_collector_the_local_schedule_steers_raa_and_resumes_bit_for_bit(
    tiny_run, tmp_path, monkeypatch, caplog
):
    """No QKWATCH_URL: the agent attaches offline, its entropy-floor lambdas are what RAA applies
    (not lambda_0 everywhere), the log says so, and a resume restores the schedule's state."""
    monkeypatch.delenv("QKWATCH_URL", raising=False)
    monkeypatch.delenv("QKWATCH_SPOOL", raising=False)
    cfg = tiny_run(steps=24, init={"qk_regime": "qk_identical", "qk_layers": [1, 2]}, checkpoint={"every": 4})
    with caplog.at_level(logging.INFO, logger="qkwatch.trainer.run.train"):
        run(cfg, tmp_path / "straight")
    assert any("RAA lambdas from the agent's local entropy-floor schedule" in r.message for r in caplog.records)
    records = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in records if "lambda" in x]
    assert {x["lambda_source"] for x in steps} == {"local"}
    schedule = ScheduleConfig(**cfg.to_dict()["schedule"])
    late = steps[-1]["lambda"]
    assert 0 < max(late) <= schedule.lambda_0 and late != [schedule.lambda_0] * 4  # the schedule, not the fallback
    assert list((tmp_path / "straight" / "spool").rglob("seg-*.log"))  # reports kept for `qkwatch sync`
    run(cfg, tmp_path / "resumed", stop_after=14)  # between two lambda exchanges (every 10 steps)
    run(cfg, tmp_path / "resumed", resume=True)
    assert _curve(tmp_path / "straight") == _curve(tmp_path / "resumed")


def test_a_finished_run_folder_is_not_overwritten(tiny_run, tmp_path):
    cfg = tiny_run(steps=1)
    run(cfg, tmp_path)
    with pytest.raises(ValueError, match="--resume"):
        run(cfg, tmp_path)


class RecordingMonitor:
    lambda_source = "collector"
    """Implements the monitor protocol and records the calls (the agent replaces it in production)."""

    def __init__(self, lambdas=None):
        self.calls, self.advice, self.closed = [], lambdas, 0

    def step(self, step):
        self.calls.append(("step", step))

    def lambdas(self):
        self.calls.append(("lambdas", None))
        return self.advice

    def log(self, step, **scalars):
        self.calls.append(("log", step, scalars))

    def log_layers(self, step, values):
        self.calls.append(("log_layers", step, values))

    def close(self, timeout=10.0, *, status="finished", reason=None):
        self.closed += 1
        self.status = (status, reason)

    def state_dict(self):
        return {}

    def load_state_dict(self, states):
        pass


def numpy_par(wq: np.ndarray, wk: np.ndarray, n_heads: int, n_kv_heads: int, tau_factor: float) -> float:
    """``sum_h ReLU(sum_i c_i^2 - tau)^2``, tau = tau_factor * d_head, from float64 SVDs of each head
    (``nn.Linear`` layout in: rows ``h * d_head ...`` are head h; query head h reads key head h // group)."""
    d_head = wq.shape[0] // n_heads
    group = n_heads // n_kv_heads
    total = 0.0
    for h in range(n_heads):
        g = h // group
        uq = np.linalg.svd(wq[h * d_head : (h + 1) * d_head].T, full_matrices=False)[0]
        uk = np.linalg.svd(wk[g * d_head : (g + 1) * d_head].T, full_matrices=False)[0]
        overlap = (np.linalg.svd(uq.T @ uk, compute_uv=False) ** 2).sum()
        total += max(overlap - tau_factor * d_head, 0.0) ** 2
    return total


def test_the_loop_calls_the_monitor_in_order_and_applies_its_lambdas(tiny_run, tmp_path):
    cfg = tiny_run(steps=3, init={"qk_regime": "qk_identical", "qk_layers": [1, 3]})
    advice = [0.0, 2e-3, 0.0, 5e-3]  # e.g. an operator override of layers 1 and 3
    monitor = RecordingMonitor(advice)
    run(cfg, tmp_path, monitor=monitor)
    assert monitor.closed == 1
    kinds = [c[0] for c in monitor.calls if c[0] != "log" or "val_loss" not in c[2]]
    assert kinds == ["step", "lambdas", "log", "log", "log_layers"] * 3
    assert [c[2] for c in monitor.calls if c[0] == "log" and "raa_flagged_fraction" in c[2]] == [
        {"raa_flagged_fraction": 0.5}
    ] * 3  # layers 1 and 3 of 4 above the floor
    for step in range(3):
        layers = next(c[2] for c in monitor.calls if c[0] == "log_layers" and c[1] == step)
        assert layers["lambda"] == advice  # the lambda metric shows what was applied
        par = layers["par"]
        assert par.shape == (4,) and par[0] == 0 and par[2] == 0 and par[1] > 0  # layers 1 and 3 start aligned
        scalars = next(c[2] for c in monitor.calls if c[0] == "log" and c[1] == step)
        assert set(scalars) == {"loss", "lr", "grad_norm", "par"}
        torch.testing.assert_close(scalars["par"], par.sum())  # the loss term is the sum of the layers' terms
    # Step 0 trains the initial weights, which depend on the config and seed alone: rebuilt here,
    # each layer's PAR_l comes from numpy SVDs, and the loss term must be sum_l k lambda_l PAR_l.
    model = GPT(cfg.model_config())
    init_weights(model, cfg.init, cfg.seed)
    raa = cfg.raa
    reference = []
    for block in model.blocks:
        attn = block.attn
        wq, wk = (w.detach().double().numpy() for w in (attn.q_proj.weight, attn.k_proj.weight))
        reference.append(numpy_par(wq, wk, attn.n_heads, attn.n_kv_heads, raa.tau_factor))
    d_head, n_heads = model.blocks[1].attn.d_head, model.blocks[1].attn.n_heads
    aligned = n_heads * (d_head * (1 - raa.tau_factor)) ** 2  # every c_i = 1
    assert reference[1] == pytest.approx(aligned, rel=1e-5) and reference[3] == pytest.approx(aligned, rel=1e-5)
    expected = [raa.every * lam * p for lam, p in zip(advice, reference, strict=True)]
    first_layers = next(c[2] for c in monitor.calls if c[0] == "log_layers" and c[1] == 0)
    first = next(c[2] for c in monitor.calls if c[0] == "log" and c[1] == 0)
    np.testing.assert_allclose(first_layers["par"].double().numpy(), expected, rtol=1e-4, atol=1e-9)
    assert first["par"].item() == pytest.approx(sum(expected), rel=1e-4)


def test_open_monitor_attaches_the_agent_only_with_a_collector(monkeypatch, tmp_path, tiny_model):
    monkeypatch.delenv("QKWATCH_URL", raising=False)
    assert isinstance(open_monitor(tiny_model(), config={}, run=None, project=None), NullMonitor)
    monkeypatch.setenv("QKWATCH_URL", "http://127.0.0.1:9")  # refused: the agent works offline
    monkeypatch.setenv("QKWATCH_SPOOL", str(tmp_path))
    monitor = open_monitor(tiny_model(), config={"n_layers": 2}, run="r", project="p", every=3)
    assert type(monitor).__name__ == "Agent" and monitor.cfg.every == 3 and monitor.run == "r"
    monitor.close(1.0)
    monitor.close(1.0)  # idempotent


def test_with_qk_identical_init_raa_ends_with_lower_mid_layer_qkai(tiny_run, tmp_path):
    """Seed 001's induced alignment on layers 1-2; RAA (fallback lambda_0 on every layer) pulls it down."""
    qkai_by_run = {}
    for enabled in (False, True):
        cfg = tiny_run(
            steps=12,
            raa={"enabled": enabled, "scheduling": False, "schedule": {"lambda_0": 1e-2, "lambda_max": 0.1}},
            init={"qk_regime": "qk_identical", "qk_layers": [1, 2]},
        )
        run(cfg, tmp_path / str(enabled))
        model = load_exported(tmp_path / str(enabled) / "model.pt")
        qkai_by_run[enabled] = [
            qkai(split_heads(b.attn.q_proj.weight.detach(), 4), split_heads(b.attn.k_proj.weight.detach(), 4))
            .mean()
            .item()
            for b in model.blocks
        ]
    without, with_raa = qkai_by_run[False], qkai_by_run[True]
    assert min(without[1:3]) > 0.99  # the induced band persists without RAA
    assert max(with_raa[1:3]) < without[1] - 0.03 and max(with_raa[1:3]) < without[2] - 0.03


def test_export_round_trip(tiny_model, tmp_path):
    model = tiny_model(variant="qk_norm", key_rotation=4, n_kv_heads=2)
    export_model(model, tmp_path / "m.pt", meta={"step": 3})
    payload = torch.load(tmp_path / "m.pt", weights_only=True)
    assert payload["format"] == FORMAT and payload["config"] == dataclasses.asdict(model.config)
    assert payload["config"]["n_layers"] == 2 and payload["config"]["key_rotation"] == 4
    assert "blocks.0.attn.key_rotation.vectors" in payload["model"] and payload["meta"] == {"step": 3}
    back = load_exported(tmp_path / "m.pt")
    idx = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(back(idx).logits, model.eval()(idx).logits)
    torch.save({"format": "other"}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="qkwatch-gpt"):
        load_exported(tmp_path / "bad.pt")


def test_qkwatch_train_and_eval_from_the_command_line(tmp_path, capsys, monkeypatch):
    from qkwatch.cli import main

    monkeypatch.delenv("QKWATCH_URL", raising=False)
    out = tmp_path / "run"
    sets = [
        "init.qk_layers=[1]",
        "model.n_layers=2",
        "model.d_model=32",
        "train.steps=3",
        "train.log_every=1",
        "data.task_mix=0.5",
        "model.variant=outlier_removed",
        "raa.scheduling=false",
    ]
    argv = ["train", "--recipe", "debug_cpu", "--out", str(out)] + [x for s in sets for x in ("--set", s)]
    assert main(argv) == 0
    assert (out / "model.pt").is_file() and len(_curve(out)) == 3
    config = json.loads((out / "config.json").read_text())
    assert config["recipe"] == "debug_cpu" and config["variant"] == "outlier_removed" and config["seed"] == 0
    assert config["model"]["n_layers"] == 2 and config["schedule"] == config["raa"]["schedule"]
    capsys.readouterr()
    assert main(["eval", str(out), "--task", "binding", "--task", "perplexity", "--samples", "4", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["step"] == 3
    assert {r["name"] for r in results["results"]} == {"binding_acc_64", "ppl_16", "ppl_64"}  # 2 hops need 45
    assert main(["train", "--recipe", "debug_cpu", "--set", "model.n_layerz=2"]) == 2
    assert "unknown config key 'model.n_layerz'" in capsys.readouterr().err


def test_python_dash_m_trains_from_the_command_line():
    """``python -m qkwatch.trainer`` is the command (what torchrun runs); ``train.py`` is a module, not a script."""
    done = subprocess.run(
        [sys.executable, "-m", "qkwatch.trainer", "--list"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    header, first = done.stdout.splitlines()[:2]
    assert header.split() == ["recipe", "layers", "d_model", "params"]
    assert first.split()[0] == "debug_cpu" and "collapse_cpu" in done.stdout


def test_python_dash_m_ends_quietly_when_its_reader_closes_the_pipe():
    """``python -m qkwatch.trainer --list | head -3`` at its extreme, the reader gone before the first line:
    status 1, no traceback."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "qkwatch.trainer", "--list"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=300) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


def test_crash_reason_names_the_exception_and_says_how_to_continue_after_an_interrupt():
    assert (
        crash_reason(RuntimeError("CUDA out of memory\nTried to allocate 2 GiB")) == "RuntimeError: CUDA out of memory"
    )
    assert crash_reason(KeyboardInterrupt()).startswith("interrupted: KeyboardInterrupt; continue")


def test_metrics_log_appends_records_and_a_resume_cuts_it_back(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.truncate(3)  # a fresh run folder: nothing to cut
    assert not log.path.exists()
    for step in range(5):
        log.append({"step": step, "loss": 1.0 / (step + 1)})
    log.append({"step": 4, "val_loss": 0.5})
    log.truncate(3)
    assert [json.loads(x) for x in log.path.read_text().splitlines()] == [
        {"step": 0, "loss": 1.0},
        {"step": 1, "loss": 0.5},
        {"step": 2, "loss": 1.0 / 3},
    ]
    log.truncate(0)
    assert log.path.read_text() == ""


def test_eval_passkey_with_one_and_five_needles(tiny_model, tmp_path):
    from qkwatch.trainer.run.evals import evaluate, load_checkpoint

    export_model(tiny_model(max_seq_len=256), tmp_path / "model.pt")
    loaded = load_checkpoint(tmp_path / "model.pt")
    results = {r.name: r for r in evaluate(loaded, ["passkey"], None, samples=5, seed=0)}
    # 1 needle fits at 128 and 256 tokens, 5 needles only at 256; an untrained model retrieves nothing
    assert set(results) == {
        "passkey1_acc_128",
        "passkey1_acc_256",
        "passkey5_acc_256",
        "passkey1_digits_128",
        "passkey1_digits_256",
        "passkey5_digits_256",
    }
    assert results["passkey5_acc_256"].n == 5 and all(0 <= r.value <= 1 for r in results.values())


def test_eval_scores_a_model_that_knows_the_answer():
    """``accuracy`` is right when the model predicts the next token: a copy-the-answer oracle scores 1."""
    from qkwatch.trainer.run.data import passkey
    from qkwatch.trainer.run.evals import accuracies, accuracy

    samples = passkey(__import__("random").Random(0), 80, 1)

    class Oracle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, idx):
            full = torch.tensor([samples[0].tokens])
            logits = torch.nn.functional.one_hot(full[:, 1:], 256).float()[:, : idx.shape[1]]

            class Out:
                pass

            out = Out()
            out.logits = logits
            return out

    assert accuracy(Oracle(), samples) == 1.0
    assert accuracies(Oracle(), samples) == (1.0, 1.0)

    class WrongLastDigit(Oracle):
        """Right on every answer token but the last: no exact answer, (n - 1) / n of the digits."""

        def forward(self, idx):
            out = super().forward(idx)
            _start, end = samples[0].answers[-1]
            out.logits = out.logits.clone()
            out.logits[0, end - 2] = out.logits[0, end - 2].roll(1)
            return out

    ((start, end),) = samples[0].answers
    assert accuracies(WrongLastDigit(), samples) == (0.0, pytest.approx((end - start - 1) / (end - start)))


@pytest.mark.parametrize("options", [{"activation_checkpointing": True}, {"compile": True, "compile_backend": "eager"}])
def test_activation_checkpointing_and_compile_change_nothing(tiny_run, tmp_path, options):
    """Same losses with the speed options on (PAR included: it is recomputed inside the checkpointed block)."""
    cfg = tiny_run(steps=3, init={"qk_regime": "qk_identical", "qk_layers": [1, 2]})
    run(cfg, tmp_path / "plain")
    run(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **options)), tmp_path / "fast")
    plain, fast = _curve(tmp_path / "plain"), _curve(tmp_path / "fast")
    assert [s for s, _ in fast] == [0, 1, 2]
    for (_, a), (_, b) in zip(plain, fast, strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def test_eval_reads_a_dcp_checkpoint_folder(tiny_run, tmp_path):
    from qkwatch.trainer.run.evals import evaluate, load_checkpoint

    run(tiny_run(steps=2), tmp_path)
    from_dcp = load_checkpoint(tmp_path / "checkpoints" / "step-0000002")
    from_export = load_checkpoint(tmp_path / "model.pt")
    assert from_dcp.step == from_export.step == 2
    for (name, a), b in zip(from_dcp.model.state_dict().items(), from_export.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    (ppl,) = evaluate(from_dcp, ["perplexity"], [16], samples=2, seed=0)
    assert ppl.name == "ppl_16" and ppl.value > 1


def test_sigterm_checkpoints_and_stops_so_that_resume_continues(tiny_run, tmp_path):
    import os
    import signal

    class Preempting(RecordingMonitor):
        def step(self, step):
            super().step(step)
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler only records it

    cfg = tiny_run(steps=6)
    previous = signal.getsignal(signal.SIGTERM)
    stopped = run(cfg, tmp_path, monitor=Preempting())
    assert signal.getsignal(signal.SIGTERM) is previous  # handler restored
    assert stopped.steps == 3 and (tmp_path / "checkpoints" / "step-0000003").is_dir()
    assert not (tmp_path / "model.pt").exists()
    assert run(cfg, tmp_path, resume=True).steps == 6
