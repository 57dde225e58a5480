"""Weight initialisation, including seed 001's query/key regimes.

Every parameter is drawn as a full tensor on the CPU from its own generator, seeded by the run's
seed and the parameter's name, and then copied into the (possibly FSDP2-sharded) parameter. So
the initial weights are a function of (seed, name) alone: the same on 1 or 64 ranks, on the CPU
or a GPU, and a model built on the meta device and sharded before it is materialised never holds
a full copy of itself.

Regimes for ``W_Q`` / ``W_K`` (seed 001), on the layers ``qk_layers`` (default: all):

* ``qk_identical``: ``W_K = W_Q`` (Xavier uniform); QKAI and ``qk_cos`` are 1. With GQA, key
  head ``g`` copies query head ``g * n_rep``.
* ``disjoint_support_xavier``: ``W_Q`` reads only the first half of the residual stream's
  coordinates, ``W_K`` only the second half (Xavier uniform with the support as fan-in); the
  subspaces are orthogonal: QKAI and ``qk_cos`` are 0.
* ``independent_xavier``: independent Xavier uniform; ``qk_cos`` about ``sqrt(2 / (pi d_model))``
  (0.0498 at 256).
* ``default``: the GPT-2 normal initialisation every other weight gets.

Other weights: normal(0, ``init_std``) with the residual output projections scaled by
``1/sqrt(2 n_layers)`` (GPT-2); DeepNorm instead uses Xavier normal with gain ``(8N)^(-1/4)`` on
the value, output and MLP weights and gain 1 on the queries and keys; norms start at 1, biases and
ReZero gates at 0; RAA's Householder vectors come in equal pairs (identity rotation).

:func:`build_model` is where a model comes to exist: built on the meta device, handed to the
parallelizer (``trainer.run.parallelize``: sharding, activation checkpointing, compile), then
materialised and initialised here, shard by shard.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from qkwatch.trainer.model.config import ModelConfig
from qkwatch.trainer.model.gpt import GPT
from qkwatch.trainer.model.normalisation import SigmaReparamLinear

POWER_ITERATIONS_AT_INIT = 50
"""sigma-Reparam's estimate at initialisation; training then adds one iteration per step."""

REGIMES = ("default", "qk_identical", "disjoint_support_xavier", "independent_xavier")


@dataclass
class InitConfig:
    """Seed 001's query/key initialisation regime."""

    qk_regime: str = "default"
    """default, qk_identical, disjoint_support_xavier or independent_xavier."""
    qk_layers: list[int] | None = None
    """Layers the regime applies to (None: all); e.g. a mid-depth band to induce a collapse band."""

    def __post_init__(self) -> None:
        if self.qk_regime not in REGIMES:
            raise ValueError(f"init.qk_regime={self.qk_regime!r} is not one of {', '.join(REGIMES)}")
        if self.qk_layers is not None and (
            not isinstance(self.qk_layers, list) or not all(isinstance(i, int) and i >= 0 for i in self.qk_layers)
        ):
            raise ValueError(f"init.qk_layers must be a list of layer indices >= 0 or None, got {self.qk_layers!r}")


def generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator that depends on the run's seed and one parameter's name only."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def xavier_uniform(shape: tuple[int, int], gen: torch.Generator, fan_in: int | None = None) -> Tensor:
    """Glorot uniform for an ``nn.Linear`` weight ``(out, in)``; ``fan_in`` overrides ``in``."""
    out, inp = shape
    bound = math.sqrt(6.0 / ((fan_in or inp) + out))
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


def qk_regime_weights(
    regime: str,
    wq_shape: tuple[int, int],
    wk_shape: tuple[int, int],
    n_heads: int,
    n_kv_heads: int,
    seed: int,
    prefix: str,
) -> tuple[Tensor, Tensor]:
    """Full ``(W_Q, W_K)`` of one layer in ``nn.Linear`` layout for a seed 001 regime."""
    gq, gk = generator(seed, prefix + "q_proj.weight"), generator(seed, prefix + "k_proj.weight")
    d_model = wq_shape[1]
    if regime == "independent_xavier":
        return xavier_uniform(wq_shape, gq), xavier_uniform(wk_shape, gk)
    if regime == "qk_identical":
        wq = xavier_uniform(wq_shape, gq)
        d_head = wq_shape[0] // n_heads
        rep = n_heads // n_kv_heads
        heads = wq.view(n_heads, d_head, d_model)[::rep]  # (nkv, hs, D): key head g = query head g*rep
        return wq, heads.reshape(wk_shape).clone()
    if regime == "disjoint_support_xavier":
        half = d_model // 2
        wq = torch.zeros(wq_shape)
        wk = torch.zeros(wk_shape)
        wq[:, :half] = xavier_uniform((wq_shape[0], half), gq)
        wk[:, half:] = xavier_uniform((wk_shape[0], d_model - half), gk)
        return wq, wk
    raise ValueError(f"no seed 001 regime {regime!r}")


@torch.no_grad()
def assign(param: Tensor, full: Tensor) -> None:
    """Copy a full tensor into a parameter or buffer, taking this rank's shard if it is a DTensor."""
    if isinstance(param, DTensor):
        full = full.to(device=param.device_mesh.device_type, dtype=param.dtype)
        param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))
    else:
        param.copy_(full.to(device=param.device, dtype=param.dtype))


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor (an all-gather when it is a sharded DTensor: every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def build_model(
    config: ModelConfig,
    init: InitConfig,
    seed: int,
    device: torch.device,
    parallelize: Callable[[GPT], object] | None = None,
) -> GPT:
    """A GPT built on the meta device, materialised on ``device`` and initialised.

    Args:
        parallelize: applied to the model while it is still on the meta device (for example
            ``trainer.run.parallelize.parallelize`` bound to its config and env), so that a sharded
            model is materialised and initialised shard by shard: no rank ever holds all of it.
    """
    with torch.device("meta"):
        model = GPT(config)
    if parallelize is not None:
        parallelize(model)
    model.to_empty(device=device)
    if not isinstance(model.tok_emb.weight, DTensor):
        model.tie_weights()  # FSDP2 keeps the tie through to_empty; a plain module does not
    init_weights(model, init, seed)
    return model


@torch.no_grad()
def init_weights(model: GPT, init: InitConfig, seed: int) -> None:
    """Initialise every parameter and buffer of a :class:`qkwatch.trainer.model.gpt.GPT` (sharded or not)."""
    c = model.config
    regime_layers = set(range(c.n_layers) if init.qk_layers is None else init.qk_layers)
    done: set[str] = set()
    for i, attn in enumerate(model.attentions()):
        if init.qk_regime != "default" and i in regime_layers:
            prefix = f"blocks.{i}.attn."
            wq, wk = qk_regime_weights(
                init.qk_regime,
                (attn.q_proj.out_features, attn.q_proj.in_features),  # the weights' (out, in)
                (attn.k_proj.out_features, attn.k_proj.in_features),
                attn.n_heads,
                attn.n_kv_heads,
                seed,
                prefix,
            )
            assign(attn.q_proj.weight, wq)
            assign(attn.k_proj.weight, wk)
            done |= {prefix + "q_proj.weight", prefix + "k_proj.weight"}
    for name, param in model.named_parameters():
        if name not in done:
            assign(param, _default(name, tuple(param.shape), c, seed))
    for name, buf in model.named_buffers():
        if name.endswith(".u"):  # sigma-Reparam's power-iteration vector
            gen = generator(seed, name)
            assign(buf, nn.functional.normalize(torch.randn(tuple(buf.shape), generator=gen), dim=0))
    model.reset_buffers()
    for module in model.modules():
        if isinstance(module, SigmaReparamLinear):
            _settle_power_iteration(module)


def _default(name: str, shape: tuple[int, ...], c: ModelConfig, seed: int) -> Tensor:
    leaf = name.rsplit(".", 1)[-1]
    gen = generator(seed, name)
    if leaf == "vectors":  # Householder pairs: H(v) H(v) = I
        half = torch.randn((shape[0], shape[1] // 2, shape[2]), generator=gen)
        return half.repeat_interleave(2, dim=1)
    if leaf.startswith("rezero") or leaf == "bias":
        return torch.zeros(shape)
    if leaf == "gamma" or len(shape) == 1:  # norm gains, sigma-Reparam's gamma
        return torch.ones(shape)
    if c.variant == "deepnorm" and ".blocks." in f".{name}" and leaf == "weight":
        beta = (8.0 * c.n_layers) ** -0.25
        gain = 1.0 if (".q_proj." in name or ".k_proj." in name) else beta
        std = gain * math.sqrt(2.0 / (shape[0] + shape[1]))
        return torch.randn(shape, generator=gen) * std
    std = c.init_std
    if name.endswith("o_proj.weight") or name.endswith("fc_out.weight"):
        std = std / math.sqrt(2 * c.n_layers)  # GPT-2's scaled residual projections
    return torch.randn(shape, generator=gen) * std


def _settle_power_iteration(module: SigmaReparamLinear) -> None:
    """Converge sigma-Reparam's estimate at initialisation (on the full weight)."""
    weight = module.weight
    if isinstance(weight, DTensor):
        w = weight.full_tensor().float()
        u = module.u
        for _ in range(POWER_ITERATIONS_AT_INIT):
            u = nn.functional.normalize(w @ nn.functional.normalize(w.mT @ u, dim=0), dim=0)
        module.u.copy_(u)
    else:
        module.power_iteration(POWER_ITERATIONS_AT_INIT)
