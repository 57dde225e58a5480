"""The collector's REST paths, once: the routers declare them, the agent's transport and the client call them.

Each route is one template whose run segment is ``{run_id}`` (the path parameter the route functions
take, and the name in the OpenAPI schema); :func:`path` fills it. Also the text an ended alert reads
as, shared by ``qkwatch report``, ``qkwatch alerts`` and the live page (through ``/ui/config.json``).
"""

from __future__ import annotations

from urllib.parse import quote

PREFIX = "/v1"
"""Every route of the API is under it."""

RUNS = f"{PREFIX}/runs"
"""``POST``: create (or resume) a run; ``GET``: list runs."""
RUN = f"{RUNS}/{{run_id}}"
"""``GET``, ``PATCH`` (status, tags, notes), ``DELETE`` one run."""
EVENTS = f"{RUN}/events"
METRICS = f"{RUN}/metrics"
REPORTS = f"{RUN}/reports"
"""``POST``: ingest a batch of reports (run ids only)."""
SERIES = f"{RUN}/series"
HEATMAP = f"{RUN}/heatmap"
HISTORY = f"{RUN}/history"
EXPORT = f"{RUN}/export"
LAMBDAS = f"{RUN}/lambdas"
"""``GET``: the run's lambdas (run ids only); so are the two below."""
LAMBDA_OVERRIDES = f"{LAMBDAS}/overrides"
LAMBDA_AUDIT = f"{LAMBDAS}/audit"
COMPARE = f"{PREFIX}/compare"
ALERTS = f"{PREFIX}/alerts"

ROUTES = (
    RUNS,
    RUN,
    EVENTS,
    METRICS,
    REPORTS,
    SERIES,
    HEATMAP,
    HISTORY,
    EXPORT,
    LAMBDAS,
    LAMBDA_OVERRIDES,
    LAMBDA_AUDIT,
    COMPARE,
    ALERTS,
)
"""Every route template; the collector serves exactly these under :data:`PREFIX`."""


def path(template: str, run: str, *, quoted: bool = True) -> str:
    """``template`` with its run filled in; ``project/name`` travels with its slash encoded (``%2F``)
    when ``quoted`` (the client), a run id as it is when not (the agent's transport)."""
    return template.format(run_id=quote(run, safe="") if quoted else run)


ALERT_STATE_TEXT = {"ended": "run ended while firing"}
"""How an alert's state reads where it differs from its name: an ended alert is never shown as resolved."""
