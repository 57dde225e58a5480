"""Seed 003 at initialisation (quick mode): the physics the experiment reports must hold, or these fail."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from experiments import seed003
from experiments.reproduction import seed003_section
from qkwatch.agent.metrics.attention import attention_spectrum


@pytest.fixture(scope="module")
def results() -> dict:
    return seed003.run(quick=True)


def _series(results: dict, key: str, variant: str, name: str) -> list[float]:
    w = results["width"]
    return [w["results"][key][variant][str(t)][name]["mean"] for t in w["T"]]


@pytest.mark.parametrize("key", ["ln_full", "prop_full"])
def test_covariance_stable_rank_collapses_with_the_outlier(results, key) -> None:
    sr = _series(results, key, "with", "cov_srank")
    excess = _series(results, key, "with", "cov_srank_excess")
    assert all(b < a for a, b in itertools.pairwise(excess)), excess  # falls at every step of T
    assert sr[-1] < 1.05, sr
    assert excess[-1] < excess[0] / 2


def test_the_t_minus_3_rate_needs_logit_variance_1_over_t(results) -> None:
    fits = results["width"]["fits"]
    assert fits["prop_full"]["slope_cov_srank_excess_with"] < -2.3  # ~ -3 (paper) when s^2 = 1/d = 1/T
    assert -1.5 < fits["ln_full"]["slope_cov_srank_excess_with"] < 0  # at fixed logit variance: much slower


@pytest.mark.parametrize("key", ["ln_full", "prop_full"])
def test_stable_rank_grows_without_the_outlier(results, key) -> None:
    sr = _series(results, key, "removed", "cov_srank")
    assert sr[-1] > 4 * sr[0], sr  # T grows 16x
    assert results["width"]["fits"][key]["slope_attn_srank_removed"] > 0.75  # the matrix's: nearly linear


def test_spectral_gap_near_sigma1_near_one(results) -> None:
    s1 = _series(results, "ln_full", "with", "sigma1")
    gap = _series(results, "ln_full", "with", "gap")
    assert all(v >= 1 - 1e-9 for v in s1)  # a row-stochastic matrix has sigma_1 >= 1
    assert abs(s1[-1] - 1) < 0.02
    assert gap[-1] > 0.7 and gap[-1] > gap[0]
    assert _series(results, "prop_full", "with", "gap")[-1] > 0.95


def test_causal_attention_does_not_collapse(results) -> None:
    sr = _series(results, "ln_causal", "with", "cov_srank")
    assert sr[-1] > 1.2  # the uniform causal matrix is not rank one
    assert _series(results, "ln_causal", "with", "sigma1")[-1] > 1.4


def test_gradient_log_slope_is_larger_with_the_outlier(results) -> None:
    dp = results["depth"]
    runs = dp["runs"]
    gap = dp["predicted_slope_gap"]
    for net in ("markov", "attention"):
        for gain in ("1", "bulk"):
            if net == "attention" and gain == "bulk":
                continue  # both explode there: the logits grow with the tokens (reported, not a claim)
            with_, without = (runs[f"{net}_g{gain}_{v}"]["slope_ln_grad2_per_layer"] for v in ("with", "removed"))
            without = -math.inf if without is None else without
            assert with_ > without + 1, (net, gain, with_, without)
    # the i.i.d. Markov network: the slopes are 0 and -ln(T/E||A-U||^2) at g = 1, shifted by ln g^2 at the bulk gain
    assert abs(runs["markov_g1_with"]["slope_ln_grad2_per_layer"]) < 0.3
    assert abs(runs["markov_g1_removed"]["slope_ln_grad2_per_layer"] + gap) < 0.5
    assert abs(runs["markov_gbulk_with"]["slope_ln_grad2_per_layer"] - gap) < 0.5
    assert abs(runs["markov_gbulk_removed"]["slope_ln_grad2_per_layer"]) < 0.5
    assert dp["closed_form_rel_err_max"] < 1e-8  # autograd = the closed form of the linear network


def test_the_projects_model_matches_uniform_causal_attention_at_init(results) -> None:
    m = results["model"]
    for t in m["T"]:
        assert m["vanilla"][str(t)]["attn_srank"] == pytest.approx(m["causal_uniform"][str(t)]["attn_srank"], rel=0.02)
        assert m["vanilla"][str(t)]["attn_gap1"] == pytest.approx(m["causal_uniform"][str(t)]["attn_gap1"], rel=0.03)
        assert m["outlier_removed"][str(t)]["attn_srank"] > m["vanilla"][str(t)]["attn_srank"]
        assert m["outlier_removed"][str(t)]["attn_gap1"] < 0.1


def test_the_metric_agrees_with_numpy_inside_the_run(results) -> None:
    assert results["width"]["numpy_check_max"] < 1e-10
    assert results["width"]["spectrum_vs_torch_svd_max"] < 1e-8


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("remove", [False, True])
def test_attention_spectrum_against_an_independent_numpy_svd(causal: bool, remove: bool) -> None:
    rng = np.random.default_rng(5)
    t, dh = 48, 16
    q, k = rng.standard_normal((t, dh)), rng.standard_normal((t, dh))
    logits = q @ k.T / np.sqrt(dh)
    allowed = np.tril(np.ones((t, t), bool)) if causal else np.ones((t, t), bool)
    e = np.where(allowed, np.exp(logits - logits.max(1, keepdims=True)), 0.0)
    a = e / e.sum(1, keepdims=True)
    if remove:
        a = a - allowed / allowed.sum(1, keepdims=True)
    s = np.linalg.svd(a, compute_uv=False)
    got = attention_spectrum(torch.from_numpy(q), torch.from_numpy(k), causal=causal, remove_outlier=remove)
    assert float(got["attn_srank"]) == pytest.approx((s**2).sum() / s[0] ** 2, rel=1e-9)
    assert float(got["attn_gap1"]) == pytest.approx(s[0] - s[1], abs=1e-9)


def test_results_are_json_and_section_embeds_every_figure(results) -> None:
    json.dumps(results, allow_nan=False)
    text, figs = seed003_section.section(results)
    assert text.startswith("## ")
    assert len(figs) == 4
    for name, fig in figs:
        assert f"(reproduction/{name}.png)" in text
        assert fig.to_dict()["data"]
    assert results["torch"] == torch.__version__ and results["seed"] == seed003.SEED and results["wall_s"] > 0
    assert len(seed003.headlines(results)) >= 5
