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
* ``Attention.key_rotation`` is RAA's Householder rotation (``vectors``: ``(n_kv_heads, p, d_head)``),
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

This module knows nothing of sharding, RAA's schedule or initialisation regimes: ``parallelize``,
``raa`` and ``init`` do those.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkwatch.agent.metrics import householder

VARIANTS = ("vanilla", "qk_norm", "sigma_reparam", "deepnorm", "rezero", "outlier_removed")
ATTENTION_PATHS = ("auto", "sdpa", "explicit")
POSITIONS = ("rope", "learned")


@dataclass
class ModelConfig:
    """Shape and variant of the GPT. ``None`` fields are derived (see :meth:`resolved`)."""

    vocab_size: int = 256
    """Tokens in the vocabulary; 256 for the byte-level tokenizer."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads per layer."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None = n_heads. Must divide n_heads."""
    d_model: int = 256
    """Width of the residual stream."""
    d_head: int | None = None
    """Width of one head; None = d_model // n_heads."""
    d_mlp: int | None = None
    """Hidden width of the MLP; None = 4 * d_model."""
    max_seq_len: int = 128
    """Longest sequence the model takes (RoPE cache / learned positions)."""
    variant: str = "vanilla"
    """One of vanilla, qk_norm, sigma_reparam, deepnorm, rezero, outlier_removed."""
    attention: str = "auto"
    """auto (SDPA, explicit for outlier_removed), sdpa or explicit (materialises A)."""
    position: str = "rope"
    """rope, or learned absolute positions (nanoGPT, seed 001)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    bias: bool = False
    """Biases in the linear layers and LayerNorms (seed 001 uses them)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head."""
    key_rotation: int = 0
    """Householder reflections per key head (RAA); 0 = no rotation. Set by RunConfig from raa.*."""
    norm_eps: float = 1e-5
    """LayerNorm / RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the default normal initialisation."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "n_layers", "n_heads", "d_model", "max_seq_len")
        for key in positive:
            if not isinstance(getattr(self, key), int) or getattr(self, key) <= 0:
                raise ValueError(f"model.{key} must be a positive integer, got {getattr(self, key)!r}")
        for key in ("n_kv_heads", "d_head", "d_mlp"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"model.{key} must be a positive integer or None, got {value!r}")
        _choice("model.variant", self.variant, VARIANTS)
        _choice("model.attention", self.attention, ATTENTION_PATHS)
        _choice("model.position", self.position, POSITIONS)
        n_kv, d_head = self.kv_heads, self.head_dim
        if self.n_heads % n_kv:
            raise ValueError(f"model.n_kv_heads={n_kv} must divide model.n_heads={self.n_heads}")
        if self.d_head is None and self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not a multiple of model.n_heads={self.n_heads}; set d_head"
            )
        if d_head > self.d_model:
            raise ValueError(f"model.d_head={d_head} exceeds model.d_model={self.d_model}")
        if self.position == "rope" and d_head % 2:
            raise ValueError(f"model.d_head={d_head} must be even for RoPE")
        if self.variant == "outlier_removed" and self.attention == "sdpa":
            raise ValueError(
                "model.attention=sdpa cannot remove the attention outlier (A is never formed): "
                "use attention=explicit or auto"
            )
        if self.key_rotation < 0 or self.key_rotation % 2:
            raise ValueError(
                f"model.key_rotation={self.key_rotation} must be an even number >= 0 "
                "(pairs of equal reflections make the rotation the identity at initialisation)"
            )
        if self.norm_eps <= 0 or self.init_std <= 0 or self.rope_theta <= 0:
            raise ValueError("model.norm_eps, model.init_std and model.rope_theta must be positive")

    @property
    def kv_heads(self) -> int:
        """``n_kv_heads``, derived where it is None."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """``d_head``, derived where it is None."""
        return self.d_head or self.d_model // self.n_heads

    @property
    def mlp_dim(self) -> int:
        """``d_mlp``, derived where it is None."""
        return self.d_mlp or 4 * self.d_model

    def resolved(self) -> ModelConfig:
        """A copy with every derived field filled in (what ``GPT.config`` holds)."""
        attention = self.attention
        if attention == "auto":
            attention = "explicit" if self.variant == "outlier_removed" else "sdpa"
        return dataclasses.replace(
            self, n_kv_heads=self.kv_heads, d_head=self.head_dim, d_mlp=self.mlp_dim, attention=attention
        )

    def num_params(self) -> int:
        """Parameter count without building the model (tied embeddings once; the few scalars and
        norm gains that qk_norm, sigma_reparam and rezero add are left out)."""
        c = self
        d, hs, b = c.d_model, c.head_dim, int(c.bias)
        width = hs * (2 * c.n_heads + 2 * c.kv_heads)  # q, k, v and o projections
        attn = d * width + b * (hs * (c.n_heads + 2 * c.kv_heads) + d)
        mlp = 2 * d * c.mlp_dim + b * (c.mlp_dim + d)
        norms = 2 * d * (1 + b)
        block = attn + mlp + norms + c.kv_heads * c.key_rotation * hs
        emb = c.vocab_size * d * (1 if c.tie_embeddings else 2) + (c.max_seq_len * d if c.position == "learned" else 0)
        return c.n_layers * block + emb + d * (1 + b)


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {', '.join(allowed)}")


class GPTOutput(NamedTuple):
    logits: Tensor
    """``(B, T, vocab_size)``."""
    penalties: list[dict[str, Tensor]]
    """Per layer, the weight penalties its attention computed this forward (empty dict: none)."""


# --- building blocks ---------------------------------------------------------------------------


class QKTap(nn.Module):
    """Identity on ``(q, k)``; a forward hook here sees queries and keys as attention uses them."""

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return q, k


class SigmaReparamLinear(nn.Linear):
    """``nn.Linear`` with effective weight ``gamma / sigma(W) * W`` (sigma-Reparam, Zhai et al. 2023).

    ``sigma(W) = u^T W v`` with ``u``, ``v`` from power iteration (no gradient through them; the
    gradient through ``W`` in ``sigma`` is kept). One iteration per training forward; ``u`` is a
    persistent buffer so a resumed run continues the same estimate.
    """

    u: Tensor
    """``(out,)`` power-iteration vector (a buffer)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.gamma = nn.Parameter(torch.ones(1))
        self.register_buffer("u", F.normalize(torch.ones(out_features), dim=0))

    @torch.no_grad()
    def power_iteration(self, n: int = 1) -> None:
        w = self.weight.float()
        u = self.u
        for _ in range(n):
            v = F.normalize(w.mT @ u, dim=0)  # (in,)
            u = F.normalize(w @ v, dim=0)  # (out,)
        self.u.copy_(u)

    def effective_weight(self) -> Tensor:
        w = self.weight
        with torch.no_grad():
            v = F.normalize(w.float().mT @ self.u, dim=0)  # (in,)
        sigma = self.u @ (w.float() @ v)  # gradient flows through W
        return w * (self.gamma / sigma).to(w.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.training and torch.is_grad_enabled():
            self.power_iteration()
        return F.linear(x, self.effective_weight(), self.bias)


def effective_weight(linear: nn.Linear) -> Tensor:
    """The weight the layer really multiplies by (sigma-Reparam's scaled one where that applies)."""
    return linear.effective_weight() if isinstance(linear, SigmaReparamLinear) else linear.weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class KeyRotation(nn.Module):
    """RAA's per-head Householder key rotation ``R_g = H_1 ... H_p``, ``H_i = I - 2 v_i v_i^T / |v_i|^2``.

    Orthogonal by construction (norms of keys are preserved). ``p`` is even and the vectors come in
    equal pairs at initialisation (``H(v) H(v) = I``), so the rotation starts as the identity.
    """

    def __init__(self, n_kv_heads: int, reflections: int, d_head: int) -> None:
        super().__init__()
        self.vectors = nn.Parameter(torch.empty(n_kv_heads, reflections, d_head))

    def matrix(self) -> Tensor:
        """``(n_kv_heads, d_head, d_head)`` rotation in float32 (applied to a key column as ``R @ k``)."""
        return householder(self.vectors.float())

    def wy(self) -> tuple[Tensor, Tensor]:
        """Compact WY form ``R = H_1 ... H_p = I - V^T T V``, returned as ``(V, T^T V)``.

        ``V (G, p, d)`` holds the reflection vectors as rows; ``T (G, p, p)`` is upper triangular with
        ``T^{-1} = diag(|v_j|^2 / 2) + triu(V V^T, 1)`` (Joffrain et al. 2006), so ``T^T V`` is one
        triangular solve, a handful of kernels per layer whatever ``p``.
        """
        v = self.vectors.float()  # (G, p, d)
        gram = v @ v.mT  # (G, p, p)
        t_inv = torch.diag_embed(gram.diagonal(dim1=-2, dim2=-1) / 2) + gram.triu(1)
        return v, torch.linalg.solve_triangular(t_inv.mT, v, upper=False)  # T^T V = (T^{-1})^{-T} V

    def fold(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The key projection with the rotation folded in: ``W' = R_g W_g`` and ``b' = R_g b_g`` per head.

        ``weight`` is ``(G * d, d_model)`` (``nn.Linear`` layout). In the compact WY form that is
        ``4 p G d d_model`` flops on the weights whatever the number of tokens, instead of the same
        per token on the keys.
        """
        v, tv = (t.to(weight.dtype) for t in self.wy())  # (G, p, d): R = I - V^T T V, tv = T^T V
        g, _, d = v.shape
        w = weight.view(g, d, -1)  # (G, d, D)
        folded = (w - tv.mT @ (v @ w)).reshape(g * d, -1)  # R W = W - (T^T V)^T (V W): inner size p
        if bias is None:
            return folded, None
        b = bias.view(g, d, 1).to(weight.dtype)
        return folded, (b - tv.mT @ (v @ b)).reshape(-1).to(bias.dtype)

    def forward(self, k: Tensor) -> Tensor:
        """``k (B, G, T, d) -> R_g k`` as ``k - (k V^T) (T^T V)``: two skinny products (inner size p).

        That is ``4 p d`` flops per key instead of ``2 d^2`` for the matrix, in a few passes over the
        keys instead of the ``4 p`` of reflecting one vector at a time. The keys come from a
        ``(B, T, G, d)`` projection, so the products run in that layout (no copy to ``(B, G, T, d)``).
        """
        v, w = self.wy()
        kt = k.transpose(1, 2)  # (B, T, G, d)
        coef = torch.einsum("btgd,gpd->btgp", kt, v.to(k.dtype))  # (B, T, G, p)
        return (kt - torch.einsum("btgp,gpd->btgd", coef, w.to(k.dtype))).transpose(1, 2)  # (B, G, T, d)


def rope_cache(seq_len: int, d_head: int, theta: float, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, d_head, 2, device=device, dtype=torch.float32) / d_head)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, d/2)
    angles = torch.cat([freqs, freqs], dim=-1)  # (T, d)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x (B, h, T, d)`` by position (rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


# --- attention ---------------------------------------------------------------------------------

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
