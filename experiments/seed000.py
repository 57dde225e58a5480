"""Seed 000 on ``collapse_cpu``: the induced band under vanilla training, RAA's ablations and two peers.

``python -m experiments.seed000 [--seeds 0,1] [--workers 2]`` trains seven variants of the
``collapse_cpu`` recipe (whose middle band, layers 3-5 of 8, is *induced* to collapse by the
``qk_collapse`` intervention from step 150; see qkwatch/trainer/run/interventions.py), all streaming into one
collector, evaluates each (passkey with 1 and 5 needles and perplexity, at the training length 128
and at 256, twice it), and writes ``experiments/results/seed000.json`` from the collector's data.

Variants (seed 000's ablation, plus the two peers its Table of baselines names):

=============  ==============================================================================
vanilla        no RAA
par            PAR alone, lambda_0 on every layer (no rotation, no schedule)
rotation       Householder key rotation alone (no PAR, hence no schedule)
par_rotation   PAR + rotation, lambda_0 on every layer ("before scheduling was added")
raa            full RAA: PAR + rotation + the entropy-floor schedule
qk_norm        RMSNorm on queries and keys (Henry et al. 2020)
sigma_reparam  every block's linear layer W / sigma(W) * gamma (Zhai et al. 2023)
=============  ==============================================================================

The model's RoPE table covers 256 tokens (``model.max_seq_len=256``) while every run trains on
128-token sequences (``train.seq_len=128``), so 256 is a context longer than training. The
five-needle passkey needs 208 tokens, so it is measured at 256 only, and is a format the models
never saw whole in training (training sequences hold one needle when they are shorter than 208).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.common import Campaign, RunSpec, fmt, last, log, read_run, save
from experiments.reproduction.seed000_analysis import VARIANTS, summary

NAME = "seed000"
BAND = [3, 4, 5]
ONSET = 150
COMMON = ["model.max_seq_len=256", "train.seq_len=128"]
EVALS = [("passkey", "128,256"), ("perplexity", "128,256")]
REPORT = Path(__file__).resolve().parent.parent / "docs" / "reproduction" / "seed000-report.html"
"""``qkwatch report`` of vanilla against full RAA (the first seed)."""
LAYER_METRICS = ("qkai", "stable_rank", "attn_entropy", "attn_entropy_nats", "qk_erank")


def specs(seeds: list[int]) -> list[RunSpec]:
    return [
        RunSpec(
            f"{variant}-s{seed}",
            "collapse_cpu",
            [*COMMON, f"seed={seed}", *sets],
            EVALS,
            {"variant": variant, "seed": seed},
        )
        for seed in seeds
        for variant, sets in VARIANTS.items()
    ]


def collect(campaign: Campaign, run_ids: dict[str, str], all_specs: list[RunSpec]) -> list[dict[str, Any]]:
    """Everything the report needs about each run, read back from the collector."""
    client = campaign.client
    out = []
    for spec in all_specs:
        run = run_ids[spec.name]
        g, s = read_run(client, run, LAYER_METRICS)
        record: dict[str, Any] = {**spec.tags, "name": spec.name, "run_id": run, "status": client.run(run)["status"]}
        for metric, (steps, values) in g.items():
            band = np.nanmean(values[:, BAND], axis=1)
            outside = np.nanmean(values[:, [i for i in range(values.shape[1]) if i not in BAND]], axis=1)
            record[metric] = {
                "steps": steps.tolist(),
                "band": band.tolist(),
                "outside": outside.tolist(),
                "final_by_layer": values[-1].tolist(),
            }
        for name in ("loss", "val_loss", "par", "raa_flagged_fraction"):
            if name in s:
                record[name] = {"steps": s[name][0], "values": s[name][1]}
        record["evals"] = {k: last(v) for k, v in s.items() if k.startswith(("passkey", "ppl_"))}
        record["alerts"] = sorted({a["rule"] for a in client.alerts(run=run)["data"]})
        out.append(record)
    return out


def run(seeds: list[int] | None = None, workers: int = 2, samples: int = 40) -> dict:
    seeds = seeds or [0]
    all_specs = specs(seeds)
    started = time.time()
    with Campaign(NAME, workers=workers, samples=samples) as campaign:
        ids = campaign.run(all_specs)
        runs = collect(campaign, ids, all_specs)
        write_report(campaign, seeds[0])
    return {
        "experiment": NAME,
        "seeds": seeds,
        "band": BAND,
        "onset": ONSET,
        "variants": VARIANTS,
        "common_sets": COMMON,
        "evals": EVALS,
        "eval_samples": samples,
        "runs": runs,
        "wall_s_last_invocation": time.time() - started,
    }


def write_report(campaign: Campaign, seed: int) -> Path:
    """``qkwatch report`` of the vanilla and the full-RAA run, side by side, beside docs/reproduction.md."""
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "qkwatch.cli",
        "report",
        f"{NAME}/vanilla-s{seed}",
        "--vs",
        f"{NAME}/raa-s{seed}",
        "--url",
        campaign.collector.url,
        "--out",
        str(REPORT),
    ]
    subprocess.run(cmd, check=True)
    log(f"wrote {REPORT}")
    return REPORT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.seed000", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    p.add_argument("--workers", type=int, default=2, help="runs at a time, one CPU thread each")
    p.add_argument("--samples", type=int, default=40, help="passkey queries per length and needle count")
    args = p.parse_args(argv)
    results = run([int(s) for s in args.seeds.split(",")], args.workers, args.samples)
    path = save(NAME, results)
    for variant, r in summary(results).items():
        log(
            f"{variant:14s} band QKAI {fmt(r['qkai_onset'], '.2f')} -> {fmt(r['qkai_final'], '.2f')}  "
            f"srank {fmt(r['srank_final'], '.2f')}  entropy {fmt(r['entropy_final'], '.2f')}  "
            f"passkey1@256 {fmt(r['passkey1_acc_256'], '.2f')}/{fmt(r['passkey1_digits_256'], '.2f')}  ppl@128 {fmt(r['ppl_128'], '.2f')}  "
            f"flagged {fmt(r['flagged'], '.2f')}"
        )
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
