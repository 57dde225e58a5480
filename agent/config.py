"""The agent's settings: explicit argument, then environment variable, then default, then validate."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

ENV = {
    "url": "QKWATCH_URL",
    "token": "QKWATCH_TOKEN",
    "project": "QKWATCH_PROJECT",
    "run": "QKWATCH_RUN",
    "spool": "QKWATCH_SPOOL",
    "every": "QKWATCH_EVERY",
}
NAME = re.compile(r"^[^\s/\x00-\x1f\x7f]{1,200}$")


@dataclass
class AgentConfig:
    url: str | None = None
    """Collector base URL (``QKWATCH_URL``); None works offline: everything stays in the spool."""
    token: str | None = None
    """Bearer token with the ``ingest`` scope (and ``read`` for lambdas) (``QKWATCH_TOKEN``)."""
    project: str = "default"
    """Project of the run (``QKWATCH_PROJECT``)."""
    run: str | None = None
    """Run name (``QKWATCH_RUN``); the same project+name resumes a run. Default: generated."""
    spool: str = ".qkwatch/spool"
    """Spool root (``QKWATCH_SPOOL``); each run and rank writes under ``<spool>/<project>/<run>/rank-<r>``."""
    every: int = 50
    """Report cadence in steps: activation metrics on steps divisible by it (``QKWATCH_EVERY``)."""
    weight_every: int | None = None
    """Cadence of the weight metrics (QKAI, stable rank, ...); default ``every``."""
    spectra_every: int | None = None
    """Cadence of the projection SVDs (norms, ``wk_erank``); default 10 x ``weight_every``; 0 = never."""
    sample_rows: int = 64
    """Query rows per layer for the attention row statistics, spread over ``sample_seqs`` sequences
    (``qk_erank`` takes this many from the first sequence)."""
    sample_seqs: int = 4
    """Sequences of the micro-batch the row statistics average over (at most the batch). One
    sequence makes the entropy the schedule reads swing with what that sequence is (prose, code, a
    synthetic task): on the trained collapse_cpu model, over 40 batches, one sequence gives a
    healthy layer's entropy a standard deviation of 0.04-0.07 (jumps of up to 0.38 between two
    batches), four give 0.025-0.038 with 16 rows each and 0.023-0.030 with 64: the noise is in
    the sequence, not the row, so the rows are spread and the cost stays that of 64 rows."""
    spectrum_window: int = 256
    """W: ``attn_srank`` and ``attn_gap1`` are those of the attention matrix of the first W tokens
    of one sequence (``W x W`` per head; causal, it is exactly the leading block of the full one)."""
    pr_rows: int = 4096
    """Rows (positions of the whole micro-batch, evenly strided) for ``pr_q`` and ``pr_k``; at least
    2. Few rows bias the participation ratio low: isotropic width 256 reads about 50 from 64 rows,
    241 from 4,096."""
    heads: bool = False
    """Also ship per-head values of the per-head metrics."""
    lambda_sync_every: int = 10
    """Steps between lambda exchanges (all ranks switch to new lambdas at the same step)."""
    lambda_poll_seconds: float = 5.0
    """How often rank 0 asks the collector for lambdas, in the background."""
    lambda_stale_seconds: float = 120.0
    """Collector lambdas older than this fall back to the local schedule."""
    batch_max_reports: int = 64
    """Reports per POST at most."""
    flush_seconds: float = 0.5
    """The sender wakes at least this often when reports wait."""
    request_timeout: float = 10.0
    """Seconds for one HTTP request (connect: at most 3)."""
    backoff_base: float = 0.5
    """First retry delay ceiling in seconds (full jitter, doubling)."""
    backoff_cap: float = 30.0
    """Largest retry delay in seconds."""
    spool_max_bytes: int = 256 * 2**20
    """Undelivered spool kept at most (bytes); beyond, the oldest segments are dropped and counted."""
    spool_max_age_seconds: float = 7 * 24 * 3600.0
    """Undelivered spool segments older than this are dropped and counted."""
    segment_bytes: int = 4 * 2**20
    """Spool segment size before rotation."""
    distributed: bool | None = None
    """Share layers and lambdas over the ranks of ``torch.distributed`` (default: when it is
    initialised with more than one rank); False makes this agent see only its own process."""
    config: dict[str, Any] = field(default_factory=dict)
    """The run's config sent to the collector (recipe, model shape, ``schedule`` parameters)."""

    def __post_init__(self) -> None:
        if self.url is not None and not re.match(r"^https?://[^\s]+$", self.url):
            raise ValueError(f"url must be an http(s) URL, got {self.url!r}")
        for key in ("project", "run"):
            value = getattr(self, key)
            if value is not None and not NAME.match(value):
                raise ValueError(f"{key} must be 1-200 characters without whitespace or '/', got {value!r}")
        for key in (
            "every",
            "sample_rows",
            "sample_seqs",
            "spectrum_window",
            "lambda_sync_every",
            "batch_max_reports",
            "segment_bytes",
            "spool_max_bytes",
        ):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        if not isinstance(self.pr_rows, int) or self.pr_rows < 2:
            raise ValueError(f"pr_rows must be an integer >= 2, got {self.pr_rows!r}")
        for key in ("weight_every", "spectra_every"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{key} must be an integer >= 0 (0 = never), got {value!r}")
        for key in (
            "lambda_poll_seconds",
            "lambda_stale_seconds",
            "flush_seconds",
            "request_timeout",
            "backoff_base",
            "backoff_cap",
            "spool_max_age_seconds",
        ):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{key} must be a positive number of seconds, got {value!r}")
        if self.weight_every is None:
            self.weight_every = self.every
        if self.spectra_every is None:
            self.spectra_every = 10 * self.weight_every

    @classmethod
    def resolve(cls, **explicit: Any) -> AgentConfig:
        """Settings from explicit arguments (None = not given), then the environment, then defaults.

        Raises:
            ValueError: naming the setting, for an unknown setting or an invalid value (an
                environment value says which variable it came from).
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(explicit) - known)
        if unknown:
            raise ValueError(f"unknown agent setting {unknown[0]!r} (known: {', '.join(sorted(known))})")
        values = {k: v for k, v in explicit.items() if v is not None}
        for key, var in ENV.items():
            if key in values or not os.environ.get(var):
                continue
            raw = os.environ[var]
            if key == "every":
                try:
                    values[key] = int(raw)
                except ValueError:
                    raise ValueError(f"{var}={raw!r}: every must be a positive integer") from None
            else:
                values[key] = raw
        return cls(**values)
