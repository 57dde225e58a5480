"""The TensorBoard sink: every report as event files that ``tensorboard --logdir`` shows.

* Each value is a scalar at the report's step (a ``simple_value``, as ``add_scalar`` writes it; a
  report's values in one event), named as the catalogue names it: ``qkwatch/qkai/layer_07`` for a
  layer's value, ``qkwatch/loss`` for a run-level one.
* A custom-scalars layout (TensorBoard's "Custom Scalars" tab) has one category, ``qkwatch``, with
  one multi-line chart per per-layer metric, drawing every layer (``qkwatch/<metric>/layer_.*``),
  the catalogue's primary metrics first. It is written with the first report that has per-layer
  values, and again, whole, when a report brings a metric it did not chart yet (TensorBoard reads
  a run's newest layout).
* Each heatmap is an image (the "Images" tab) under ``qkwatch/heatmap/<metric>``, drawn by
  :mod:`qkwatch.agent.sinks.png` and written as TensorBoard's image summary.
* Each alert that begins firing or resolves is text (the "Text" tab) under ``qkwatch/alerts``.

With several ranks the tags of the heatmaps and the alerts end in ``_rank<r>`` (each rank draws and
judges only its own layers); the per-layer scalars need no suffix, as each layer is one rank's.

By default the event files go to ``runs/<project>/<run>`` (relative to the working directory),
every rank into the same directory (each rank writes its own file, and TensorBoard shows them as
one run); or give ``logdir``, or a ``SummaryWriter`` of your own (``writer=``), which is flushed at
close but not closed.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkwatch.agent.sinks.base import PREFIX, RunInfo, SinkAlert, SinkReport
from qkwatch.agent.sinks.png import heatmap_rgb, png_bytes
from qkwatch.contract.metrics import CATALOGUE, layer_metrics
from qkwatch.contract.names import rank_suffix

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

INSTALL = "pip install 'qkwatch[tensorboard]'"
CHUNK = 64
"""Values per event: a report's scalars go in events of this many, the GIL let go between them."""
LAYOUT_CATEGORY = PREFIX
"""The custom-scalars layout's one category."""


def tensorboard_installed() -> bool:
    """Whether the tensorboard package is there (looked up, not imported: that waits for the sinks' thread)."""
    return importlib.util.find_spec("tensorboard") is not None


def default_logdir(run: RunInfo) -> Path:
    """``runs/<project>/<run>``, relative to the working directory."""
    return Path("runs") / run.project / run.run


class TensorBoardSink:
    """Writes reports as TensorBoard event files (see the module's docstring)."""

    name = "tensorboard"

    def __init__(
        self,
        logdir: str | os.PathLike[str] | None = None,
        *,
        writer: SummaryWriter | None = None,
        flush_secs: int = 30,
    ):
        """
        Args:
            logdir: where the event files go; default ``runs/<project>/<run>``.
            writer: a ``torch.utils.tensorboard.SummaryWriter`` to write with instead (flushed at
                close, never closed: it is yours).
            flush_secs: how often a writer this sink makes flushes to disk.

        Raises:
            ImportError: tensorboard is not installed (``pip install 'qkwatch[tensorboard]'``).
        """
        if writer is None and not tensorboard_installed():
            raise ImportError(f"the tensorboard sink needs the tensorboard package: {INSTALL}", name="tensorboard")
        self.logdir = Path(logdir) if logdir is not None else None
        self.flush_secs = flush_secs
        self._writer = writer
        self._owned = writer is None
        self._n_layers = 0
        self._suffix = ""
        self._charted: list[str] = []

    @property
    def writer(self) -> SummaryWriter | None:
        """The writer, once the sink is open."""
        return self._writer

    def open(self, run: RunInfo) -> None:
        self._n_layers = run.n_layers
        self._suffix = rank_suffix(run.rank, run.world)
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # here: on the sinks' thread, not at attach

            self.logdir = self.logdir or default_logdir(run)
            self._writer = SummaryWriter(log_dir=str(self.logdir), flush_secs=self.flush_secs)

    def write(self, report: SinkReport) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary  # type: ignore[import-untyped]

        # one event for the whole report (what add_scalar writes per value, a simple_value each): one
        # record, one checksum and one hand-over to the writer's thread instead of one per value
        flat = list(report.flat(self._n_layers).items())
        for start in range(0, len(flat), CHUNK):  # a pause for the GIL between pieces (see the worker)
            values = [Summary.Value(tag=tag, simple_value=value) for tag, value in flat[start : start + CHUNK]]
            self._add_summary(Summary(value=values), report.step, report.time)
            time.sleep(0)
        new = [m for m in report.layers if m not in self._charted]
        if new:
            self._charted = _chart_order([*self._charted, *new])
            self._add_summary(_layout(self._charted), report.step)

    def heatmap(self, metric: str, steps: list[int], layers: list[list[float | None]], step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        rgb = heatmap_rgb(metric, layers)
        height, width, _ = rgb.shape
        image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png_bytes(rgb))
        tag = f"{PREFIX}/heatmap/{metric}{self._suffix}"
        self._add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)

    def alert(self, alert: SinkAlert) -> None:
        text = f"**{alert.title}**\n\n" + "  \n".join(alert.text.splitlines())
        self._open_writer().add_text(f"{PREFIX}/alerts{self._suffix}", text, global_step=alert.step)

    def close(self) -> None:
        if self._writer is None:
            return
        self._writer.flush()
        if self._owned:
            self._writer.close()

    def _open_writer(self) -> SummaryWriter:
        if self._writer is None:
            raise RuntimeError("the tensorboard sink was not opened")
        return self._writer

    def _add_summary(self, summary: Any, step: int, walltime: float | None = None) -> None:
        """A summary proto at ``step`` (the scalars of a report in one event; the layout and the images:
        torch's helpers for them need a step 0 or Pillow)."""
        self._open_writer()._get_file_writer().add_summary(summary, step, walltime)  # type: ignore[no-untyped-call]


def _chart_order(metrics: list[str]) -> list[str]:
    """The catalogue's per-layer metrics in its order (primary first), then any other name as it came."""
    known = [m.name for m in layer_metrics() if m.name in metrics]
    return known + [m for m in metrics if m not in known]


def _layout(metrics: list[str]) -> Any:
    """The custom-scalars layout: one multi-line chart per metric over every layer's tag."""
    from torch.utils.tensorboard.summary import custom_scalars

    charts = {}
    for metric in metrics:
        entry = CATALOGUE.get(metric)
        title = f"{entry.display} ({metric})" if entry is not None else metric
        charts[title] = ["Multiline", [f"{PREFIX}/{metric}/layer_.*"]]
    return custom_scalars({LAYOUT_CATEGORY: charts})  # type: ignore[no-untyped-call]
