"""The GPT's shape and variant: :class:`ModelConfig`, validated on construction, derived fields filled
in by :meth:`ModelConfig.resolved` (what ``GPT.config`` holds)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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
