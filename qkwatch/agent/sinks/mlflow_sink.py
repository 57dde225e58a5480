"""The MLflow sink: qkwatch's layers in the MLflow run a team already watches, or in one of its own.

    with mlflow.start_run():
        qkwatch.attach(model, project="p", run="r1", sinks=["mlflow"])   # the active run
    qkwatch.attach(model, url=None, sinks=[MlflowSink(tracking_uri="sqlite:///mlflow.db")])

**Which run.** The run id given, else the run active on the thread that makes the sink (MLflow's
active run is the calling thread's, and the sink logs from its worker thread, so it is read at
construction), else a new run that the sink creates when it opens: experiment ``experiment`` (default:
the qkwatch project, created if missing), run name the qkwatch run. Everything goes through one
``MlflowClient`` with the tracking URI given, or MLflow's when the sink was made
(``mlflow.set_tracking_uri``, ``MLFLOW_TRACKING_URI``). The sink ends only a run it created.

**Values.** ``qkwatch/<metric>/layer_07`` and ``qkwatch/<scalar>`` (``qkwatch.agent.sinks.base``),
each a ``Metric`` at the report's own step (the optimizer's; MLflow takes steps in any order) and
time, sent with ``log_batch`` in batches of at most 1000 metrics (MLflow's limit per call): a report
with per-layer values sends what waits with it; scalar-only reports (a loss at every step) wait for
the next one, for 1000 values, or for ``flush_seconds``. MLflow's run page makes a section of each
name's part before its last ``/``: one section ``qkwatch/qkai`` with a chart per layer, and the
heatmap's image chart beside them.

**Heatmap.** ``log_image(key="qkwatch/<metric>/heatmap", step=...)``, MLflow's time-stepped image
(needs Pillow; without it, the artifact): or ``heatmap="artifact"``, the PNG as
``qkwatch/heatmaps/<metric>.png``, replaced each time (each picture spans the run from its first report).

**Alerts.** MLflow has no alert: the run's tag ``qkwatch.alert.<rule>`` says the latest state
(``firing at step 120: ...`` or ``resolved at step 180: ...``) and the artifact
``qkwatch/alerts.json`` lists every alert so far.

**A tracker that fails.** MLflow's client retries a failing request itself
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``..._BACKOFF_FACTOR``, ``..._TIMEOUT``). A call that still
fails raises (the worker warns once) and the sink leaves MLflow alone for ``retry_seconds``: the
calls in between raise at once without a request, so the worker keeps up and closes in time.
What was not sent is in the collector and the spool.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from qkwatch.agent.sinks.base import PREFIX, RunInfo, SinkAlert, SinkReport
from qkwatch.agent.sinks.png import has_pillow, heatmap_png, heatmap_rgb
from qkwatch.contract.names import rank_suffix

logger = logging.getLogger(__name__)

BATCH = 1000
"""Most metrics in one ``log_batch`` call (MLflow's ``MAX_METRICS_PER_BATCH``)."""
TAG_MAX = 5000
"""Longest tag value sent (MLflow takes 5000 characters at least, 8000 in recent versions)."""


def import_mlflow() -> Any:
    """The ``mlflow`` module, or an ImportError that names the extra."""
    try:
        import mlflow
    except ImportError as exc:
        raise ImportError(f"the mlflow sink needs mlflow: pip install 'qkwatch[mlflow]' ({exc})") from exc
    return mlflow


class MlflowUnavailable(RuntimeError):
    """A call within ``retry_seconds`` of a failure: not sent, MLflow not asked."""


class MlflowSink:
    """Sends every report to an MLflow run; see the module's docstring."""

    name = "mlflow"

    def __init__(
        self,
        run_id: str | None = None,
        *,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        heatmap: Literal["image", "artifact"] = "image",
        flush_seconds: float = 5.0,
        retry_seconds: float = 300.0,
    ):
        """
        Args:
            run_id: the MLflow run to log to (never ended by the sink); None: the active run of the
                calling thread, else a new run.
            tracking_uri: where (default: MLflow's tracking URI when the sink is made).
            experiment: a new run's experiment name (default: the qkwatch project).
            run_name: a new run's name (default: the qkwatch run; ``<run>-rank<r>`` on ranks after 0).
            heatmap: ``image`` (``log_image`` with a step; needs Pillow, else ``artifact``) or ``artifact``.
            flush_seconds: longest a scalar-only report's values wait for a batch.
            retry_seconds: after a failed call, how long the sink leaves MLflow alone.
        """
        if heatmap not in ("image", "artifact"):
            raise ValueError(f"heatmap must be 'image' or 'artifact', got {heatmap!r}")
        if not (flush_seconds >= 0 and retry_seconds >= 0):
            raise ValueError(f"flush_seconds and retry_seconds must be >= 0, got {flush_seconds}, {retry_seconds}")
        mlflow = import_mlflow()
        self.tracking_uri: str = tracking_uri or mlflow.get_tracking_uri()
        if run_id is None:
            active = mlflow.active_run()  # this thread's: the worker thread has none
            run_id = active.info.run_id if active is not None else None
        self.run_id: str | None = run_id
        self.owned = False
        """Whether the sink created the run (and so ends it on close)."""
        self.experiment = experiment
        self.run_name = run_name
        self.heatmap_kind = heatmap
        self.flush_seconds = flush_seconds
        self.retry_seconds = retry_seconds
        self.client: Any = None
        self.n_layers = 0
        self.alerts: list[dict[str, Any]] = []
        self._pending: list[Any] = []  # mlflow.entities.Metric
        self._pending_since = 0.0
        self._down_until = 0.0
        self._started = False
        self._suffix = ""
        self._info: RunInfo | None = None

    # --- the Sink protocol (the sinks' worker thread) ----------------------------------------------

    def open(self, run: RunInfo) -> None:
        """The client, and the run: the one given or active, or a new one."""
        from mlflow import MlflowClient

        self._info = run
        self.n_layers = run.n_layers
        self._suffix = rank_suffix(run.rank, run.world)
        if self.heatmap_kind == "image" and not has_pillow():
            logger.warning("qkwatch: the mlflow sink logs heatmaps as artifacts: log_image needs Pillow")
            self.heatmap_kind = "artifact"
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self._guarded()

    def write(self, report: SinkReport) -> None:
        """The report's values wait in the batch; a report with per-layer values sends the batch."""
        from mlflow.entities import Metric

        self._check_up()
        ms = int(report.time * 1000)
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending += [Metric(k, v, ms, report.step) for k, v in report.flat(self.n_layers).items()]
        due = time.monotonic() - self._pending_since >= self.flush_seconds
        if report.layers or len(self._pending) >= BATCH or due:
            self._guarded(self._flush)

    def heatmap(self, metric: str, steps: list[int], layers: list[list[float | None]], step: int) -> None:
        """The picture: a time-stepped image ``qkwatch/<metric>/heatmap``, or the artifact."""
        self._guarded(self._picture, metric, layers, step)

    def alert(self, alert: SinkAlert) -> None:
        """The tag ``qkwatch.alert.<rule>`` and the artifact ``qkwatch/alerts.json``."""
        state = "firing" if alert.firing else "resolved"
        self.alerts.append(
            {
                "rule": alert.rule,
                "state": state,
                "step": alert.step,
                "severity": alert.severity,
                "metric": alert.metric,
                "layers": list(alert.layers),
                "onset_step": alert.onset_step,
                "title": alert.title,
                "text": alert.text,
            }
        )
        value = f"{state} at step {alert.step}: {alert.title}\n{alert.text}"[:TAG_MAX]
        self._guarded(self._tag_alert, f"{PREFIX}.alert.{alert.rule}", value)

    def close(self) -> None:
        """Send what waits; end the run if the sink created it."""
        try:
            if self._pending:
                self._guarded(self._flush)
        finally:
            self._pending = []
            if self.owned:
                self.owned = False
                self._guarded(self.client.set_terminated, self.run_id, "FINISHED")

    # --- the calls to MLflow -----------------------------------------------------------------------

    def _guarded(self, call: Callable[..., Any] | None = None, *args: Any) -> None:
        """``call(*args)`` (the run started first), unless MLflow failed less than ``retry_seconds``
        ago; a failure starts that wait."""
        self._check_up()
        try:
            if not self._started:
                self._start()
                self._started = True
            if call is not None:
                call(*args)
        except Exception:
            self._down_until = time.monotonic() + self.retry_seconds
            raise

    def _check_up(self) -> None:
        """Raise (and drop what waits) within ``retry_seconds`` of a failure."""
        if time.monotonic() < self._down_until:
            self._pending = []
            raise MlflowUnavailable(f"MLflow at {self.tracking_uri} failed less than {self.retry_seconds:g} s ago")

    def _start(self) -> None:
        """Tag the run (create it first when there is none) and write ``qkwatch/run.json``."""
        from mlflow.entities import RunTag

        assert self._info is not None
        info = self._info
        tags = {f"{PREFIX}.project": info.project, f"{PREFIX}.run": info.run, f"{PREFIX}.rank": str(info.rank)}
        if self.run_id is None:
            experiment_id = self._experiment_id(self.experiment or info.project)
            created = self.client.create_run(experiment_id, run_name=self.run_name or info.label, tags=tags)
            self.run_id, self.owned = created.info.run_id, True
        else:
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)
        described = {"project": info.project, "run": info.run, "rank": info.rank, "world": info.world}
        text = json.dumps({**described, "n_layers": info.n_layers, "config": info.config}, default=str, indent=1)
        self.client.log_text(self.run_id, text, f"{PREFIX}/run.json")

    def _experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except Exception:  # another rank created it between the two calls
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []  # a batch that fails is not sent again (the spool has it)
        for i in range(0, len(pending), BATCH):
            self.client.log_batch(self.run_id, metrics=pending[i : i + BATCH], synchronous=True)

    def _picture(self, metric: str, layers: list[list[float | None]], step: int) -> None:
        if self.heatmap_kind == "image":
            image = heatmap_rgb(metric, layers)
            key = f"{PREFIX}/{metric}/heatmap{self._suffix}"
            self.client.log_image(self.run_id, image, key=key, step=step, synchronous=True)
            return
        with tempfile.TemporaryDirectory(prefix="qkwatch-heatmap-") as tmp:
            path = Path(tmp) / f"{metric}{self._suffix}.png"
            path.write_bytes(heatmap_png(metric, layers))
            self.client.log_artifact(self.run_id, str(path), f"{PREFIX}/heatmaps")

    def _tag_alert(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value, synchronous=True)
        self.client.log_text(self.run_id, json.dumps(self.alerts, indent=1), f"{PREFIX}/alerts.json")
