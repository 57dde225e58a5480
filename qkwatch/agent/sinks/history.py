"""The layer x step picture of a metric that the sinks' heatmaps draw, bounded however long the run.

The worker keeps one :class:`LayerHistory` per primary per-layer metric of the catalogue
(``qkwatch.contract.metrics.layer_metrics()``, ``primary=True``: QKAI, the stable rank, attention
entropy, the largest logit, RAA's lambda) that this rank's reports carry. A history holds at most
``columns`` report steps, spread evenly over the whole run: it keeps every report until it is full,
then every other one it kept (and from then on one report in two), and so on, doubling its stride
each time, so the picture always spans the run from its first report, at a resolution that halves
as the run grows. The newest report is always the picture's last column.

Pure: no threads, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HEATMAP_COLUMNS = 256
"""Most report steps one heatmap draws."""


@dataclass
class LayerHistory:
    """One metric's values by layer and report step: ``grid()`` is what ``Sink.heatmap`` receives."""

    n_layers: int
    columns: int = HEATMAP_COLUMNS
    stride: int = 1
    """One report in ``stride`` is kept (a power of two)."""
    seen: int = 0
    """Reports of the metric so far."""
    steps: list[int] = field(default_factory=list)
    values: list[dict[int, float]] = field(default_factory=list)
    """Per kept step, the value of each layer measured there."""
    last: tuple[int, dict[int, float]] | None = None
    """The newest report, kept or not."""

    def __post_init__(self) -> None:
        if self.columns < 2:
            raise ValueError(f"columns must be at least 2, got {self.columns}")

    def add(self, step: int, per_layer: dict[int, float]) -> None:
        """One report's values of the metric (layer -> value; the layers it measured)."""
        if self.seen % self.stride == 0:
            self.steps.append(step)
            self.values.append(per_layer)
        self.seen += 1
        self.last = (step, per_layer)
        if len(self.steps) > self.columns:  # full: keep every other column, and one report in twice as many
            self.steps, self.values = self.steps[::2], self.values[::2]
            self.stride *= 2

    def grid(self) -> tuple[list[int], list[list[float | None]]]:
        """``(steps, layers)``: ``layers[i][j]`` is layer i at ``steps[j]``, None where not measured."""
        steps, values = list(self.steps), list(self.values)
        if self.last is not None and (not steps or steps[-1] != self.last[0]):
            steps.append(self.last[0])
            values.append(self.last[1])
        return steps, [[column.get(i) for column in values] for i in range(self.n_layers)]
