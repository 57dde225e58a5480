"""``qkwatch report``: a run's diagnostics as one self-contained HTML file, read from a collector.

The file inlines plotly.js once and embeds its data, so it opens from disk with no network (attach it
to an incident, mail it, keep it after the collector's retention deleted the run). It holds the band
heatmaps (QKAI on the live page's colour scale, which breaks at the collapse threshold; stable rank,
attention entropy, lambda), QKAI per layer over steps, the latest QKAI per layer, the loss, the alerts
(one still firing when its run ended reads "run ended while firing", with the run's last step and its
last values, never "resolved"), the lambdas with their override audit trail, the config, the status,
and the run's tags and notes in its summary. Given a second run (``--vs``) every figure shows both
runs, side by side on the same colour scale and step range.

Only the collector's REST API is read, through :class:`qkwatch.client.rest.Client`; or, with no
collector, a run's spool on disk (``qkwatch report --spool DIR``: :func:`write_spool_report`, the
data built in ``monitor.report_spool``). The runs are read in ``monitor.report_data``, drawn in
``monitor.report_figures`` and laid out in ``monitor.report_html`` (its table cells in
``monitor.report_cells``); this module puts them together.
"""

from __future__ import annotations

from pathlib import Path

from qkwatch.client.report_data import ReportError, endpoint, explain, fetch_run, resolve_run
from qkwatch.client.report_html import render
from qkwatch.client.report_spool import source_text, spool_run_data
from qkwatch.client.rest import Client, CollectorError
from qkwatch.contract.offline_reports import SpoolError, read_reports
from qkwatch.contract.thresholds import Thresholds


def write_report(
    run: str, out: Path, *, vs: str | None = None, url: str | None = None, token: str | None = None
) -> Path:
    """Read ``run`` (and ``vs``) from the collector and write the report to ``out``.

    Args:
        run: a run id or ``project/name``.
        out: the HTML file to write.
        vs: a second run to compare with, or None.
        url: the collector's URL (default: ``QKWATCH_URL``).
        token: a read token (default: ``QKWATCH_TOKEN``).

    Returns:
        ``out``.

    Raises:
        ReportError: no URL, an unknown run, a refused token, an unreachable collector.
    """
    url, token = endpoint(url, token)
    with Client(url, token=token) as client:
        try:
            threshold = client.collapse_threshold()
            runs = [fetch_run(client, resolve_run(client, ref)) for ref in (run, vs) if ref]
        except CollectorError as exc:
            raise ReportError(explain(exc, url, token)) from exc
    out = Path(out)
    out.write_text(render(runs, threshold=threshold, source=url), encoding="utf-8")
    return out


def write_spool_report(spool_dir: str | Path, out: str | Path) -> Path:
    """Read a run's reports from its spool (no collector) and write the same report to ``out``.

    Alerts are the collector's (its rules run at ingest), so this report has none; the threshold is
    this machine's (``QKWATCH_COLLAPSE_THRESHOLD`` or the default).

    Args:
        spool_dir: a rank's spool folder, or the run's folder above its ranks' (see
            :func:`qkwatch.contract.offline_reports.read_reports`).
        out: the HTML file to write.

    Returns:
        ``out``.

    Raises:
        ReportError: not a spool (named), or a folder holding several runs.
    """
    try:
        spool = read_reports(spool_dir)
        threshold = Thresholds.from_env().collapse
    except (SpoolError, ValueError) as exc:
        raise ReportError(str(exc)) from exc
    out = Path(out)
    out.write_text(render([spool_run_data(spool)], threshold=threshold, source=source_text(Path(spool_dir), spool)))
    return out
