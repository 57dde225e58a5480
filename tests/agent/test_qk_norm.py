"""q/k-norm gains are part of the weights qkwatch measures (issue 41, item 6; docs/metrics.md).

Qwen3 and Gemma 3 apply an RMS norm to each head's query and key (Gemma's gain is ``1 + weight``),
OLMo 2 one over all heads' features. The bilinear form the model attends with is then
``x^T Wq_h^T diag(g_q) diag(g_k) Wk_h x'``: the norm's own scaling is one positive number per token
and head, which turns no direction. Two references:

* the model's own normalised queries and keys (a forward hook on ``q_norm``/``k_norm``) point, for
  every token and head, exactly along ``x Wq_h diag(g_q)`` and ``x Wk_h diag(g_k)`` built from the
  factors qkwatch measures (cosine 1);
* the stable rank and ``qk_cos`` the agent reports equal those of factors scaled by hand from the
  gains read off the parameters (``weight`` for Qwen3 and OLMo 2, ``1 + weight`` for Gemma 3), and
  differ from the unscaled projections' (what qkwatch reported before: 6.10 against 2.98 in the issue).

The gains are randomised (log-normal, wide) so that leaving them out shows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from qkwatch import agent
from qkwatch.agent.metrics.summary import weight_metrics
from qkwatch.agent.models.adapters import find_sites
from tests.agent.test_model_scoring import _common, _padded
from tests.agent.test_probe import OFFLINE, spooled


def _qwen3() -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    c = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        **_common(),
    )
    return Qwen3ForCausalLM(c)


def _gemma3() -> nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    c = Gemma3TextConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        sliding_window=4,
        **_common(),
    )
    return Gemma3ForCausalLM(c)


def _olmo2() -> nn.Module:
    from transformers import Olmo2Config, Olmo2ForCausalLM

    c = Olmo2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        **_common(),
    )
    return Olmo2ForCausalLM(c)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Tensor], torch.Tensor]]] = {
    "qwen3": (_qwen3, lambda w: w),
    "gemma3": (_gemma3, lambda w: 1.0 + w),
    "olmo2": (_olmo2, lambda w: w),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_qk_norm_gains_are_in_the_measured_weights(name: str, tmp_path: Path) -> None:
    build, gain_of = MODELS[name]
    torch.manual_seed(0)
    model = build().eval()
    attention = [layer.self_attn for layer in model.model.layers]
    with torch.no_grad():
        for attn in attention:
            for norm in (attn.q_norm, attn.k_norm):
                g = torch.exp(1.2 * torch.randn(norm.weight.shape))
                norm.weight.copy_(g - 1.0 if name == "gemma3" else g)

    # 1. the model's own normalised q and k lie along x W diag(g), with the measured factors
    sites = find_sites(model)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, attn in enumerate(attention):
        hooks.append(attn.q_proj.register_forward_hook(lambda m, a, o, i=i: inputs.__setitem__(i, a[0])))
        for which in ("q_norm", "k_norm"):
            hooks.append(
                getattr(attn, which).register_forward_hook(lambda m, a, o, i=i, w=which: outputs.__setitem__((i, w), o))
            )
    x, mask = _padded()
    with torch.no_grad():
        model(input_ids=x, attention_mask=mask)
    for hook in hooks:
        hook.remove()
    for i, site in enumerate(sites):
        wq, wk, _ = site.weights()
        for which, w in (("q_norm", wq), ("k_norm", wk)):
            ours = torch.einsum("btd,hde->bthe", inputs[i], w.detach())  # (B, T, heads, hs)
            theirs = outputs[(i, which)]
            theirs = (theirs.transpose(1, 2) if theirs.ndim == 4 and theirs.shape[1] != x.shape[1] else theirs).reshape(
                ours.shape
            )  # Gemma 3 normalises (B, heads, T, hs), the others (B, T, ...)
            cos = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)[mask.bool()]  # the pad embedding is 0
            assert torch.allclose(cos, torch.ones_like(cos), atol=1e-5), (name, i, which)

    # 2. the reported weight metrics are those of the hand-scaled factors
    a = agent.attach(model, spool=str(tmp_path), run="qknorm", every=1, **OFFLINE)
    a.step(0)
    with torch.no_grad():
        model(input_ids=x, attention_mask=mask)
    (report,) = spooled(a)
    for i, attn in enumerate(attention):
        h, g, hs = 4, attn.k_proj.out_features // attn.head_dim, attn.head_dim
        wq = attn.q_proj.weight.detach().view(h, hs, -1).transpose(-1, -2)
        wk = attn.k_proj.weight.detach().view(g, hs, -1).transpose(-1, -2)
        gq, gk = gain_of(attn.q_norm.weight.detach()), gain_of(attn.k_norm.weight.detach())
        scaled = weight_metrics((wq * gq.view(-1, 1, hs))[None], (wk * gk.view(-1, 1, hs))[None], None)[0]
        plain = weight_metrics(wq[None], wk[None], None)[0]
        for metric in ("stable_rank", "qk_cos", "qkai"):
            assert report["layers"][metric][i] == pytest.approx(scaled[metric].item(), rel=1e-5, abs=1e-6), metric
        assert abs(report["layers"]["stable_rank"][i] - plain["stable_rank"].item()) > 0.05


# --- the frameworks' q/k norms (tests/agent/test_frameworks.py builds the models) -----------------


def _titan_qk_norm() -> tuple[nn.Module, list[tuple[nn.Module, nn.Module, nn.Module, nn.Module]]]:
    from torchtitan.models.common import RMSNorm

    from tests.agent import test_frameworks as f

    model = f._titan("sdpa", False)  # its attention's forward applies q_norm and k_norm when they are set
    for layer in model.layers.values():
        attention = layer.attention
        attention.q_norm = RMSNorm.Config(normalized_shape=f.HS).build()
        attention.k_norm = RMSNorm.Config(normalized_shape=f.HS).build()
    return model, [
        (a.qkv_linear.wq, a.qkv_linear.wk, a.q_norm, a.k_norm) for a in (x.attention for x in model.layers.values())
    ]


def _litgpt_qk_norm() -> tuple[nn.Module, list[tuple[nn.Module, nn.Module, nn.Module, nn.Module]]]:
    from litgpt.config import Config
    from litgpt.model import GPT

    from tests.agent import test_frameworks as f

    config = Config(
        n_layer=2,
        n_head=f.H,
        n_query_groups=f.G,
        n_embd=f.DIM,
        block_size=64,
        vocab_size=f.V,
        padded_vocab_size=f.V,
        rotary_percentage=1.0,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=64,
        norm_qk=True,
    )
    torch.manual_seed(0)
    model = GPT(config).eval()
    out = []
    for block in model.transformer.h:
        q, k, _ = block.attn.qkv.weight.detach().split([f.H * f.HS, f.G * f.HS, f.G * f.HS])
        out.append((_Weight(q), _Weight(k), block.attn.norm_q, block.attn.norm_k))
    return model, out


class _Weight(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight


FRAMEWORKS = {"torchtitan": _titan_qk_norm, "litgpt": _litgpt_qk_norm}


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_the_frameworks_qk_norm_gains_are_in_the_measured_weights(name: str, tmp_path: Path) -> None:
    """torchtitan's ``q_norm``/``k_norm`` and litgpt's ``norm_q``/``norm_k`` (per head): the reported
    weight metrics are those of ``Wq_h diag(g_q)``, ``Wk_h diag(g_k)`` with the gains read off the
    parameters, and not those of the bare projections."""
    from tests.agent import test_frameworks as f

    model, layers = FRAMEWORKS[name]()
    with torch.no_grad():
        for *_, q_norm, k_norm in layers:
            for norm in (q_norm, k_norm):
                norm.weight.copy_(torch.exp(1.2 * torch.randn(norm.weight.shape)))
    a = agent.attach(model, spool=str(tmp_path), run="qknorm", every=1, **OFFLINE)
    a.step(0)
    with torch.no_grad():
        model(f._tokens())
    (report,) = spooled(a)
    for i, (wq_mod, wk_mod, q_norm, k_norm) in enumerate(layers):
        wq = wq_mod.weight.detach().view(f.H, f.HS, -1).transpose(-1, -2)
        wk = wk_mod.weight.detach().view(f.G, f.HS, -1).transpose(-1, -2)
        gq, gk = q_norm.weight.detach().view(1, 1, -1), k_norm.weight.detach().view(1, 1, -1)
        scaled = weight_metrics((wq * gq)[None], (wk * gk)[None], None)[0]
        plain = weight_metrics(wq[None], wk[None], None)[0]
        for metric in ("stable_rank", "qk_cos", "qkai"):
            assert report["layers"][metric][i] == pytest.approx(scaled[metric].item(), rel=1e-5, abs=1e-6), metric
        assert abs(report["layers"]["stable_rank"][i] - plain["stable_rank"].item()) > 0.05
