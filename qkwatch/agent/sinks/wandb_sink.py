"""The W&B sink: qkwatch's layers in the W&B run a team already watches, or in one of its own.

    qkwatch.attach(model, project="p", run="r1", sinks=["wandb"])   # wandb.run if there is one, else a new run
    qkwatch.attach(model, url=None, sinks=[WandbSink(mode="offline", dir="wandb-runs")])

**Which run.** The run given, else ``wandb.run`` when the sink opens (on the sinks' worker
thread: ``wandb.run`` is the process's, not a thread's), else a new one (``wandb.init`` with the
qkwatch project and run as W&B's project and name, ``mode`` and ``dir`` as given; ``WANDB_MODE``
and the other ``WANDB_*`` variables as W&B reads them). The sink finishes only a run it started.

**Steps.** Every report is one ``run.log`` row that carries ``qkwatch/step``, the optimizer's step,
and ``define_metric("qkwatch/*", step_metric="qkwatch/step")`` makes it the x axis of every
qkwatch chart. The sink never passes ``step=`` to ``run.log``: W&B drops a row whose step is below
its current one ("Steps must be monotonically increasing"), and a worker thread that lags behind
the training loop, or a user whose own ``wandb.log`` calls advance the step, would lose rows that
way. Each row does advance W&B's own row counter (``_step``) by one; a training loop that passes
``step=`` to its own ``wandb.log`` must therefore give qkwatch a run of its own (docs/integrations.md).

**Names and panels.** ``qkwatch/<metric>/layer_07`` and ``qkwatch/<scalar>``
(``qkwatch.agent.sinks.base``). W&B's workspace makes a panel section of the first segment (one
section ``qkwatch``, one line panel per name) or, set to group by every segment, one section per
metric with a panel per layer. So that each metric is one panel with every layer in it, at each
heatmap the sink also logs ``qkwatch/<metric>/layers``, a ``wandb.plot.line_series`` chart of every
layer over the run's report steps (the heatmap's columns), and ``qkwatch/<metric>/heatmap``, the
layer x step picture: a ``wandb.Image`` (needs Pillow; without it, the table) or a ``wandb.Table``
of ``(layer, step, value)`` rows.

**Alerts.** ``run.alert`` (W&B's alert: e-mail or Slack as the team set it up; recorded in an
offline run too) at level WARN (ERROR for a critical rule) when a rule begins firing and INFO when
it resolves; the run's summary keeps ``qkwatch/alerts/<rule>`` (the latest) and the run gets the
tag ``qkwatch:<rule>`` the first time the rule fires.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Literal

from qkwatch.agent.sinks.base import PREFIX, RunInfo, SinkAlert, SinkReport, layer_tag, scalar_tag
from qkwatch.agent.sinks.png import has_pillow, heatmap_rgb
from qkwatch.contract.names import rank_suffix

logger = logging.getLogger(__name__)

STEP = scalar_tag("step")
"""The x axis of every qkwatch chart: the optimizer's step, logged in every row."""
TITLE_MAX = 63
"""``run.alert``'s title must be shorter than 64 characters."""
LEVELS = {"warning": "WARN", "critical": "ERROR"}
"""A rule's severity -> the level of its firing alert (a resolved one is INFO)."""


def import_wandb() -> Any:
    """The ``wandb`` module, or an ImportError that names the extra."""
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(f"the wandb sink needs wandb: pip install 'qkwatch[wandb]' ({exc})") from exc
    return wandb


class WandbSink:
    """Sends every report to a W&B run; see the module's docstring."""

    name = "wandb"

    def __init__(
        self,
        run: Any = None,
        *,
        project: str | None = None,
        name: str | None = None,
        mode: Literal["online", "offline", "disabled", "shared"] | None = None,
        dir: str | None = None,
        entity: str | None = None,
        heatmap: Literal["image", "table"] = "image",
        layer_charts: bool = True,
        init: Mapping[str, Any] | None = None,
    ):
        """
        Args:
            run: the W&B run to log to (never finished by the sink); None: ``wandb.run`` when the
                sink opens, else a new run.
            project: a new run's W&B project (default: the qkwatch project).
            name: a new run's name (default: the qkwatch run; ``<run>-rank<r>`` on ranks after 0).
            mode: a new run's mode (``online``, ``offline``, ...; default: W&B's, ``WANDB_MODE``).
            dir: where a new run writes its files (default: W&B's, ``WANDB_DIR``).
            entity: a new run's entity (default: W&B's).
            heatmap: ``image`` (a ``wandb.Image``; needs Pillow, else ``table``) or ``table``.
            layer_charts: at each heatmap, also log each metric's layers as one line-series chart.
            init: more keywords for ``wandb.init`` (``group``, ``tags``, ``settings``, ...).
        """
        if heatmap not in ("image", "table"):
            raise ValueError(f"heatmap must be 'image' or 'table', got {heatmap!r}")
        self.wandb = import_wandb()
        self.given = run
        self.project = project
        self.run_name = name
        self.mode = mode
        self.dir = dir
        self.entity = entity
        self.heatmap_kind = heatmap
        self.layer_charts = layer_charts
        self.init_kwargs = dict(init or {})
        self.run: Any = None
        """The run being logged to, once open."""
        self.owned = False
        """Whether the sink started that run (and so finishes it on close)."""
        self.n_layers = 0
        self.suffix = ""
        """After the heatmaps' names on a rank of several (``_rank1``): the ranks' layers differ."""

    # --- the Sink protocol (the sinks' worker thread) ----------------------------------------------

    def open(self, run: RunInfo) -> None:
        """Find or start the run, and make ``qkwatch/step`` the x axis of every qkwatch name."""
        self.n_layers = run.n_layers
        self.suffix = rank_suffix(run.rank, run.world)
        if self.heatmap_kind == "image" and not has_pillow():
            logger.warning("qkwatch: the wandb sink draws heatmaps as tables: wandb.Image needs Pillow")
            self.heatmap_kind = "table"
        target = self.given if self.given is not None else self.wandb.run
        if target is None:
            kwargs: dict[str, Any] = {
                "project": self.project or run.project,
                "name": self.run_name or run.label,
                "mode": self.mode,
                "dir": self.dir,
                "entity": self.entity,
                **self.init_kwargs,
            }
            kwargs["config"] = {**(kwargs.get("config") or {}), PREFIX: _config(run)}
            target = self.wandb.init(**kwargs)
            self.owned = True
        else:
            target.config.update({PREFIX: _config(run)}, allow_val_change=True)
        self.run = target
        target.define_metric(STEP, hidden=True)
        target.define_metric(f"{PREFIX}/*", step_metric=STEP)

    def write(self, report: SinkReport) -> None:
        """One row: every value of the report and ``qkwatch/step``."""
        row: dict[str, Any] = report.flat(self.n_layers)
        row[STEP] = report.step
        self._open_run().log(row)

    def heatmap(self, metric: str, steps: list[int], layers: list[list[float | None]], step: int) -> None:
        """``qkwatch/<metric>/heatmap`` and (``layer_charts``) ``qkwatch/<metric>/layers``, in one row at ``step``."""
        run = self._open_run()
        row: dict[str, Any] = {
            STEP: step,
            f"{PREFIX}/{metric}/heatmap{self.suffix}": self._picture(metric, steps, layers),
        }
        if self.layer_charts:
            chart = self._line_series(metric, steps, layers)
            if chart is not None:
                row[f"{PREFIX}/{metric}/layers{self.suffix}"] = chart
        run.log(row)

    def alert(self, alert: SinkAlert) -> None:
        """``run.alert``, the summary's ``qkwatch/alerts/<rule>`` and (firing) the tag ``qkwatch:<rule>``."""
        run = self._open_run()
        level = LEVELS.get(alert.severity, "WARN") if alert.firing else "INFO"
        run.alert(title=_title(alert.title), text=alert.text, level=level)
        state = "firing" if alert.firing else "resolved"
        run.summary[f"{PREFIX}/alerts/{alert.rule}"] = f"{state} at step {alert.step}: {alert.title}"
        tag = f"{PREFIX}:{alert.rule}"
        tags = tuple(run.tags or ())
        if alert.firing and tag not in tags:
            run.tags = (*tags, tag)

    def close(self) -> None:
        """Finish the run if the sink started it; a run it was given, or found, is left running."""
        run, self.run = self.run, None
        if run is not None and self.owned:
            self.owned = False
            run.finish()

    # --- the pictures ------------------------------------------------------------------------------

    def _picture(self, metric: str, steps: list[int], layers: list[list[float | None]]) -> Any:
        if self.heatmap_kind == "image":
            caption = f"{metric}: layer 0 at the top, steps {steps[0]}..{steps[-1]} left to right" if steps else metric
            return self.wandb.Image(heatmap_rgb(metric, layers), mode="RGB", caption=caption)
        rows = [
            [i, s, v] for i, values in enumerate(layers) for s, v in zip(steps, values, strict=True) if v is not None
        ]
        return self.wandb.Table(columns=["layer", "step", metric], data=rows)

    def _line_series(self, metric: str, steps: list[int], layers: list[list[float | None]]) -> Any:
        """Every layer this rank measured as one line of one chart (None when it measured none)."""
        xs, ys, keys = [], [], []
        for i, values in enumerate(layers):
            points = [(s, v) for s, v in zip(steps, values, strict=True) if v is not None and math.isfinite(v)]
            if points:
                xs.append([s for s, _ in points])
                ys.append([v for _, v in points])
                keys.append(layer_tag(metric, i, self.n_layers).rsplit("/", 1)[1])
        if not keys:
            return None
        return self.wandb.plot.line_series(
            xs=xs, ys=ys, keys=keys, title=f"{PREFIX} {metric}: every layer", xname="step"
        )

    def _open_run(self) -> Any:
        if self.run is None:
            raise RuntimeError("the wandb sink has no run (it did not open, or is closed)")
        return self.run


def _config(run: RunInfo) -> dict[str, Any]:
    """What the run's W&B config says of qkwatch (under the key ``qkwatch``)."""
    return {"project": run.project, "run": run.run, "rank": run.rank, "world": run.world, "config": run.config}


def _title(title: str) -> str:
    return title if len(title) <= TITLE_MAX else title[: TITLE_MAX - 3] + "..."
