"""Pure attention-geometry math: tensors in, tensors out; no hooks, threads, I/O or globals.

Every function is batched over any leading dimensions (layers x heads in one call), computes
in float32 by default (float64 on request), and runs on whatever device its inputs live on.
The definitions are docs/metrics.md's metric tables.
"""

from qkwatch.agent.metrics.attention import (
    attention_spectrum,
    attention_stats,
    qk_erank,
    scored_logits,
)
from qkwatch.agent.metrics.digest import export_fault, tensor_sha256
from qkwatch.agent.metrics.heads import (
    SPLITS,
    effective_key_map,
    group_heads,
    householder,
    split_heads,
    split_qkv,
    split_qkv_output,
)
from qkwatch.agent.metrics.masks import mask_values, visible_keys
from qkwatch.agent.metrics.par import TAU_FACTOR, par_penalty
from qkwatch.agent.metrics.rows import SPECTRUM_NAMES, STAT_NAMES, RowMetric, activation_metric
from qkwatch.agent.metrics.spectra import column_alignment, effective_rank, participation_ratio, projection_norms
from qkwatch.agent.metrics.subspace import (
    ACCURACY,
    RANDOMIZED_TOLERANCE,
    geometry,
    principal_overlap,
    qkai,
    stable_rank,
)
from qkwatch.agent.metrics.summary import WeightMetric, weight_metric

__all__ = [
    "ACCURACY",
    "RANDOMIZED_TOLERANCE",
    "SPECTRUM_NAMES",
    "SPLITS",
    "STAT_NAMES",
    "TAU_FACTOR",
    "RowMetric",
    "WeightMetric",
    "activation_metric",
    "attention_spectrum",
    "attention_stats",
    "column_alignment",
    "effective_key_map",
    "effective_rank",
    "export_fault",
    "geometry",
    "group_heads",
    "householder",
    "mask_values",
    "par_penalty",
    "participation_ratio",
    "principal_overlap",
    "projection_norms",
    "qk_erank",
    "qkai",
    "scored_logits",
    "split_heads",
    "split_qkv",
    "split_qkv_output",
    "stable_rank",
    "tensor_sha256",
    "visible_keys",
    "weight_metric",
]
