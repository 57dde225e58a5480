"""The experiments' analysis on synthetic histories whose answers are known in closed form."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments import seed000
from experiments.reproduction import seed000_analysis, seed000_section, seed001_analysis, seed001_section

STEPS = [0, 25, 50, 75, 100, 125, 150, 175, 200]
"""Reports; the slopes are fitted from seed001_analysis.FIT_FROM (100) on."""


def _grid(values_fn, depth: int) -> dict:
    return {"steps": STEPS, "values": [[values_fn(s, layer) for layer in range(depth)] for s in STEPS]}


def _record(
    kind: str,
    depth: int,
    seed: int,
    *,
    regime: str = "independent_xavier",
    intervention: str = "none",
    pr_k_slope: float = -1.0,
    entropy: float = 2.0,
    align: float = 0.2,
) -> dict:
    r = {
        "kind": kind,
        "depth": depth,
        "seed": seed,
        "regime": regime,
        "intervention": intervention,
        "val_loss": 1.5 + 0.01 * seed,
        "loss": 1.4,
    }
    r["pr_q"] = _grid(lambda s, layer: 10 + 2.0 * s / 100 + layer, depth)  # slope +2 per 100 steps
    r["pr_k"] = _grid(lambda s, layer: 20 + pr_k_slope * (layer + 1) * s / 100, depth)
    r["qk_erank"] = _grid(lambda s, layer: 8 * math.exp(pr_k_slope * (layer + 1) * s / 1000), depth)
    r["attn_entropy_nats"] = _grid(lambda s, layer: entropy + pr_k_slope * (layer + 1) * s / 500, depth)
    r["attn_top1"] = _grid(lambda s, layer: 0.3 - pr_k_slope * (layer + 1) * s / 1000, depth)
    r["logit_std"] = _grid(lambda s, layer: 1.0, depth)
    r["qk_cos"] = _grid(lambda s, layer: align, depth)
    return r


def _results() -> dict:
    runs = []
    for seed in (1, 2):
        for depth in seed001_analysis.DEPTHS:
            for regime in seed001_analysis.REGIMES:
                align = 0.6 + 0.05 * seed if regime == "qk_identical" else 0.2 + 0.01 * seed
                runs.append(
                    _record(
                        "grid",
                        depth,
                        seed,
                        regime=regime,
                        align=align,
                        pr_k_slope=-0.5 if regime == "qk_identical" else -1.0,
                    )
                )
        for kind, entropy in (
            ("none", 2.0),
            ("forced_k_contraction", 1.5),
            ("freeze_k", 2.5 if seed == 1 else 1.9),
            ("k_spectrum_clamp", 2.2),
            ("freeze_q", 2.1),
            ("qk_align_reg", 2.0 - 0.01 * seed),
        ):
            runs.append(_record("intervention", 8, seed, intervention=kind, entropy=entropy))
    return {"steps": 100, "seeds": [1, 2], "lr": 1e-3, "batch": 8, "report_every": 25, "runs": runs}


def test_slopes_are_per_100_steps_and_exact_for_lines() -> None:
    rows = seed001_analysis.layer_slopes(_record("grid", 4, 1))
    assert [r["pr_q"] for r in rows] == pytest.approx([2.0] * 4)
    assert [r["pr_k"] for r in rows] == pytest.approx([-1.0, -2.0, -3.0, -4.0])
    assert [r["pr_diff"] for r in rows] == pytest.approx([3.0, 4.0, 5.0, 6.0])
    assert [r["qk_erank"] for r in rows] == pytest.approx([-0.1, -0.2, -0.3, -0.4])  # slope of log erank


def test_slopes_ignore_the_transient_before_fit_from() -> None:
    record = _record("grid", 2, 1)
    pq = record["pr_q"]["values"]
    for i, step in enumerate(STEPS):
        if step < seed001_analysis.FIT_FROM:
            pq[i] = [100.0, 100.0]  # a collapse from the initialisation: not part of the trend
    assert [r["pr_q"] for r in seed001_analysis.layer_slopes(record)] == pytest.approx([2.0, 2.0])


def test_table4_counts_cells_and_correlates_specialisation_with_compression() -> None:
    t4 = seed001_analysis.table4(_results())
    assert t4["all"]["pr_k"]["n"] == 3 * (4 + 6 + 8) == 54
    assert t4["all"]["pr_k"]["positive"] == 0 and t4["all"]["pr_diff"]["positive"] == 54
    assert t4["coupled"]["pr_k"]["mean"] == pytest.approx(-0.5 * np.mean([i + 1 for d in (4, 6, 8) for i in range(d)]))
    corr = t4["correlations"]
    assert corr["specialisation~compression"]["n"] == 36
    assert corr["specialisation~compression"]["r"] == pytest.approx(1.0)  # both are linear in the layer here
    assert corr["compression~entropy_sharpening"]["r"] == pytest.approx(1.0)


def test_table3_welch_and_hedges_g() -> None:
    t3 = seed001_analysis.table3(_results())
    # seed means: (0.65 + 0.70) / 2 against (0.21 + 0.22) / 2
    assert t3["gap_by_depth"][4] == pytest.approx(0.675 - 0.215)
    assert t3["welch_p"] < 1e-6 and t3["hedges_g"] > 5
    assert seed001_analysis._hedges_g([1, 2, 3], [4, 5, 6]) == pytest.approx(-3 * (1 - 3 / 15))


def test_table5_confidence_is_the_fraction_of_seeds_in_the_predicted_direction() -> None:
    t5 = seed001_analysis.table5(_results())
    assert t5["forced_k_contraction"]["confidence"] == 1.0 and t5["forced_k_contraction"]["direction"] == -1
    assert t5["freeze_k"]["entropy_delta"] == pytest.approx([0.5, -0.1])
    assert t5["freeze_k"]["confidence"] == 0.5
    assert t5["qk_align_reg"]["predicted"] is False and t5["qk_align_reg"]["direction"] == -1


def test_seed001_section_renders_every_table_and_figure() -> None:
    text, figs = seed001_section.section(_results())
    assert {name for name, _ in figs} == {"seed001-pr", "seed001-alignment"}
    for name, _ in figs:
        assert f"reproduction/{name}.png" in text
    assert "Hedges' g" in text and "54" in text and "nan" not in text.lower()
    assert "| claim (seed 001) |" in text and text.count(" | yes") + text.count(" | no") >= 12


def _seed000_results() -> dict:
    runs = []
    for i, variant in enumerate(seed000_analysis.VARIANTS):
        final = 0.9 if variant == "vanilla" else 0.5
        steps = [0, 150, 400, 800]
        band = [0.3, 0.3, 0.6, final]
        rec = {
            "variant": variant,
            "seed": 0,
            "name": variant,
            "status": "finished",
            "qkai": {"steps": steps, "band": band, "outside": [0.3] * 4, "final_by_layer": [0.3] * 8},
            "stable_rank": {"steps": steps, "band": [2.0, 2.0, 1.5, 1.2 + i], "outside": [2.0] * 4},
            "attn_entropy": {"steps": steps, "band": [0.8, 0.8, 0.9, 0.95 - 0.01 * i], "outside": [0.8] * 4},
            "val_loss": {"steps": [800], "values": [1.6]},
            "evals": {
                "passkey1_acc_128": 0.1 * i,
                "passkey1_acc_256": 0.0,
                "passkey5_acc_256": 0.0,
                "passkey1_digits_128": 0.5,
                "passkey1_digits_256": 0.2,
                "passkey5_digits_256": 0.1,
                "ppl_128": 5.0,
                "ppl_256": 9.0,
            },
        }
        if variant == "raa":
            rec["raa_flagged_fraction"] = {"steps": [0, 800], "values": [0.25, 0.375]}
        runs.append(rec)
    return {
        "seeds": [0],
        "band": seed000.BAND,
        "onset": 150,
        "variants": seed000_analysis.VARIANTS,
        "eval_samples": 40,
        "runs": runs,
    }


def test_seed000_summary_reads_onset_final_peak_and_flagged() -> None:
    rows = seed000_analysis.summary(_seed000_results())
    assert rows["vanilla"]["qkai_onset"] == 0.3 and rows["vanilla"]["qkai_final"] == 0.9
    assert rows["raa"]["qkai_peak"] == 0.6 and rows["raa"]["flagged"] == pytest.approx(0.3125)
    assert math.isnan(rows["vanilla"]["flagged"])
    text, figs = seed000_section.section(_seed000_results())
    assert "reproduction/seed000-band.png" in text and len(figs) == 2
    assert "0.00 / 0.20" in text  # passkey exact / digits
