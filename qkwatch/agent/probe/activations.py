"""The rows of q and k that the activation metrics read, and the metrics of those rows.

On a report step the probe's tap hands over the queries and keys of a whole micro-batch and the
mask the model attended under. :class:`Sampler` cuts out the few rows the metrics need (own
copies when they are measured later, in the worker thread) and measures them, any number of
layers stacked on a leading dim:

* row statistics (entropy, top-k, logits): ``sample_rows`` query rows in all, spread over the
  first ``sample_seqs`` sequences (evenly spaced over each one's positions), against all keys of
  the same sequence; averaged over sequences and heads (the entropy the schedule reads varies
  more from sequence to sequence than from row to row); ``qk_erank`` from ``sample_rows`` rows of
  the first sequence (its value is capped by the rows it sees);
* seed 003's ``attn_srank`` and ``attn_gap1``: the square attention matrix of the first
  sequence's first ``spectrum_window`` tokens (``A - U`` where the model removes the outlier);
* ``pr_q``, ``pr_k``: every position of the micro-batch, evenly strided down to ``pr_rows`` rows
  (the participation ratio reads low from few rows: see ``participation_ratio``).

The logits are the model's own (``agent.metrics.scored_logits``): its scale and soft-cap as the tap
gives them (``Scoring``; by default ``1 / sqrt(d_head)``, no cap), and the finite values of an
additive mask as a bias (ALiBi, T5's position bias).

The mask: a row counts only the keys the model let it see (causal and padding), and a padding
token is left out everywhere: as a query row, as a key of ``qk_erank``, as a row of the spectrum
and as a position of the participation ratios. A token is padding when the mask hides its own
key from its own query, which no causal, bidirectional, sliding-window or document mask does to
a real token. Sampled positions stay evenly spaced over the whole sequence, so a padded sequence
gives fewer rows. Without a mask the site's causality says which keys each row sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkwatch.agent.metrics import (
    attention_spectrum,
    attention_stats,
    mask_values,
    participation_ratio,
    qk_erank,
    visible_keys,
)
from qkwatch.agent.models.sites import Scoring, Site

ACTIVATION_HEAD_METRICS = ("attn_entropy", "attn_entropy_nats", "attn_top1", "logit_std", "qk_erank")

Inputs = dict[str, Tensor]
"""Named rows for :meth:`Sampler.metrics`; ``pos`` (the sampled rows' key positions) is shared
by every layer of a batch, the rest may be stacked on a leading layer dim."""


@dataclass
class Sampler:
    """Which rows the activation metrics read (``ProbeConfig``'s fields of the same names)."""

    sample_rows: int
    sample_seqs: int = 1
    spectrum_window: int = 256
    pr_rows: int = 4096
    heads: bool = False
    _positions: dict[tuple[int, int, str], Tensor] = field(default_factory=dict, repr=False)

    def inputs(
        self,
        site: Site,
        q: Tensor,
        k: Tensor,
        mask: Tensor | None,
        causal: bool | None,
        scoring: Scoring | None = None,
        *,
        copy: bool,
    ) -> Inputs:
        """The rows the metrics read (own copies with ``copy``: the model may reuse its buffers).

        ``q (B, H, T_q, hs)``, ``k (B, G, T_k, hs)``; ``mask``, ``causal`` and ``scoring`` as the tap
        gave them (``agent.models.sites.TapFn``; ``causal`` None: the site's).
        """
        q, k = q.detach(), k.detach()
        t_q, t_k = q.shape[-2], k.shape[-2]
        seen = self._seen(site, mask, causal, t_q, t_k, q)
        seqs_q, seqs_k = q[: self.sample_seqs], k[: self.sample_seqs]  # (S, H, Tq, hs), (S, G, Tk, hs)
        # sample_rows rows in all, spread over the sequences (the noise is in which sequence, not
        # which row); qk_erank, capped by the rows it sees, takes all of them from the first one
        pos = self._rows(t_q, min(max(1, self.sample_rows // len(seqs_q)), t_q), k.device)
        rows = self._rows(t_q, min(self.sample_rows, t_q), k.device)

        def keep(x: Tensor) -> Tensor:
            return x.clone() if copy else x

        inputs = {
            "stats_q": seqs_q[:, :, pos],  # advanced indexing: a copy already
            "pos": pos + (t_k - t_q) if t_k != t_q else pos,  # the rows' positions among the keys
            "seqs_k": keep(seqs_k),
            "erank_q": q[0][:, rows],
        }
        w = min(t_q, self.spectrum_window)
        if t_q == t_k:  # self-attention: the square matrix exists
            inputs["spectrum_q"] = keep(q[0][:, :w])
        if seen is not None:
            inputs.update(self._masks(seen, pos, rows, w, len(seqs_q), square=t_q == t_k))
            inputs["erank_q"] = inputs["erank_q"] * inputs.pop("erank_q_rows")[:, None]  # padding rows: zero
        if seen is not None and mask is not None and mask.is_floating_point():
            inputs.update(self._biases(mask, seen, pos, w, len(seqs_q), square=t_q == t_k))
        inputs.update(_scoring(scoring))
        if q.shape[0] * t_q >= 2 and k.shape[0] * t_k >= 2:
            inputs["pr_q"], inputs["pr_k"] = self._strided(q), self._strided(k)  # copies (advanced indexing)
            if seen is not None:
                inputs["pr_q_rows"] = self._strided_rows(_own_key(seen), t_q)
                inputs["pr_k_rows"] = self._strided_rows(seen[:, 0].any(-2), t_k)
        return inputs

    def metrics(self, site: Site, inputs: Inputs) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Per-layer (and per-head, with ``heads``) metrics of :meth:`inputs`' rows; with the rows of
        several layers stacked on a leading dim, a value per layer along it."""
        seqs_k, mask = inputs["seqs_k"], inputs.get("stats_mask")
        q_pos = inputs["pos"] if site.causal and mask is None else None
        scale, softcap = inputs.get("scale"), inputs.get("softcap")
        stats = attention_stats(
            inputs["stats_q"],
            seqs_k,
            causal=site.causal,
            q_pos=q_pos,
            mask=mask,
            erank=False,
            bias=inputs.get("stats_bias"),
            scale=scale,
            softcap=softcap,
        )
        # (..., H): the sequences averaged, a sequence with no row to measure (all padding) left out
        stats = {name: value.nanmean(-2) for name, value in stats.items()}
        seq_k = seqs_k.select(-4, 0)  # the first sequence: (..., G, T, hs)
        erank_k = seq_k if "erank_k" not in inputs else seq_k * inputs["erank_k"][..., None, :, None]
        stats["qk_erank"] = qk_erank(inputs["erank_q"], erank_k)
        if "spectrum_q" in inputs:
            spectrum_q = inputs["spectrum_q"]
            w = spectrum_q.shape[-2]
            spectrum = attention_spectrum(
                spectrum_q,
                seq_k[..., :w, :],
                causal=site.causal,
                remove_outlier=site.remove_outlier,
                mask=inputs.get("spectrum_mask"),
                bias=inputs.get("spectrum_bias"),
                scale=scale,
                softcap=softcap,
            )
            stats.update(spectrum)
        per_layer = {name: value.float().mean(-1) for name, value in stats.items()}
        if "pr_q" in inputs:
            pr_q = participation_ratio(inputs["pr_q"].float(), inputs.get("pr_q_rows"))  # (n, H*hs)
            pr_k = participation_ratio(inputs["pr_k"].float(), inputs.get("pr_k_rows"))  # (n, G*hs)
            per_layer.update({"pr_q": pr_q, "pr_k": pr_k, "pr_gap": pr_q - pr_k})
        heads = {name: stats[name].float() for name in ACTIVATION_HEAD_METRICS} if self.heads else {}
        return per_layer, heads

    def _seen(
        self, site: Site, mask: Tensor | None, causal: bool | None, t_q: int, t_k: int, q: Tensor
    ) -> Tensor | None:
        """``(B, H|1, T_q, T_k)``: the keys each row saw, padding queries' rows cleared; None: the
        site's causality alone (no mask, and the attention as causal as the site says)."""
        causal = site.causal if causal is None else causal
        if mask is None and causal == site.causal:
            return None
        if mask is None:
            mask = torch.ones(1, 1, t_q, t_k, dtype=torch.bool, device=q.device)
        seen = visible_keys(mask, causal, t_q, t_k)
        assert seen is not None, "visible_keys of a mask is a mask"
        seen = seen.expand(q.shape[0], *seen.shape[1:])
        return seen & _own_key(seen)[:, None, :, None]

    def _masks(self, seen: Tensor, pos: Tensor, rows: Tensor, w: int, n_seqs: int, *, square: bool) -> Inputs:
        out = {
            "stats_mask": seen[:n_seqs][:, :, pos],  # (S, H|1, n, Tk): a copy (advanced indexing)
            "erank_q_rows": _own_key(seen[:1])[0, rows].to(torch.float32),  # (n,)
            "erank_k": seen[0, 0].any(-2).to(torch.float32),  # (Tk,): keys some row of the first sequence saw
        }
        if square:
            out["spectrum_mask"] = seen[0, :, :w, :w].clone()  # (H|1, W, W)
        return out

    def _biases(self, mask: Tensor, seen: Tensor, pos: Tensor, w: int, n_seqs: int, *, square: bool) -> Inputs:
        """The finite values of an additive mask where keys are seen (ALiBi, a position bias), zero elsewhere."""
        t_q, t_k = seen.shape[-2:]
        bias = mask_values(mask, t_q, t_k)  # (B|1, H|1, Tq, Tk)
        bias = bias.expand(seen.shape[0], *bias.shape[1:]).masked_fill(~seen, 0.0)
        out = {"stats_bias": bias[:n_seqs][:, :, pos]}  # (S, H|1, n, Tk): a copy (advanced indexing)
        if square:
            out["spectrum_bias"] = bias[0, :, :w, :w].clone()  # (H|1, W, W)
        return out

    def _strided(self, x: Tensor) -> Tensor:
        """Up to ``pr_rows`` rows of ``x (B, heads, T, hs)``, evenly spaced over its B*T positions."""
        b, _, t, _ = x.shape
        flat = self._rows(b * t, min(self.pr_rows, b * t), x.device)  # (n,) indices into the B*T rows
        # advanced indices on either side of a slice put the row dim first: (n, heads, hs)
        return x[flat // t, :, flat % t].flatten(-2)  # (n, heads*hs): heads side by side

    def _strided_rows(self, valid: Tensor, t: int) -> Tensor:
        """Which of :meth:`_strided`'s rows are real tokens, from ``valid (B, T)``."""
        b = valid.shape[0]
        flat = self._rows(b * t, min(self.pr_rows, b * t), valid.device)
        return valid.reshape(-1)[flat].to(torch.float32)

    def _rows(self, t: int, n: int, device: torch.device) -> Tensor:
        """Evenly spaced row positions, made once per (length, device): no host-to-device copy per report."""
        key = (t, n, str(device))
        if key not in self._positions:
            self._positions[key] = torch.unique(torch.linspace(0, t - 1, n).round().long()).to(device)
        return self._positions[key]


def _scoring(scoring: Scoring | None) -> Inputs:
    """The model's scale and soft-cap as 0-d tensors (stacked per layer by the worker thread); none: defaults."""
    out: Inputs = {}
    if scoring is not None and scoring.scale is not None:
        out["scale"] = torch.tensor(float(scoring.scale), dtype=torch.float64)
    if scoring is not None and scoring.softcap is not None:
        out["softcap"] = torch.tensor(float(scoring.softcap), dtype=torch.float64)
    return out


def _own_key(seen: Tensor) -> Tensor:
    """``(B, T_q)``: whether each query sees its own key (aligned as the causal mask aligns them):
    False for padding. All True when there are more queries than keys (no own key to ask about)."""
    t_q, t_k = seen.shape[-2:]
    if t_q > t_k:
        return torch.ones(seen.shape[0], t_q, dtype=torch.bool, device=seen.device)
    return seen[:, 0].diagonal(offset=t_k - t_q, dim1=-2, dim2=-1)  # (B, Tq)
