"""What ``qkwatch demo`` reads back from the collector, as text: a run's progress line and the closing table.

Every figure comes from the collector's API (``qkwatch.client.rest.Client``), not from the
trainings, so the table shows what a user querying the collector would see: the band's QKAI,
entropy and stable rank at the onset of the induced collapse and at the end, the layers RAA's
schedule flagged, the final losses, and the alerts that fired or were still firing when the run ended.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qkwatch.client.rest import Client


def progress_line(client: Client, variant: str, run_id: str, band: list[int]) -> str:
    """One run's part of a progress line: its last step, the band's QKAI (else the highest) and its open alerts."""
    last = client.run(run_id)["last_step"]
    if last is None:
        return f"{variant}: starting"
    h = client.heatmap(run_id, "qkai", start=max(0, last - 500))
    if not h["steps"]:
        return f"{variant}: starting"
    row = h["values"][-1]
    text = (
        f"{variant}: step {h['steps'][-1]:>4}  band QKAI {_mean(row, band):.2f}"
        if band
        else f"{variant}: step {h['steps'][-1]:>4}  QKAI max {max(_finite(row), default=math.nan):.2f}"
    )
    return text + _alert_tag(client, run_id)


def _alert_tag(client: Client, run_id: str) -> str:
    """ "  ALERT rule, ..." for the run's open alerts: firing, or still firing when the run ended (an
    ended run's alerts are not resolved, so the tag stays on the last lines); "" when none is open."""
    firing = {a["rule"] for a in client.alerts(run=run_id, state="firing")["data"]}
    ended = {a["rule"] for a in client.alerts(run=run_id, state="ended")["data"]} - firing
    tags = sorted(firing) + [f"{rule} (run ended while firing)" for rule in sorted(ended)]
    return f"  ALERT {', '.join(tags)}" if tags else ""


# --- the summary ----------------------------------------------------------------------------------


def run_facts(client: Client, run_id: str, band: list[int], onset: int) -> dict[str, Any]:
    """What the demo's table says about one run, every figure read back from the collector.

    ``(at onset, last)`` pairs compare the band at the first report from step ``onset`` on (where
    the induced collapse begins) with the last report; ``*_outside`` is the mean of the other layers.
    """
    facts: dict[str, Any] = {"status": client.run(run_id)["status"]}
    have = client.metrics(run_id).metrics  # the collector answers 404 for a metric the run never reported
    for metric in ("qkai", "attn_entropy", "stable_rank"):
        if metric not in have:
            continue
        h = client.heatmap(run_id, metric, max_steps=20_000)
        if not h["steps"]:
            continue
        outside = [i for i in h["layers"] if i not in band]
        start = next((row for step, row in zip(h["steps"], h["values"], strict=True) if step >= onset), h["values"][0])
        facts[metric] = (_mean(start, band), _mean(h["values"][-1], band))
        facts[f"{metric}_outside"] = _mean(h["values"][-1], outside)
        if metric == "qkai":
            facts["qkai_outside_max"] = max(
                (max(_finite([row[i] for i in outside]), default=math.nan) for row in h["values"]), default=math.nan
            )
            facts["qkai_band_peak"] = max(_mean(row, band) for row in h["values"])
    flagged = "raa_flagged_fraction"  # only RAA runs report it
    values = _finite(client.series(run_id, flagged, max_points=100_000)["values"]) if flagged in have else []
    if values:
        facts["flagged"] = (
            sum(values) / len(values),
            sum(values[len(values) // 2 :]) / len(values[len(values) // 2 :]),
        )
    for name in ("loss", "val_loss"):
        values = _finite(client.series(run_id, name, max_points=100_000)["values"]) if name in have else []
        facts[name] = values[-1] if values else math.nan
    alerts = client.alerts(run=run_id)["data"]
    facts["alerts"] = sorted({a["rule"] for a in alerts})
    facts["open"] = sorted({a["rule"] for a in alerts if a["state"] in ("firing", "ended")})
    return facts


def summary_table(client: Client, runs: dict[str, str], band: list[int], onset: int) -> str:
    """The demo's closing table, one column per run (``runs``: variant -> run id)."""
    facts = {variant: run_facts(client, run_id, band, onset) for variant, run_id in runs.items()}
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        (f"band QKAI, step {onset} -> last", lambda f: _pair(f.get("qkai"))),
        ("band QKAI, highest report", lambda f: _num(f.get("qkai_band_peak"))),
        ("QKAI outside the band, highest", lambda f: _num(f.get("qkai_outside_max"))),
        (f"band entropy, step {onset} -> last", lambda f: _pair(f.get("attn_entropy"))),
        ("entropy outside the band, last", lambda f: _num(f.get("attn_entropy_outside"))),
        (f"band stable rank, step {onset} -> last", lambda f: _pair(f.get("stable_rank"), "{:.1f}")),
        ("layers flagged by RAA (all / 2nd half)", lambda f: _fraction(f.get("flagged"))),
        ("final train loss", lambda f: _num(f.get("loss"), "{:.3f}")),
        ("final validation loss", lambda f: _num(f.get("val_loss"), "{:.3f}")),
        ("alerts that fired", lambda f: ", ".join(f["alerts"]) or "none"),
        ("still firing at the end", lambda f: f"ALERT {', '.join(f['open'])}" if f["open"] else "none"),
        ("status", lambda f: f["status"]),
    ]
    names = list(runs)
    width = max(len(label) for label, _ in rows) + 2
    lines = [
        f"\nthe band is layers {layer_range(band)}; every figure is read back from the collector",
        "".ljust(width) + "".join(n.rjust(18) for n in names),
    ]
    lines += [label.ljust(width) + "".join(cell(facts[n]).rjust(18) for n in names) for label, cell in rows]
    return "\n".join(lines) + "\n"


# --- small helpers --------------------------------------------------------------------------------


def _finite(values: Iterable[object]) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _mean(row: Sequence[object], layers: list[int]) -> float:
    values = _finite([row[i] for i in layers if i < len(row)])
    return sum(values) / len(values) if values else math.nan


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None or not math.isfinite(value) else fmt.format(value)


def _pair(pair: tuple[float, float] | None, fmt: str = "{:.2f}") -> str:
    return "-" if pair is None else f"{_num(pair[0], fmt)} -> {_num(pair[1], fmt)}"


def _fraction(pair: tuple[float, float] | None) -> str:
    return "-" if pair is None else f"{pair[0]:.0%} / {pair[1]:.0%}"


def layer_range(band: list[int]) -> str:
    """The band as text: ``3-5`` for adjacent layers, ``1, 4`` otherwise, ``none`` for no band."""
    if not band:
        return "none"
    return f"{band[0]}-{band[-1]}" if band == list(range(band[0], band[-1] + 1)) else ", ".join(map(str, band))
