"""Run under ``torchrun --nproc_per_node 2``: FSDP2 on gloo against the single-process reference.

Writes a JSON report to ``argv[1]`` (rank 0); ``test_trainer_distributed.py`` asserts on it. Checks:

* the sharded initial weights are the single-process ones;
* seed 001's interventions on shards equal the same surgery on the unsharded model;
* the gradients of CE + PAR reaching the shards equal the single-process gradients of the same
  global batch (averaged over ranks, not summed: pytorch#162338), and PAR's alone too;
* a run stopped after 3 steps and resumed from its sharded DCP checkpoint has the loss curve of an
  uninterrupted one;
* ``debug_cpu`` runs to the end through ``python -m qkwatch.trainer``'s ``main``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qkwatch.trainer.cli import main as train_main
from qkwatch.trainer.model.init import InitConfig, assign, build_model, full_tensor
from qkwatch.trainer.model.rank_anchored import RAAController
from qkwatch.trainer.run import recipes
from qkwatch.trainer.run.config import TrainConfig
from qkwatch.trainer.run.interventions import InterventionConfig, Interventions
from qkwatch.trainer.run.parallelize import Env, init_distributed, parallelize
from qkwatch.trainer.run.train import run


def small_config():
    cfg = recipes.debug_cpu()
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, n_layers=4, d_model=32, max_seq_len=32, n_kv_heads=2),
        data=dataclasses.replace(cfg.data, task_mix=0.0),
        train=TrainConfig(steps=6, global_batch_size=4, log_every=1, report_every=1, val_batches=2),
    )


def build(cfg, env: Env):
    """The run's model as ``trainer.run.setup.setup`` builds it on ``env``."""
    return build_model(
        cfg.model_config(), cfg.init, cfg.seed, env.device, parallelize=lambda m: parallelize(m, cfg.parallel, env)
    )


def grads(model, loss_fn, env) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    return {n: full_tensor(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(sharded: dict, single: dict) -> dict:
    worst = {}
    for name, ref in single.items():
        got = sharded[name]
        scale = ref.abs().max().item()
        worst[name] = {
            "max_abs_err": (got - ref).abs().max().item(),
            "ref_max": scale,
            "ratio": (got.norm() / ref.norm()).item() if scale > 0 else 1.0,
        }
    return worst


def gradient_checks(env: Env) -> dict:
    # aligned but not identical query/key subspaces everywhere, so that PAR has a gradient
    cfg = dataclasses.replace(small_config(), init=InitConfig(qk_regime="qk_identical"))
    sharded = build(cfg, env)
    single_env = Env(0, 1, torch.device("cpu"), None, torch.float32, torch.float32)
    single = build(cfg, single_env)
    gen = torch.Generator().manual_seed(11)
    for sharded_block, single_block in zip(sharded.blocks, single.blocks, strict=True):
        wk = single_block.attn.k_proj.weight
        noisy = wk.detach() + 0.5 * wk.detach().std() * torch.randn(wk.shape, generator=gen)
        assign(wk, noisy)
        assign(sharded_block.attn.k_proj.weight, noisy)
    init_equal = all(
        [
            torch.equal(full_tensor(p.detach()), single.get_parameter(n).detach())  # every rank gathers all
            for n, p in sharded.named_parameters()
        ]
    )

    lambdas = [0.05] * 4
    controllers = [RAAController(cfg.raa, [b.attn for b in m.blocks]) for m in (sharded, single)]
    for c in controllers:
        c.apply(lambdas, step=0)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(7))
    mine = tokens[2 * env.rank : 2 * env.rank + 2]

    def loss(model, controller, rows, with_ce=True):
        def fn():
            out = model(rows[:, :-1])
            par, _ = controller.loss(out.penalties, lambdas)
            ce = F.cross_entropy(out.logits.flatten(0, 1), rows[:, 1:].flatten())
            return (ce + par) if with_ce else par

        return fn

    both = compare(
        grads(sharded, loss(sharded, controllers[0], mine), env),
        grads(single, loss(single, controllers[1], tokens), single_env),
    )
    par_only = compare(
        grads(sharded, loss(sharded, controllers[0], mine, False), env),
        grads(single, loss(single, controllers[1], tokens, False), single_env),
    )
    return {"init_equal": init_equal, "ce_plus_par": both, "par_only": par_only}


def intervention_checks(env: Env) -> dict:
    """Table 2's weight surgery on FSDP2 shards equals the same surgery on the unsharded model."""
    cfg = small_config()
    single_env = Env(0, 1, torch.device("cpu"), None, torch.float32, torch.float32)
    out = {}
    for kind, fields in (
        ("forced_k_contraction", {"every": 1, "tail_rank": 4}),
        ("freeze_q", {}),
        ("k_spectrum_clamp", {"every": 1}),
    ):
        models = [build(cfg, e) for e in (env, single_env)]
        ivs = [Interventions(InterventionConfig(kind=kind, **fields), m, 10, cfg.seed) for m in models]
        gen = torch.Generator().manual_seed(5)
        for block_s, block_1 in zip(models[0].blocks, models[1].blocks, strict=True):
            for name in ("q_proj", "k_proj"):
                w = getattr(block_1.attn, name).weight
                moved = w.detach() + 0.02 * torch.randn(w.shape, generator=gen)
                assign(w, moved)
                assign(getattr(block_s.attn, name).weight, moved)
        for iv in ivs:
            iv.after_step(1)
        errors = [
            (full_tensor(getattr(bs.attn, n).weight.detach()) - getattr(b1.attn, n).weight.detach()).abs().max()
            for bs, b1 in zip(models[0].blocks, models[1].blocks, strict=True)
            for n in ("q_proj", "k_proj")
        ]
        out[kind] = max(e.item() for e in errors)
    return out


def resume_check(env: Env, root: Path) -> dict:
    cfg = small_config()
    straight = run(cfg, root / "straight")
    run(cfg, root / "resumed", stop_after=3)
    resumed = run(cfg, root / "resumed", resume=True)

    def losses(path):
        lines = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
        return [(x["step"], x["loss"]) for x in lines if "loss" in x]

    if env.rank != 0:
        return {}
    return {
        "straight": losses(root / "straight"),
        "resumed": losses(root / "resumed"),
        "steps": [straight.steps, resumed.steps],
    }


def debug_cpu_check(root: Path) -> dict:
    code = train_main(["--recipe", "debug_cpu", "--out", str(root / "debug_cpu")])
    lines = [json.loads(x) for x in (root / "debug_cpu" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    layers_seen = {len(x["lambda"]) for x in lines if "lambda" in x}
    return {
        "exit": code,
        "last_step": max(x["step"] for x in lines if "loss" in x),  # qkai after the last update is at 60
        "losses": losses,
        "layers": sorted(layers_seen),
        "exported": (root / "debug_cpu" / "model.pt").is_file(),
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    env = init_distributed(recipes.debug_cpu().parallel)
    assert env.world_size == 2 and dist.get_backend() == "gloo"
    report = {"gradients": gradient_checks(env), "interventions": intervention_checks(env)}
    with tempfile.TemporaryDirectory() as tmp:
        box = [tmp]
        dist.broadcast_object_list(box, src=0)  # one folder for both ranks
        root = Path(box[0])
        report["resume"] = resume_check(env, root)
        report["debug_cpu"] = debug_cpu_check(root)
        dist.barrier()
    if env.rank == 0:
        Path(sys.argv[1]).write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
