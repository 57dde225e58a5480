"""Named run configs, as functions returning a :class:`qkwatch.trainer.run.config.RunConfig`.

=====================  ==================================================================================
recipe                 what it is for
=====================  ==================================================================================
debug_cpu              the smoke run: 4 layers, 60 steps, a report every 5, full RAA (lambdas read and
                       applied); well under a minute on 2 CPU cores
small_cpu              seed 001's QK-identical initialisation on two middle layers (QKAI starts at 1
                       there, about r/d_model elsewhere, and the gap persists, as seed 001 reports);
                       RAA on, with the entropy-floor lambdas
collapse_cpu           the demo: seed 000's collapse band forming during a few CPU minutes, vanilla
                       by default (``--set raa.enabled=true`` for full RAA). The band is *induced* on
                       layers 3-5 of 8 by the ``qk_collapse`` intervention (trainer.run.interventions)
instability_cpu        collapse_cpu's model with nothing induced, for learning-rate sweeps in the
                       style of Wortsman et al. 2023 (``--set optim.lr=...``): 300 steps, 5 % linear
                       warmup, cosine, AdamW (0.9, 0.95), clip 1.0, a report every 5 steps
instability_small      the instability sweep's model (6 layers of 96, 800 steps, held-out loss every 50
                       steps): long enough to end somewhere, small enough for 144 runs in ~2 hours
heldout_long           issue 40's first held-out recipe: deeper and narrower (8 layers of 64), context
                       512, warmup 10 %, no weight decay; the detectors never see it while tuned
heldout_code           issue 40's second held-out recipe: 4 layers of 128, context 256, the standard
                       library's source code, no warmup, weight decay 0.3
seed001_grid           one cell of seed 001's observational grid: d_model 256, 4 heads of 64, MLP 1024,
                       context 128, 4 layers (``--set model.n_layers=6|8``), AdamW 1e-4 (0.9, 0.95),
                       weight decay 0.1, clip 1.0, constant lr, batch 64, biases, GELU, no dropout,
                       learned positions, 45 epochs; ``--set init.qk_regime=...`` and ``--set seed=37``
seed001_interventions  seed 001's intervention suite: the 8-layer grid model for 15 epochs with
                       ``--set intervention.kind=...`` (seeds 7, 37, 42, 105, 210)
gpt_1_3b               seed 000's main model: 24 layers, 16 heads, d_model 2048, head 128, context 4096,
                       AdamW 3e-4, cosine, 2000 warmup steps, ~2M tokens per step; bf16 FSDP2,
                       activation checkpointing, compile; RAA with scheduling
gpt_6_7b               seed 000's replication scale: 32 layers, 32 heads, d_model 4096, head 128
=====================  ==================================================================================
"""

from __future__ import annotations

from collections.abc import Callable

from qkwatch.trainer.checkpoints.checkpoint import CheckpointConfig
from qkwatch.trainer.model.config import ModelConfig
from qkwatch.trainer.model.init import InitConfig
from qkwatch.trainer.model.rank_anchored import RAAConfig
from qkwatch.trainer.reporting.monitoring import ScheduleConfig
from qkwatch.trainer.run.config import RunConfig, TrainConfig
from qkwatch.trainer.run.data import DataConfig
from qkwatch.trainer.run.interventions import InterventionConfig
from qkwatch.trainer.run.optim import OptimConfig
from qkwatch.trainer.run.parallelize import ParallelConfig


def debug_cpu() -> RunConfig:
    return RunConfig(
        recipe="debug_cpu",
        model=ModelConfig(n_layers=4, n_heads=4, d_model=64, max_seq_len=64),
        raa=RAAConfig(enabled=True, schedule=ScheduleConfig(lambda_0=1e-3, lambda_max=1e-1)),
        init=InitConfig(qk_regime="qk_identical", qk_layers=[1, 2]),
        data=DataConfig(task_mix=0.1),
        optim=OptimConfig(lr=3e-3, warmup_steps=5),
        train=TrainConfig(steps=60, global_batch_size=8, log_every=5, report_every=5, val_batches=4, qkai_every=20),
        parallel=ParallelConfig(device="cpu", cpu_threads=1),
    )


def small_cpu() -> RunConfig:
    return RunConfig(
        recipe="small_cpu",
        model=ModelConfig(n_layers=6, n_heads=4, d_model=128, max_seq_len=128),
        raa=RAAConfig(enabled=True, schedule=ScheduleConfig(lambda_0=1e-3, lambda_max=1e-1)),
        init=InitConfig(qk_regime="qk_identical", qk_layers=[2, 3]),
        data=DataConfig(task_mix=0.2),
        optim=OptimConfig(lr=1e-3, warmup_steps=20),
        train=TrainConfig(steps=1000, global_batch_size=8, log_every=10, report_every=10, val_every=200, qkai_every=50),
        parallel=ParallelConfig(device="cpu", cpu_threads=1),
        checkpoint=CheckpointConfig(every=200),
    )


def collapse_cpu() -> RunConfig:
    """Seed 000's phenotype in about three CPU minutes: a middle band whose QKAI rises past 0.70.

    Eight layers of d_model 128 (4 heads of 32) train normally for 150 steps; then the
    ``qk_collapse`` intervention ramps up over 500 steps on layers 3-5 (45-70 % of the depth, where
    seed 000 finds its band): their query and key subspaces are pulled into alignment and their
    keys contracted toward rank one, so QKAI climbs from ~0.3 at the onset (0.25, the random
    r / d_model, at initialisation) to ~0.9, the stable rank of ``W_Q W_K^T`` falls to ~1 and the
    normalised entropy rises toward 1, while layers 0-2 and 6-7 stay at QKAI ~0.3. Vanilla by
    default; ``--set raa.enabled=true`` gives full RAA, whose schedule flags the band and whose PAR
    holds its QKAI near 0.53, the balance point of the two penalties (below).

    ``lambda_0`` follows ``ScheduleConfig``'s rule, PAR of a layer at the alert threshold ~ 1 nat:
    ``1 / (4 heads x (0.25 x 32)^2)`` ~ 4e-3, rounded up to 5e-3. Against the intervention's
    ``mu = 1e-3`` PAR holds the band where the two penalties' gradients cancel (qkwatch/trainer/run/interventions.py):
    at full strength QKAI = (0.45 lambda + 0.9 mu) / (lambda + mu). ``lambda = 3 mu`` gives 0.5625;
    QKAI <= 0.55 takes ``lambda >= 3.5 mu`` (= 0.7 lambda_0). At the band's entropy of ~1.00 the
    schedule gives it ``sigmoid((1.00 - 0.85) / 0.04)`` = 0.977 lambda_0 = 4.9 mu, hence QKAI
    ~0.5265: the level RAA holds here is set by these weights. The report cadence (every 25 steps:
    32 reports) shows the band forming.
    """
    return RunConfig(
        recipe="collapse_cpu",
        model=ModelConfig(n_layers=8, n_heads=4, d_model=128, max_seq_len=128),
        raa=RAAConfig(enabled=False, schedule=ScheduleConfig(lambda_0=5e-3)),
        intervention=InterventionConfig(
            kind="qk_collapse",
            layers=[3, 4, 5],
            collapse_start=150,
            collapse_ramp=500,
            collapse_target=0.9,
            collapse_align=1e-3,
            collapse_every=5,
            collapse_shrink=0.25,
            collapse_tail=0.5,
        ),
        data=DataConfig(task_mix=0.2),
        optim=OptimConfig(lr=1e-3, warmup_steps=20),
        train=TrainConfig(steps=800, global_batch_size=8, log_every=25, report_every=25, val_every=200),
        parallel=ParallelConfig(device="cpu", cpu_threads=1),
        checkpoint=CheckpointConfig(every=400),
    )


def instability_cpu() -> RunConfig:
    """collapse_cpu's 8 layers of d_model 128 with no intervention: trouble here is the training's own.

    The optimizer follows Wortsman et al. 2023's defaults (AdamW beta 0.9/0.95, eps 1e-8, global
    clip 1.0, linear warmup over 5 % of the steps, cosine decay) at the CPU's scale: 300 steps of
    8 x 128 bytes. Their z-loss is left out (the trainer has none), and weight decay is the
    trainer's usual 0.1. A report every 5 steps gives 60 reports, so an alert can lead an outcome
    by several reports; the loss is logged at every step.
    """
    return RunConfig(
        recipe="instability_cpu",
        model=ModelConfig(n_layers=8, n_heads=4, d_model=128, max_seq_len=128),
        raa=RAAConfig(enabled=False, schedule=ScheduleConfig(lambda_0=5e-3)),
        data=DataConfig(task_mix=0.2),
        optim=OptimConfig(lr=1e-2, warmup_steps=15),
        train=TrainConfig(steps=300, global_batch_size=8, log_every=25, report_every=5, val_every=300),
        parallel=ParallelConfig(device="cpu", cpu_threads=1),
    )


def instability_small() -> RunConfig:
    """The instability sweep's model (issue 31): 6 layers of d_model 96, trained until it ends somewhere.

    Smaller than ``instability_cpu`` so that a sweep bracketing every variant's best rate (9 rates x
    4 variants x 4 seeds) fits about two hours on two cores (about 0.11 s a step, 90 s a run, one
    thread each), and longer, 800 steps, so that a healthy run's held-out loss has flattened by the
    end of the cosine decay (lr 3e-3: 1.525 at step 700, 1.497 at 800). Wortsman et al. 2023's
    optimizer as in ``instability_cpu`` (AdamW 0.9/0.95, clip 1.0, warmup over 5 % of the steps);
    a report every 10 steps (80), the held-out loss every 50 steps (16 evaluations), the loss at
    every step.
    """
    return RunConfig(
        recipe="instability_small",
        model=ModelConfig(n_layers=6, n_heads=4, d_model=96, max_seq_len=128),
        raa=RAAConfig(enabled=False, schedule=ScheduleConfig(lambda_0=5e-3)),
        data=DataConfig(task_mix=0.2),
        optim=OptimConfig(lr=3e-3, warmup_steps=40),
        train=TrainConfig(steps=800, global_batch_size=8, log_every=50, report_every=10, val_every=50),
        parallel=ParallelConfig(device="cpu", cpu_threads=1),
    )


def heldout_long() -> RunConfig:
    """The first recipe the detectors never see while they are tuned (issue 40), aimed at the collapse band.

    It differs from ``instability_small`` (the tune recipe) in more than the seed: deeper and narrower
    (8 layers of d_model 64, 4 heads of 16), context 512 (the passkey tasks span it), 2 sequences a
    step (1,024 tokens, as the tune recipe's 8 x 128), a longer warmup (10 % of the steps against
    5 %) and no weight decay (against 0.1); 600 steps. About 0.17 s a step on one thread (measured
    here, two runs at a time), 2 minutes a run. Written down and committed before any rule was tuned.
    """
    return RunConfig(
        recipe="heldout_long",
        model=ModelConfig(n_layers=8, n_heads=4, d_model=64, max_seq_len=512),
        raa=RAAConfig(enabled=False, schedule=ScheduleConfig(lambda_0=5e-3)),
        data=DataConfig(task_mix=0.2),
        optim=OptimConfig(lr=3e-3, warmup_steps=60, weight_decay=0.0),
        train=TrainConfig(steps=600, global_batch_size=2, log_every=50, report_every=10, val_every=50),
        parallel=ParallelConfig(device="cpu", cpu_threads=1),
    )


def heldout_code() -> RunConfig:
    """The second held-out recipe (issue 40): another corpus, no warmup, stronger weight decay.

    Against ``instability_small``: Python source code (``data.corpus=pysource``, no synthetic tasks)
    instead of English prose, 4 layers of d_model 128 (4 heads of 32), context 256, 4 sequences a
    step (1,024 tokens), **no warmup** (the pressure besides the rate: the full rate from the first
    step) and weight decay 0.3; 600 steps. About 0.13 s a step on one thread (measured here, two
    runs at a time). Written down and committed before any rule was tuned.
    """
    return RunConfig(
        recipe="heldout_code",
        model=ModelConfig(n_layers=4, n_heads=4, d_model=128, max_seq_len=256),
        raa=RAAConfig(enabled=False, schedule=ScheduleConfig(lambda_0=5e-3)),
        data=DataConfig(corpus="pysource", task_mix=0.0),
        optim=OptimConfig(lr=3e-3, warmup_steps=0, weight_decay=0.3),
        train=TrainConfig(steps=600, global_batch_size=4, log_every=50, report_every=10, val_every=50),
        parallel=ParallelConfig(device="cpu", cpu_threads=1),
    )


def _seed001_model(n_layers: int) -> ModelConfig:
    return ModelConfig(
        n_layers=n_layers,
        n_heads=4,
        d_model=256,
        d_head=64,
        d_mlp=1024,
        max_seq_len=128,
        bias=True,
        position="learned",
        tie_embeddings=True,
    )


def _seed001_optim() -> OptimConfig:
    return OptimConfig(lr=1e-4, schedule="constant", beta1=0.9, beta2=0.95, weight_decay=0.1, grad_clip=1.0)


def seed001_grid() -> RunConfig:
    return RunConfig(
        recipe="seed001_grid",
        seed=42,
        model=_seed001_model(4),
        init=InitConfig(qk_regime="independent_xavier"),
        optim=_seed001_optim(),
        train=TrainConfig(
            epochs=45, global_batch_size=64, log_every=50, report_every=50, val_every=500, qkai_every=500
        ),
        checkpoint=CheckpointConfig(every=1000),
    )


def seed001_interventions() -> RunConfig:
    return RunConfig(
        recipe="seed001_interventions",
        seed=42,
        model=_seed001_model(8),
        init=InitConfig(qk_regime="independent_xavier"),
        optim=_seed001_optim(),
        train=TrainConfig(
            epochs=15, global_batch_size=64, log_every=50, report_every=50, val_every=500, qkai_every=500
        ),
        checkpoint=CheckpointConfig(every=1000),
    )


def _seed000(n_layers: int, n_heads: int, d_model: int) -> RunConfig:
    return RunConfig(
        model=ModelConfig(
            n_layers=n_layers, n_heads=n_heads, d_model=d_model, d_head=128, max_seq_len=4096, tie_embeddings=False
        ),
        raa=RAAConfig(enabled=True),
        optim=OptimConfig(lr=3e-4, schedule="cosine", warmup_steps=2000, weight_decay=0.1, grad_clip=1.0),
        # 512 sequences of 4096 tokens: ~2.1M tokens per optimizer step (seed 000's global batch)
        train=TrainConfig(
            steps=30_000, global_batch_size=512, micro_batch_size=4, log_every=10, report_every=50, val_every=1000
        ),
        parallel=ParallelConfig(device="cuda", activation_checkpointing=True, compile=True),
        checkpoint=CheckpointConfig(every=1000, keep=3),
    )


def gpt_1_3b() -> RunConfig:
    cfg = _seed000(24, 16, 2048)
    cfg.recipe = "gpt_1_3b"
    return cfg


def gpt_6_7b() -> RunConfig:
    cfg = _seed000(32, 32, 4096)
    cfg.recipe = "gpt_6_7b"
    return cfg


RECIPES: dict[str, Callable[[], RunConfig]] = {
    f.__name__: f
    for f in (
        debug_cpu,
        small_cpu,
        collapse_cpu,
        instability_cpu,
        instability_small,
        heldout_long,
        heldout_code,
        seed001_grid,
        seed001_interventions,
        gpt_1_3b,
        gpt_6_7b,
    )
}


def get(name: str) -> RunConfig:
    """The config of recipe ``name``; ValueError listing the recipes otherwise."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    return RECIPES[name]()
