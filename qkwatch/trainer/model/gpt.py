"""A decoder-only GPT, readable top to bottom, with the baselines of seed 000 and seed 003.

Pre-norm blocks, RoPE (or nanoGPT's learned positions), ``scaled_dot_product_attention`` (flash
on GPU) or an explicit attention path, optional grouped-query attention. Variants by config:

* ``vanilla``: pre-norm LayerNorm blocks.
* ``qk_norm``: RMSNorm over ``d_head`` on queries and keys before RoPE (Henry et al. 2020).
* ``sigma_reparam``: every linear layer of the blocks uses ``W_hat = gamma / sigma(W) * W``, sigma
  from one power iteration per training forward (Zhai et al. 2023).
* ``deepnorm``: post-norm ``x = LN(alpha x + f(x))``, ``alpha = (2N)^(1/4)``, and the value, output
  and MLP weights initialised with gain ``beta = (8N)^(-1/4)`` (Wang et al. 2022, decoder-only).
* ``rezero``: no LayerNorm in the blocks, ``x = x + a f(x)`` with ``a`` learned and 0 at
  initialisation (Bachlechner et al. 2020); the final LayerNorm before the head is kept.
* ``outlier_removed``: seed 003's attention without its rank-one outlier, ``A - 1 1^T / T``;
  under the causal mask row ``i`` loses the uniform row over its ``i + 1`` allowed keys. Needs the
  explicit attention path (SDPA never exposes ``A``).

The seams other parts rely on (the agent's adapter, ``qkwatch analyze``, RAA):

* ``GPT.blocks[i].attn`` is an :class:`Attention` with ``nn.Linear`` ``q_proj``, ``k_proj``,
  ``v_proj``, ``o_proj`` and attributes ``n_heads``, ``n_kv_heads``, ``d_head``.
* ``Attention.key_rotation`` is RAA's Householder rotation, a
  :class:`~qkwatch.trainer.model.key_rotation.KeyRotation` (``vectors``: ``(n_kv_heads, p, d_head)``),
  or None. It is folded into the key projection (``k = R_g W_k x``, then RoPE): the effective key
  map of docs/metrics.md, ``Wk_h R_h^T`` in math layout, costs weight-sized work instead of passes over
  every key.
* ``Attention.qk_tap`` is an identity module called as ``qk_tap(q, k)`` right before attention
  with ``q (B, n_heads, T, d_head)`` and ``k (B, n_kv_heads, T, d_head)`` as the model uses them.
* ``Attention.qk_weights()`` returns the effective query/key weights in ``nn.Linear`` layout and the
  ``(n_kv_heads, d_head, d_head)`` key rotation or None.
* ``Attention.weight_penalties`` maps a name to ``fn(attention) -> scalar``; each is evaluated
  inside the forward, where FSDP2 has the weights unsharded, and returned with the block's output
  so that its gradient reaches the shards (RAA's PAR lives there).

Its building blocks live in modules of their own: ``model_config`` (:class:`ModelConfig`),
``normalisation`` (``RMSNorm``, ``SigmaReparamLinear``), ``rope`` and ``key_rotation``. This module
knows nothing of sharding, RAA's schedule or initialisation regimes: ``parallelize``, ``raa`` and
``init`` do those.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkwatch.trainer.model.config import ModelConfig
from qkwatch.trainer.model.key_rotation import KeyRotation
from qkwatch.trainer.model.normalisation import RMSNorm, SigmaReparamLinear, effective_weight
from qkwatch.trainer.model.rope import apply_rope, rope_cache


class GPTOutput(NamedTuple):
    logits: Tensor
    """``(B, T, vocab_size)``."""
    penalties: list[dict[str, Tensor]]
    """Per layer, the weight penalties its attention computed this forward (empty dict: none)."""


# --- attention ---------------------------------------------------------------------------------


class QKTap(nn.Module):
    """Identity on ``(q, k)``; a forward hook here sees queries and keys as attention uses them."""

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return q, k


WeightPenalty = Callable[["Attention"], Tensor]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.n_heads, self.n_kv_heads, self.d_head = c.n_heads, c.kv_heads, c.head_dim
        self.path = c.attention
        self.remove_outlier = c.variant == "outlier_removed"
        linear = SigmaReparamLinear if c.variant == "sigma_reparam" else nn.Linear
        self.q_proj = linear(c.d_model, self.n_heads * self.d_head, bias=c.bias)
        self.k_proj = linear(c.d_model, self.n_kv_heads * self.d_head, bias=c.bias)
        self.v_proj = linear(c.d_model, self.n_kv_heads * self.d_head, bias=c.bias)
        self.o_proj = linear(self.n_heads * self.d_head, c.d_model, bias=c.bias)
        self.q_norm = RMSNorm(self.d_head, c.norm_eps) if c.variant == "qk_norm" else None
        self.k_norm = RMSNorm(self.d_head, c.norm_eps) if c.variant == "qk_norm" else None
        self.key_rotation = KeyRotation(self.n_kv_heads, c.key_rotation, self.d_head) if c.key_rotation else None
        self.qk_tap = QKTap()
        self.weight_penalties: dict[str, WeightPenalty] = {}

    def qk_weights(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """Effective ``wq (n_heads*d_head, d_model)``, ``wk (n_kv_heads*d_head, d_model)``, rotation."""
        rotation = self.key_rotation.matrix() if self.key_rotation is not None else None
        return effective_weight(self.q_proj), effective_weight(self.k_proj), rotation

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> tuple[Tensor, dict[str, Tensor]]:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # (B, nh, T, hs)
        k = self._keys(x).view(B, T, self.n_kv_heads, self.d_head).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.d_head).transpose(1, 2)  # (B, nkv, T, hs)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k = self.qk_tap(q, k)
        y = (
            self._attend(q, k, v)
            if self.path == "explicit"
            else F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.d_head)  # (B, T, nh*hs)
        return self.o_proj(y), self._penalties()

    def _keys(self, x: Tensor) -> Tensor:
        """``k = R_g W_k x`` (before RoPE): RAA's rotation folded into the projection's weights."""
        if self.key_rotation is None:
            keys: Tensor = self.k_proj(x)  # (B, T, nkv*hs)
            return keys
        if isinstance(self.k_proj, SigmaReparamLinear) and self.training and torch.is_grad_enabled():
            self.k_proj.power_iteration()  # what its own forward would have done
        weight, bias = self.key_rotation.fold(effective_weight(self.k_proj), self.k_proj.bias)
        return F.linear(x, weight, bias)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Explicit causal softmax attention; seed 003's variant subtracts the uniform row."""
        T = q.shape[-2]
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, nh, T, hs)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.d_head))  # (B, nh, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        att = scores.masked_fill(~causal, -math.inf).softmax(dim=-1)
        if self.remove_outlier:
            uniform = causal / torch.arange(1, T + 1, device=q.device, dtype=att.dtype)[:, None]  # (T, T)
            att = att - uniform.to(att.dtype)
        return att @ v

    def _penalties(self) -> dict[str, Tensor]:
        if not self.weight_penalties or not torch.is_grad_enabled():  # nothing to train: skip them
            return {}
        return {name: fn(self) for name, fn in self.weight_penalties.items()}


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        linear = SigmaReparamLinear if config.variant == "sigma_reparam" else nn.Linear
        self.fc_in = linear(config.d_model, config.mlp_dim, bias=config.bias)
        self.fc_out = linear(config.mlp_dim, config.d_model, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc_out(F.gelu(self.fc_in(x)))
        return out


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.variant = config.variant
        norm = (
            (lambda: nn.Identity())
            if config.variant == "rezero"
            else (lambda: nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias))
        )
        self.norm1, self.attn, self.norm2, self.mlp = norm(), Attention(config), norm(), MLP(config)
        self.deepnorm_alpha = (2.0 * config.n_layers) ** 0.25
        if config.variant == "rezero":
            self.rezero_attn = nn.Parameter(torch.zeros(1))
            self.rezero_mlp = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> tuple[Tensor, dict[str, Tensor]]:
        if self.variant == "deepnorm":  # post-norm with an up-weighted residual
            a, penalties = self.attn(x, rope)
            x = self.norm1(self.deepnorm_alpha * x + a)
            return self.norm2(self.deepnorm_alpha * x + self.mlp(x)), penalties
        if self.variant == "rezero":
            a, penalties = self.attn(x, rope)
            x = x + self.rezero_attn * a
            return x + self.rezero_mlp * self.mlp(x), penalties
        a, penalties = self.attn(self.norm1(x), rope)
        x = x + a
        return x + self.mlp(self.norm2(x)), penalties


# --- the model ---------------------------------------------------------------------------------


class GPT(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config = config.resolved()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model) if config.position == "learned" else None
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = (
            nn.Identity()
            if config.variant == "deepnorm"
            else nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
        )
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the non-persistent buffers, e.g. after ``to_empty`` from the meta device."""
        c = self.config
        if c.position == "rope":
            cos, sin = rope_cache(c.max_seq_len, c.head_dim, c.rope_theta, self.tok_emb.weight.device)
            self.rope_cos, self.rope_sin = cos, sin

    def tie_weights(self) -> None:
        """Share the embedding with the head again (``to_empty`` from the meta device unties them)."""
        if self.config.tie_embeddings and self.lm_head.weight is not self.tok_emb.weight:
            self.lm_head.weight = self.tok_emb.weight

    def attentions(self) -> list[Attention]:
        # nn.ModuleList types its items as nn.Module: they are the Blocks built above
        return [cast(Block, block).attn for block in self.blocks]

    def forward(self, idx: Tensor) -> GPTOutput:
        T = idx.shape[1]
        if T > self.config.max_seq_len:  # noqa: SIM300 (T is a length, not a constant)
            raise ValueError(f"sequence of {T} tokens is longer than model.max_seq_len={self.config.max_seq_len}")
        x = self.tok_emb(idx)  # (B, T, D)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=idx.device))
        rope = (self.rope_cos[:T], self.rope_sin[:T]) if self.config.position == "rope" else None
        penalties: list[dict[str, Tensor]] = []
        for block in self.blocks:
            x, pen = block(x, rope)
            penalties.append(pen)
        return GPTOutput(self.lm_head(self.norm(x)), penalties)  # logits (B, T, V)
