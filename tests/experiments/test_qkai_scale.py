"""QKAI's scale (quick mode): random weights read r / d_model; identical reads 1, disjoint 0."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from experiments import qkai_scale
from experiments.reproduction import qkai_scale_section
from qkwatch.agent.metrics.subspace import qkai


@pytest.fixture(scope="module")
def results() -> dict:
    return qkai_scale.run(quick=True)


def test_random_law_holds_for_every_shape_within_the_sampling_error(results) -> None:
    rows = results["random_law"]["rows"]
    assert {r["d_model"] for r in rows} == set(qkai_scale.QUICK["d_models"])
    for r in rows:
        tol = max(0.03, 4 * r["rel_se"])  # a few percent, wider only where the draws allow no better (r = 1)
        assert abs(r["rel_err"]) < tol, r
        assert abs(r["z"]) < 4.5, r
        assert r["sd"] == pytest.approx(r["sd_formula"], rel=0.25), r  # the spread is the random law's too
    full = [r for r in rows if r["r"] == r["d_head"]]
    assert full and all(abs(r["rel_err"]) < 0.01 for r in full)


def test_qkai_against_independent_numpy_principal_angles() -> None:
    gen = torch.Generator().manual_seed(11)
    wq, wk = torch.randn(3, 96, 24, generator=gen), torch.randn(3, 96, 24, generator=gen)
    for r in (1, 6, 24):
        ours = qkai(wq, wk, r, method="exact").double().numpy()
        for i in range(3):
            uq = np.linalg.svd(wq[i].double().numpy(), full_matrices=False)[0][:, :r]
            uk = np.linalg.svd(wk[i].double().numpy(), full_matrices=False)[0][:, :r]
            cos = np.linalg.svd(uq.T @ uk, compute_uv=False)
            assert ours[i] == pytest.approx(np.mean(cos**2), abs=1e-5)


def test_the_run_checks_itself_against_numpy(results) -> None:
    assert results["numpy_check"]["max_abs_diff"] < 1e-5


def test_init_regimes_at_every_recipe_shape(results) -> None:
    rec = results["recipes"]
    for name in qkai_scale.RECIPES:
        r = rec[name]
        g = r["regimes"]
        assert g["qk_identical"]["min"] == pytest.approx(1.0, abs=1e-5), name
        assert g["qk_identical"]["max"] == pytest.approx(1.0, abs=1e-5), name
        assert g["disjoint_support_xavier"]["max"] < 1e-6, name
        base = r["d_head"] / r["d_model"]
        spread = 5 * qkai_scale.random_sd(r["d_model"], r["d_head"]) / math.sqrt(r["n_heads"])
        for regime in ("default", "independent_xavier"):
            assert abs(g[regime]["mean"] - base) < spread, (name, regime, g[regime]["mean"], base)
        assert r["random_baseline"] == base
    assert rec["gpt_1_3b"]["random_baseline"] == 0.0625
    assert rec["seed001_grid"]["random_baseline"] == 0.25
    assert all(rec["replication_exact"].values())  # the per-layer init is the trainer's own


def test_recipe_layers_at_init(results) -> None:
    rec = results["recipes"]
    # collapse_cpu: every layer random; debug_cpu: layer 0 random (its qk_identical layers are 1 and 2)
    assert abs(rec["collapse_cpu"]["per_layer"][0]["mean"] - 0.25) < 0.05
    assert abs(rec["debug_cpu"]["per_layer"][0]["mean"] - 0.25) < 0.06


def test_seed000_numbers(results) -> None:
    s0 = results["seed000"]
    assert s0["random_baseline"] == 0.0625
    assert s0["seed000_init_multiple"] == pytest.approx(4.96)
    assert s0["seed000_init_equivalent_random_r"] == pytest.approx(634.88)
    assert s0["seed000_init_equivalent_random_r"] > qkai_scale.SEED000_SHAPE["d_head"]  # impossible for one head
    assert s0["threshold_multiple_of_baseline"] == pytest.approx(11.2)
    corr = [r["qkai"] for r in results["correlated"]["rows"]]
    assert corr == sorted(corr) and corr[-1] == pytest.approx(1.0, abs=1e-5)
    assert 0.3 < results["correlated"]["rho_for_0.31"] < 0.8


def test_layer_level(results) -> None:
    for r in results["layer_level"]:
        if r["r"] == r["d_model"]:
            assert r["mean"] == pytest.approx(1.0, abs=1e-5)
        else:
            assert abs(r["rel_err"]) < 0.1, r


def test_results_are_json_and_section_embeds_every_figure(results) -> None:
    json.dumps(results, allow_nan=False)
    text, figs = qkai_scale_section.section(results)
    assert text.startswith("## ")
    assert len(figs) == 3
    for name, fig in figs:
        assert f"(reproduction/{name}.png)" in text
        assert fig.to_dict()["data"]
    assert "0.70" in text and "0.31" in text
    assert results["torch"] == torch.__version__ and results["seed"] == qkai_scale.SEED
    assert len(qkai_scale.headlines(results)) >= 5
