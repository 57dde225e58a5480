"""Red team, exports (issue 34): a CSV export is safe to open in a spreadsheet, and its download name
is a header, not an injection.

A cell a spreadsheet would run starts with ``=``, ``+``, ``@`` or ``-``: the export's cells are the
attempt, step, layer and head (integers), the metric (a name of ``[A-Za-z_][A-Za-z0-9_.:/-]``, checked
at ingest) and the value (a number, or ``nan``, ``inf``, ``-inf``, which spreadsheets show as an
error value, never run). Nothing a user typed reaches a cell. The run's name reaches the
``Content-Disposition`` header only quoted and percent-encoded.
"""

from __future__ import annotations

import csv
import io
import math
import uuid

from tests.monitor.conftest import Harness, report


def test_no_csv_cell_is_a_formula_and_the_file_name_is_quoted(h: Harness) -> None:
    name = '=cmd|"/c calc"!A0;+x@y'.replace(" ", "_").replace("/", "_")
    r = h.client.post("/v1/runs", json={"project": h.project, "name": name, "config": {}}, headers=h.headers("ingest"))
    assert r.status_code == 200, r.text
    run = r.json()
    values = {"qkai": [0.5, -0.25, "-inf", "nan"], "loss": [-1e308, 1e-300, "inf", 3.0]}
    body = {"batch_id": str(uuid.uuid4()), "reports": [report(s, {"qkai": [values["qkai"][s]]}) for s in range(4)]}
    for s in range(4):
        body["reports"][s]["scalars"] = {"loss": values["loss"][s]}
    assert h.client.post(f"/v1/runs/{run['id']}/reports", json=body, headers=h.headers("ingest")).status_code == 200
    got = h.client.get(f"/v1/runs/{run['id']}/export", headers=h.headers("read"))
    rows = list(csv.reader(io.StringIO(got.text)))
    assert rows[0] == ["attempt", "step", "metric", "layer", "head", "value"] and len(rows) == 9
    for row in rows[1:]:
        for cell in row:
            assert not cell.startswith(("=", "+", "@")), row
            if cell.startswith("-"):
                assert cell == "-inf" or math.isfinite(float(cell)), row  # a number, or an error value
    disposition = got.headers["content-disposition"]
    assert "\r" not in disposition and "\n" not in disposition and '"cmd' not in disposition
    assert disposition.startswith('attachment; filename="=cmd|_c_calc!A0;+x@y.csv"; filename*=UTF-8')
