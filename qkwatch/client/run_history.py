"""A stored run as the backtests need it: its reports' per-layer values, its training loss and its
held-out loss, read from a collector over REST (:func:`read`) or built by hand (:class:`RunHistory`).

``qkwatch alerts backtest`` (:mod:`qkwatch.client.backtest`), ``qkwatch demo --natural`` and the
experiments that score detectors across many runs read runs through it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qkwatch.rules.transitions import ReportValues

if TYPE_CHECKING:
    from qkwatch.client.rest import Client, Run

SCALAR_LAYER = -1
"""The layer of a run-level scalar (``loss``) in a history answer."""


@dataclass(frozen=True)
class RunHistory:
    """What a backtest needs of one run: its reports' per-layer values and its training loss."""

    run: str
    """How the run is named in results (``project/name``)."""
    reports: Sequence[ReportValues]
    """The per-layer values of each report, in any order (they are replayed in (attempt, step) order)."""
    loss_steps: Sequence[int] = ()
    """Ascending steps of the logged training loss."""
    losses: Sequence[float] = ()
    """The loss at each of ``loss_steps``, NaN and infinities as logged; empty when none was logged."""
    val_losses: Sequence[float] = ()
    """The held-out loss (``val_loss``) in step order; empty when none was logged."""

    @classmethod
    def from_columns(
        cls, run: str, columns: Mapping[str, Sequence[Any]], attempt: int = 1, loss: str = "loss"
    ) -> RunHistory:
        """From one ``Client.history(..., frame=False)`` answer: a run of one attempt, or one attempt of a run."""
        steps, losses = scalar(columns, loss)
        return cls(run, layer_reports(columns, attempt), steps, losses)


def layer_reports(columns: Mapping[str, Sequence[Any]], attempt: int = 1) -> list[ReportValues]:
    """History columns (``step``, ``layer``, one per metric; None: not measured) -> one report per step.

    A report holds each metric measured on some layer at its step, as a list over layers 0..the
    highest measured, None where a layer was not measured: the shape the ingest gives the rules.
    Run-level scalars (layer -1) are not part of it, as they are not at ingest.
    """
    names = [k for k in columns if k not in ("step", "layer")]
    by_step: dict[int, dict[str, list[float | None]]] = {}
    for i, (step, layer) in enumerate(zip(columns["step"], columns["layer"], strict=True)):
        if layer < 0:
            continue
        for name in names:
            value = columns[name][i]
            if value is None:
                continue
            row = by_step.setdefault(int(step), {}).setdefault(name, [])
            row.extend([None] * (layer + 1 - len(row)))
            row[layer] = float(value)
    return [ReportValues(attempt, step, values) for step, values in sorted(by_step.items())]


def scalar(columns: Mapping[str, Sequence[Any]], name: str) -> tuple[list[int], list[float]]:
    """A run-level scalar of history columns as (steps, values) where it was measured; empty when absent."""
    if name not in columns:
        return [], []
    rows = [
        (int(s), float(v))
        for s, la, v in zip(columns["step"], columns["layer"], columns[name], strict=True)
        if la == SCALAR_LAYER and v is not None
    ]
    return [s for s, _ in rows], [v for _, v in rows]


def read(client: Client, run: str | Run, loss: str = "loss") -> RunHistory:
    """Read a run from a collector: every per-layer metric of each attempt, and the merged ``loss``.

    One ``history`` call per attempt (and one for the loss); an answer the collector finds too
    large (422) is read again in two halves of its step range, until each fits.

    Raises:
        CollectorError: unreachable collector, unknown run (404 naming it), refused token.
    """
    found = client.run(run)
    have = client.metrics(found.id).metrics
    per_layer = sorted(name for name, layers in have.items() if any(la >= 0 for la in layers))
    reports: list[ReportValues] = []
    if per_layer:
        for attempt in range(1, found.latest_attempt + 1):
            for columns in _columns(client, found, per_layer, attempt):
                reports += layer_reports(columns, attempt)
    steps: list[int] = []
    losses: list[float] = []
    if SCALAR_LAYER in have.get(loss, ()):
        for columns in _columns(client, found, [loss], None):
            more_steps, more_losses = scalar(columns, loss)
            steps += more_steps
            losses += more_losses
    val: list[float] = []
    if SCALAR_LAYER in have.get(VAL_LOSS, ()):
        for columns in _columns(client, found, [VAL_LOSS], None):
            val += scalar(columns, VAL_LOSS)[1]
    return RunHistory(found.ref, reports, steps, losses, val)


VAL_LOSS = "val_loss"
"""The run-level scalar of the held-out loss (the degraded outcome's final loss)."""


def _columns(
    client: Client, run: Run, metrics: list[str], attempt: int | None, start: int = 0, end: int | None = None
) -> list[dict[str, Any]]:
    """History columns of steps ``start..end`` (inclusive; None: no upper bound), as one answer or, when
    that is refused as too large, as several over halves of the range (split at the run's last step)."""
    from qkwatch.client.rest import CollectorError

    try:
        return [client.history(run.id, metrics, start=start, end=end, attempt=attempt, frame=False)]
    except CollectorError as exc:
        top = run.last_step if end is None else end
        if exc.status != 422 or top is None or top <= start:
            raise
    mid = (start + top) // 2
    return _columns(client, run, metrics, attempt, start, mid) + _columns(client, run, metrics, attempt, mid + 1, end)
