"""The Hugging Face integration with the real Trainer and Accelerate, read back from a real collector.

Tiny models built from configs (no download): a Llama with grouped-query attention (RoPE, separate
q/k projections) and a GPT-2 (a fused Conv1D), trained on the CPU. What is checked: a run stored
whole (every layer at the agent's cadence, every value the Trainer logged at its step, the eval
metrics, status finished); a training that raises (crashed with the reason, through the ``with``
block and through the process hooks); two processes under ``torchrun`` as one run with ranks;
``qkwatch.raa.par_loss`` against the project's trainer and a closed form; ``RAATrainer``'s PAR
counted once per optimizer step whatever the Trainer's loss scaling; the example as written.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Trainer, TrainerCallback

from qkwatch.agent.shipping.disk_spool import Spool, SpoolConfig
from qkwatch.integrations.huggingface import QKWatchCallback, RAATrainer, metric_name, scalars
from qkwatch.raa import ParLoss, par_loss
from qkwatch.trainer.model.config import ModelConfig
from qkwatch.trainer.model.gpt import GPT
from qkwatch.trainer.model.rank_anchored import RAAConfig, attention_par
from tests.integrations.hf_tiny import FAST, MODELS, N_LAYERS, Explode, Tokens, arguments, tiny_gpt2, tiny_llama
from tests.live import ROOT, LiveCollector

STEPS, EVERY, LOGGING, EVAL = 24, 5, 3, 12


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models on a shared machine: one thread each, or the threads fight over the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def watch(collector: LiveCollector, tmp_path: Path, run: str, **settings: Any) -> QKWatchCallback:
    settings = {"every": EVERY, **FAST, **settings}
    return QKWatchCallback(project="tests", run=run, url=collector.url, spool=str(tmp_path / "spool"), **settings)


def subprocess_env(**extra: str) -> dict[str, str]:
    """This tree first on the path, one thread per process, no network, no user-level HF config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QKWATCH_")}
    path = [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


# --- one process ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_trainer_run_is_stored_whole(kind: str, tmp_path: Path, collector: LiveCollector) -> None:
    collector.start()
    qk = watch(collector, tmp_path, f"hf-{kind}", config={"note": "tiny"})
    trainer = Trainer(
        model=MODELS[kind](),
        args=arguments(
            tmp_path / "out", max_steps=STEPS, logging_steps=LOGGING, eval_strategy="steps", eval_steps=EVAL
        ),
        train_dataset=Tokens(64),
        eval_dataset=Tokens(16, seed=1),
        callbacks=[qk],
    )
    trainer.train()
    assert qk.agent is None and qk.run == f"hf-{kind}"
    history = trainer.state.log_history
    with collector.client() as c:
        run = c.run(f"tests/hf-{kind}")
        assert run.status == "finished"
        assert run.config["note"] == "tiny" and run.config["n_layers"] == N_LAYERS
        assert run.config["model"]["model_type"] == kind
        assert run.config["training"]["gradient_accumulation_steps"] == 2 and run.config["training"]["world_size"] == 1
        for layer in range(N_LAYERS):  # one report per optimizer step at the cadence, not per micro-batch
            for metric in ("qkai", "attn_entropy", "stable_rank"):
                assert c.series(run, metric, layer=layer).steps == list(range(0, STEPS, EVERY)), (metric, layer)
        for key in ("loss", "learning_rate", "grad_norm", "epoch", "eval_loss", "eval_runtime", "train_loss"):
            logged = {h["step"]: h[key] for h in history if key in h}  # epoch: in the eval's log too, same value
            stored = c.series(run, key)
            assert stored.steps == list(logged), key
            assert stored.values == pytest.approx(list(logged.values()), rel=1e-6), key
    assert [h["step"] for h in history if "loss" in h] == list(range(LOGGING, STEPS + 1, LOGGING))
    assert [h["step"] for h in history if "eval_loss" in h] == [EVAL, 2 * EVAL]
    assert [h["step"] for h in history if "train_loss" in h] == [STEPS]


def test_tags_and_notes_given_to_the_callback_reach_the_run(tmp_path: Path, collector: LiveCollector) -> None:
    collector.start()
    qk = watch(collector, tmp_path, "hf-tagged", tags=["hf", "llama"], notes="tiny Llama, 4 steps")
    args = arguments(tmp_path / "out", max_steps=4)
    Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(16), callbacks=[qk]).train()
    with collector.client() as c:
        run = c.run("tests/hf-tagged")
        assert (run.tags, run.notes, run.status) == (("hf", "llama"), "tiny Llama, 4 steps", "finished")
        assert [r.name for r in c.search_runs("tests", tags=["hf"])] == ["hf-tagged"]


def test_a_training_that_raises_in_the_with_block_is_crashed_with_the_reason(
    tmp_path: Path, collector: LiveCollector
) -> None:
    collector.start()
    qk = watch(collector, tmp_path, "hf-crash")
    trainer = Trainer(model=tiny_llama(), args=arguments(tmp_path / "out"), train_dataset=Tokens(64), callbacks=[qk])
    trainer.add_callback(Explode(7))
    with pytest.raises(RuntimeError, match="loss exploded"), qk:
        trainer.train()
    assert qk.agent is None
    with collector.client() as c:
        run = c.run("tests/hf-crash")
        assert run.status == "crashed" and run.status_reason == "RuntimeError: loss exploded at step 7"
        assert c.series(run, "qkai", layer=0).steps == [0, 5]  # what was measured before the crash is kept
        assert c.series(run, "loss").steps == [3, 6]


def test_train_begun_again_with_the_same_callback_is_the_next_attempt_of_its_run(
    tmp_path: Path, collector: LiveCollector
) -> None:
    collector.start()
    qk = watch(collector, tmp_path, "hf-again")
    failing = Trainer(model=tiny_llama(), args=arguments(tmp_path / "out"), train_dataset=Tokens(64), callbacks=[qk])
    failing.add_callback(Explode(4))
    with pytest.raises(RuntimeError):
        failing.train()  # no with block: caught here, the run stays open
    assert qk.agent is not None
    again = Trainer(
        model=tiny_llama(), args=arguments(tmp_path / "out", max_steps=6), train_dataset=Tokens(64), callbacks=[qk]
    )
    again.train()  # closes attempt 1 crashed, trains attempt 2 of the same run
    with collector.client() as c:
        run = c.run("tests/hf-again")
        assert run.status == "finished" and run.latest_attempt == 2
        assert c.series(run, "qkai", layer=0, attempt=1).steps == [0]
        assert c.series(run, "qkai", layer=0, attempt=2).steps == [0, 5]


def test_without_the_with_block_the_process_hooks_end_the_run(tmp_path: Path, collector: LiveCollector) -> None:
    """``raise``: the exception ends the process (``sys.excepthook``); ``swallow``: the process exits
    normally mid-run (``atexit``). The two run side by side (most of their time is importing transformers)."""
    collector.start()
    reasons = {
        "raise": "RuntimeError: loss exploded at step 3",
        "swallow": "the process exited before the training ended",
    }
    processes = {
        mode: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integrations.hf_tiny",
                mode,
                collector.url,
                str(tmp_path / mode),
                f"hf-{mode}",
            ],
            cwd=ROOT,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mode in reasons
    }
    outputs = {mode: process.communicate(timeout=300) for mode, process in processes.items()}
    for mode, reason in reasons.items():
        stderr = outputs[mode][1]
        assert processes[mode].returncode == (1 if mode == "raise" else 0), stderr[-3000:]
        with collector.client() as c:
            run = c.run(f"tests/hf-{mode}")
            assert run.status == "crashed" and run.status_reason == reason, mode
            assert c.series(run, "qkai", layer=0).steps == [0, 1, 2], mode
    raised = outputs["raise"][1]  # the previous hook still prints the traceback
    assert "Traceback" in raised and "RuntimeError: loss exploded at step 3" in raised


# --- several processes --------------------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_are_one_run_with_ranks(tmp_path: Path, collector: LiveCollector) -> None:
    """The example under ``torchrun --nproc_per_node 2``: the Trainer's Accelerate runs DDP over gloo on the
    CPU (``accelerate launch --cpu`` starts several CPU processes through MPI only); RAATrainer's lambdas agree."""
    collector.start()
    steps, every = 12, 4
    done = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"),
            "examples/hf_trainer.py",
            *("--steps", str(steps), "--every", str(every), "--project", "tests", "--name", "ddp"),
            *("--out", str(tmp_path / "out")),
        ],
        cwd=ROOT,
        env=subprocess_env(QKWATCH_URL=collector.url, QKWATCH_SPOOL=str(tmp_path / "spool")),
        capture_output=True,
        text=True,
        timeout=600,  # a hang fails here
    )
    assert done.returncode == 0, done.stderr[-4000:]
    with collector.client() as c:
        (run,) = c.runs(project="tests")["data"]  # one run, not one per process
        assert run["name"] == "ddp" and run["status"] == "finished"
        assert run["config"]["training"]["world_size"] == 2
        rows = [json.loads(line) for line in c.export(run["id"], "jsonl") if line.strip()]
    measured = {(r["step"], r["layer"]) for r in rows if r["metric"] == "qkai" and r["head"] == -1}
    # every layer at every report: 0 and 2 from rank 0, 1 and 3 from rank 1 (layer % world == rank)
    assert measured == {(step, layer) for step in range(0, steps, every) for layer in range(4)}
    names = {r["metric"] for r in rows}
    assert {"agent_sent_total_rank0", "agent_sent_total_rank1"} <= names  # both ranks shipped their own spool
    losses = sorted(r["step"] for r in rows if r["metric"] == "loss")
    assert losses == [3, 6, 9, 12]  # logged once (rank 0), at the Trainer's logging steps
    assert sorted(r["step"] for r in rows if r["metric"] == "eval_loss") == [6, 12]
    assert sorted(r["step"] for r in rows if r["metric"] == "par" and r["layer"] == -1) == losses


# --- RAA outside the project's trainer ------------------------------------------------------------


def test_par_loss_equals_the_trainers_par_on_the_projects_gpt() -> None:
    """Both call ``qkwatch.agent.metrics.par_penalty``; this holds that they hand it the same heads:
    the agent's sites (``qkwatch.raa``) and the trainer's effective weights split per head, with
    ``tau_factor`` and ``r`` by default, in value and gradient."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layers=3, n_heads=4, n_kv_heads=2, d_model=32, max_seq_len=16))
    with torch.no_grad():  # pull the key subspaces towards the queries' so that PAR is well above 0
        for attn in model.attentions():
            attn.k_proj.weight.copy_(attn.q_proj.weight[: attn.k_proj.weight.shape[0]] * 0.8 + 0.2 * attn.k_proj.weight)
    lambdas = [0.5, 0.0, 2.0]
    ours = par_loss(model, lambdas)
    theirs = sum(
        lam * attention_par(attn, rank=None, tau_factor=RAAConfig().tau_factor, method="auto")
        for lam, attn in zip(lambdas, model.attentions(), strict=True)
        if lam > 0
    )
    assert ours.item() > 1.0
    torch.testing.assert_close(ours, theirs)
    attn = model.attentions()[0]
    ours_grad = torch.autograd.grad(ours, [attn.q_proj.weight, attn.k_proj.weight])
    theirs_grad = torch.autograd.grad(theirs, [attn.q_proj.weight, attn.k_proj.weight])
    for a, b in zip(ours_grad, theirs_grad, strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b)
    terms = ParLoss(model).terms(lambdas)
    assert terms[1] is None and all(t is not None for t in (terms[0], terms[2]))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("rank", [None, 3])
def test_par_loss_of_identical_query_and_key_projections_is_the_closed_form(kind: str, rank: int | None) -> None:
    """``Wq = Wk``: every head's ``sum_i c_i^2 = r``, so a layer's PAR is ``H (r - 0.45 r)^2``."""
    model = tiny_llama(kv_heads=4) if kind == "llama" else tiny_gpt2()
    with torch.no_grad():
        for i in range(N_LAYERS):
            if kind == "llama":
                attn = model.model.layers[i].self_attn
                attn.k_proj.weight.copy_(attn.q_proj.weight)
            else:
                c_attn = model.transformer.h[i].attn.c_attn.weight  # Conv1D: (d_model, [q | k | v])
                c_attn[:, 32:64] = c_attn[:, :32]
    r = 8 if rank is None else rank
    expected = N_LAYERS * 4 * (0.55 * r) ** 2
    got = par_loss(model, [1.0] * N_LAYERS, rank=rank)
    assert got.item() == pytest.approx(expected, rel=1e-4)
    assert par_loss(model, [0.5, 0.0, 0.0], rank=rank).item() == pytest.approx(0.5 * expected / N_LAYERS, rel=1e-4)


def test_par_loss_reaches_the_projections_and_refuses_bad_lambdas() -> None:
    model = tiny_llama()
    par = ParLoss(model, tau_factor=0.1)  # random subspaces overlap about r^2 / d = 2 > 0.1 r
    loss = par([1.0, 1.0, 1.0])
    loss.backward()
    attn = model.model.layers[0].self_attn
    assert loss.item() > 0 and attn.q_proj.weight.grad.abs().sum() > 0 and attn.k_proj.weight.grad.abs().sum() > 0
    assert attn.v_proj.weight.grad is None  # only W_Q and W_K are in PAR
    zero = par([0.0] * N_LAYERS)
    assert float(zero) == 0 and not zero.requires_grad and float(par(None)) == 0
    with pytest.raises(ValueError, match="2 lambdas for a model of 3"):
        par([1.0, 1.0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        par([1.0, -1.0, float("nan")])
    with pytest.raises(ValueError, match="tau_factor"):
        ParLoss(model, tau_factor=1.5)


class GradientsAtTheStep(TrainerCallback):
    """Every parameter's gradient just before the optimizer step (after the last micro-batch's backward)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_normalises", [True, False], ids=["loss-over-the-step", "trainer-divides"])
def test_raa_trainer_adds_par_once_per_optimizer_step_with_the_collectors_lambdas(
    model_normalises: bool, tmp_path: Path, collector: LiveCollector
) -> None:
    """Two micro-batches per step: the step's gradient is the data's plus exactly one ``grad sum lambda_l PAR_l``.

    The Llama takes ``num_items_in_batch`` (its loss is normalised over the whole step: the Trainer
    does not divide it); with ``model_accepts_loss_kwargs = False`` the Trainer divides each
    micro-batch's loss by 2. The lambdas are the collector's: operator overrides set before the run.
    """
    collector.start()
    lambdas, tau_factor, name = [1.0, 0.0, 2.0], 0.1, f"hf-par-{model_normalises}"
    schedule = {"schedule": {"lambda_0": 1.0}}  # lambda_max = 100 lambda_0: the overrides are not clipped
    with collector.client() as c:
        c.create_run("tests", name, config={"n_layers": N_LAYERS, **schedule})
        c.set_overrides(f"tests/{name}", dict(enumerate(lambdas)))
    initial = tiny_llama()
    args = arguments(tmp_path / "out", max_steps=1, logging_steps=1, max_grad_norm=0.0)  # no clipping

    def one_step(trainer_class: type[Trainer], callbacks: list[TrainerCallback], **kwargs: Any) -> Trainer:
        trainer = trainer_class(
            model=copy.deepcopy(initial), args=args, train_dataset=Tokens(8), callbacks=callbacks, **kwargs
        )
        trainer.model_accepts_loss_kwargs = model_normalises
        trainer.train()  # one step over all 8 sequences, in any order
        return trainer

    plain, raa = GradientsAtTheStep(), GradientsAtTheStep()
    one_step(Trainer, [plain])
    qk = watch(collector, tmp_path, name, every=1, config=schedule)
    trainer = one_step(RAATrainer, [qk, raa], tau_factor=tau_factor)
    reference = copy.deepcopy(initial)
    expected_par = par_loss(reference, lambdas, tau_factor=tau_factor)
    expected_par.backward()
    par_value = expected_par.item()
    assert par_value > 1.0
    for n, p in reference.named_parameters():
        par_grad = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(raa.grads[n] - plain.grads[n], par_grad, rtol=1e-3, atol=1e-5, msg=n)
    (logged,) = [h for h in trainer.state.log_history if "loss" in h]
    assert logged["par"] == pytest.approx(par_value, rel=1e-5)
    with collector.client() as c:
        run = c.run(f"tests/{name}")
        assert c.series(run, "par").values == pytest.approx([par_value], rel=1e-5)
        per_layer = [c.series(run, "par", layer=i).values[0] for i in range(N_LAYERS)]
        applied = [c.series(run, "lambda", layer=i).values[0] for i in range(N_LAYERS)]
    parts = ParLoss(copy.deepcopy(initial), tau_factor=tau_factor).terms(lambdas)
    assert per_layer == pytest.approx([t.item() if t is not None else 0.0 for t in parts], rel=1e-5)
    assert applied == lambdas


def test_the_callback_leaves_the_trainers_losses_and_weights_bit_identical(tmp_path: Path) -> None:
    """An eager Llama (the case that once changed: qkwatch's renamed attention got no causal mask)
    trained 12 optimizer steps of 2 micro-batches with and without the callback measuring every
    step: the same logged losses and the same final weights, bit for bit."""

    def train(callbacks: list[TrainerCallback]) -> tuple[list[float], list[torch.Tensor]]:
        model = tiny_llama()
        model.set_attn_implementation("eager")
        trainer = Trainer(
            model=model,
            args=arguments(tmp_path / "out", max_steps=12, logging_steps=1),
            train_dataset=Tokens(64),
            callbacks=callbacks,
        )
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, [p.detach().clone() for p in model.parameters()]

    plain_losses, plain_weights = train([])
    qk = QKWatchCallback(project="tests", run="invisible", spool=str(tmp_path / "spool"), every=1, **FAST)
    losses, weights = train([qk])
    assert len(losses) == 12 and losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(plain_weights, weights, strict=True))
    spool = Spool(tmp_path / "spool" / "tests" / "invisible" / "rank-0")  # no collector: spooled
    try:
        reports = [r.payload["report"] for r in spool.pending(1000) if "report" in r.payload]
    finally:
        spool.close()
    measured = [r for r in reports if r["layers"].get("attn_entropy")]
    assert len(measured) == 12  # the callback measured every optimizer step


def test_raa_trainer_needs_its_callback(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one QKWatchCallback"):
        RAATrainer(model=tiny_llama(), args=arguments(tmp_path / "out"), train_dataset=Tokens(8))


# --- the example, the optional import, the names ----------------------------------------------


def test_the_example_runs_as_written_offline(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    done = subprocess.run(
        [sys.executable, "examples/hf_trainer.py", "--steps", "8", "--every", "4", "--name", "example"],
        cwd=ROOT,
        env=subprocess_env(QKWATCH_SPOOL=str(spool)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "qkwatch run examples/example: 8 steps" in done.stderr
    s = SpoolConfig().open(spool / "examples" / "example" / "rank-0")
    try:
        records = [r.payload for r in s.pending(100_000)]
    finally:
        s.close()
    reports = [r["report"] for r in records if "report" in r]
    assert sorted(r["step"] for r in reports if r["layers"].get("qkai")) == [0, 4]
    assert {r["step"] for r in reports if "loss" in r["scalars"]} == {2, 4, 6, 8}
    assert records[-1]["status"] == {"status": "finished"}


def test_without_transformers_the_import_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "qkwatch.integrations.huggingface")
    with pytest.raises(ImportError, match=r"pip install 'qkwatch\[huggingface\]'"):
        import qkwatch.integrations.huggingface  # noqa: F401


def test_logged_values_become_metric_names_and_numbers() -> None:
    assert metric_name("eval_loss") == "eval_loss"
    assert metric_name("eval_accuracy (top-1)") == "eval_accuracy__top-1_"
    assert metric_name("1st") == "_1st" and len(metric_name("x" * 300)) == 128
    got = scalars({"loss": 2.5, "step": 3, "flag": True, "text": "a", "t": torch.tensor(1.5), "v": torch.ones(2)})
    assert got.keys() == {"loss", "step", "t"} and got["loss"] == 2.5 and float(got["t"]) == 1.5
