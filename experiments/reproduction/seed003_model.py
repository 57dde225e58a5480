"""Seed 003's third part: the project's GPT at initialisation, its attention's stable rank and gap against T.

``trainer``'s model in the ``model_recipe`` shape, ``vanilla`` and ``outlier_removed``, on random byte
tokens: the agent's ``attn_srank`` and ``attn_gap1`` from the queries and keys the model uses, beside
exactly uniform causal attention. The width and depth sweeps are :mod:`experiments.reproduction.seed003_math`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from experiments.reproduction.seed003_math import SEED, fit_loglog, uniform_attention
from qkwatch.agent.metrics.attention import attention_spectrum


def model_at_init(cfg: dict) -> dict:
    from qkwatch.trainer.model.init import InitConfig, build_model
    from qkwatch.trainer.run import recipes

    recipe = recipes.get(cfg["model_recipe"])
    ts = cfg["model_T"]
    out: dict[str, Any] = {"recipe": cfg["model_recipe"], "T": ts, "init": "default (GPT-2 normal, std 0.02)"}
    for variant in ("vanilla", "outlier_removed"):
        mc = dataclasses.replace(
            recipe.model_config(), variant=variant, max_seq_len=max(ts), attention="auto", key_rotation=0
        )
        model = build_model(mc, InitConfig(), seed=0, device=torch.device("cpu")).eval()
        captured: list[tuple[torch.Tensor, torch.Tensor]] = []
        hooks = [
            a.qk_tap.register_forward_hook(lambda _m, _i, o, sink=captured: sink.append(o)) for a in model.attentions()
        ]
        per_t = {}
        for t in ts:
            captured.clear()
            idx = torch.randint(0, mc.vocab_size, (1, t), generator=torch.Generator().manual_seed(SEED + t))
            with torch.no_grad():
                model(idx)
            layers = []
            for q, k in captured:
                spec = attention_spectrum(q[0], k[0], causal=True, remove_outlier=variant == "outlier_removed")
                logits = q[0] @ k[0].mT / math.sqrt(q.shape[-1])
                layers.append(
                    {
                        "attn_srank": float(spec["attn_srank"].mean()),
                        "attn_gap1": float(spec["attn_gap1"].mean()),
                        "logit_std": float(logits.std()),
                    }
                )
            per_t[str(t)] = {
                "attn_srank": float(np.mean([r["attn_srank"] for r in layers])),
                "attn_gap1": float(np.mean([r["attn_gap1"] for r in layers])),
                "logit_std": float(np.mean([r["logit_std"] for r in layers])),
                "per_layer": layers,
            }
        for h in hooks:
            h.remove()
        out[variant] = per_t
        out["shape"] = {"d_model": mc.d_model, "n_heads": mc.n_heads, "d_head": mc.d_head, "n_layers": mc.n_layers}
    ref = {}
    for t in ts:  # what exactly uniform causal attention gives: A = U_c
        uc = uniform_attention(t, True)
        s = torch.linalg.svdvals(uc)
        ref[str(t)] = {
            "attn_srank": float(s.square().sum() / s[0] ** 2),
            "attn_gap1": float(s[0] - s[1]),
            "sigma1": float(s[0]),
        }
    out["causal_uniform"] = ref
    out["slope_removed_attn_srank"] = fit_loglog(ts, [out["outlier_removed"][str(t)]["attn_srank"] for t in ts])
    return out
