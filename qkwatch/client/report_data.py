"""The data of ``qkwatch report``: the runs as read from a collector's REST API, one :class:`RunData` each.

Only the REST API is read, through :class:`qkwatch.client.rest.Client`; a metric the run never
reported is drawn empty, and each problem the user has to fix is a :class:`ReportError` that says what
to do.
"""

from __future__ import annotations

import os

from qkwatch.client.report_figures import Json, RunData, finite
from qkwatch.client.rest import Client, CollectorError
from qkwatch.contract import metrics as catalogue

MAX_STEPS = 1000  # heatmap columns per run; more steps are bucketed by max, as on the live page
MAX_POINTS = 2000  # loss points per run


class ReportError(Exception):
    """Something the user has to fix: no collector URL, an unknown run, a missing or refused token."""


def endpoint(url: str | None = None, token: str | None = None) -> tuple[str, str | None]:
    """The collector's URL and token: the arguments, else ``QKWATCH_URL`` and ``QKWATCH_TOKEN``.

    Raises:
        ReportError: no URL either way (a token is optional: an ``--open`` collector needs none).
    """
    url = url or os.environ.get("QKWATCH_URL") or None
    token = token or os.environ.get("QKWATCH_TOKEN") or None
    if not url:
        raise ReportError("no collector URL: pass --url URL or set QKWATCH_URL")
    return url, token


def resolve_run(client: Client, ref: str) -> Json:
    """The run ``ref`` names (a run id, or ``project/name``), as the collector sent it."""
    if "/" in ref:
        project, name = ref.split("/", 1)
        found = client.runs(project=project, name=name, limit=1).data
        if found:
            return found[0].raw
    else:
        try:
            return client.run(ref).raw
        except CollectorError as exc:
            if exc.status != 404:
                raise
    raise ReportError(
        f"no run {ref!r} on the collector (give a run id or project/name; `qkwatch runs list` lists them)"
    )


def fetch_run(client: Client, run: Json) -> RunData:
    rid = run["id"]
    # The collector answers 404 for a metric the run never reported (a vanilla run has no lambda),
    # so ask only for those it has; the others are drawn empty.
    have = client.metrics(rid).metrics
    heatmaps = {
        m: client.heatmap(rid, m, max_steps=MAX_STEPS).raw if m in have else _empty_heatmap(m)
        for m in catalogue.primary_layer_metrics()
    }
    loss, val_loss = (
        client.series(rid, m, max_points=MAX_POINTS).raw if m in have else _empty_series(m)
        for m in ("loss", "val_loss")
    )
    return RunData(
        run=run,
        heatmaps=heatmaps,
        latest=latest_values(client, rid, heatmaps["qkai"]),
        loss=loss,
        val_loss=val_loss,
        alerts=client.alerts(run=rid)["data"],
        lambdas=client.lambdas(rid).raw,
        audit=client.lambdas_audit(rid)["data"],
    )


def _empty_heatmap(metric: str) -> Json:
    return {
        "metric": metric,
        "agg": "max",
        "attempt": None,
        "downsampled": False,
        "steps": [],
        "layers": [],
        "values": [],
    }


def _empty_series(metric: str) -> Json:
    return {
        "metric": metric,
        "layer": -1,
        "head": -1,
        "attempt": None,
        "downsampled": False,
        "steps": [],
        "values": [],
        "min": [],
        "max": [],
    }


def latest_values(client: Client, run_id: str, h: Json) -> dict[int, tuple[float, int]]:
    """Each layer's last finite value; a downsampled heatmap's last bucket is its max, so it is re-read unbucketed."""
    values = _last_values(h)
    if h["downsampled"] and h["steps"]:
        values.update(_last_values(client.heatmap(run_id, h["metric"], start=h["steps"][-1], max_steps=20_000).raw))
    return values


def _last_values(h: Json) -> dict[int, tuple[float, int]]:
    out: dict[int, tuple[float, int]] = {}
    for j, layer in enumerate(h["layers"]):
        for step, row in zip(reversed(h["steps"]), reversed(h["values"]), strict=True):
            v = finite(row[j])
            if v is not None:
                out[layer] = (v, step)
                break
    return out


def explain(exc: CollectorError, url: str, token: str | None) -> str:
    """What to tell the user about an error answer (status 0: the collector was not reached)."""
    if exc.status == 0:
        return exc.message
    if exc.status == 401:
        return (
            f"the collector at {url} refused the token (401: {exc.message})"
            if token
            else f"the collector at {url} wants a read token: pass --token TOKEN or set QKWATCH_TOKEN"
        )
    return f"collector at {url}: {exc}"
