"""The checks and figures of one fleet session: points sent against stored, alerts once, lambdas from
every replica, latency, rates, the kill's timeline, CPU time and bytes on disk; :func:`problems` lists
what went wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections import Counter, defaultdict
from typing import Any

import httpx
import sqlalchemy as sa

from bench.fleet.config import (
    ACTIVATION_METRICS,
    SPECTRA_METRICS,
    WEIGHT_METRICS,
    FleetConfig,
)
from bench.fleet.values import expected_alerts
from qkwatch.launch import CollectorProcess


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p99 and max in milliseconds (None when there are no values)."""
    if not values:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None, "n": 0}
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=100, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 99
    return {"p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3, "max_ms": ordered[-1] * 1e3, "n": len(ordered)}


def summarize(
    cfg: FleetConfig,
    names: list[str],
    results: dict[str, Any],
    outcome: dict[str, Any],
    engine: sa.Engine,
    replicas: list[CollectorProcess],
    reader: str,
    before: dict[str, dict[str, str]],
    after: dict[str, dict[str, str]],
) -> dict[str, Any]:
    seen = results["seen"]
    t0, end = outcome["t0"], outcome["end"]
    with engine.connect() as conn:
        stored = _stored(conn)
        alerts = _alerts(conn)
        sizes = _sizes(conn)
        run_ids = dict(conn.execute(sa.text("SELECT name, id FROM runs")).all())
        statuses = dict(conn.execute(sa.text("SELECT name, status FROM runs")).all())
    points = _points(results["ranks"], stored)
    lambdas = _lambdas(cfg, results["ranks"], replicas, reader, run_ids, seen["lambdas"] + outcome["sampled"])
    rest_alerts = _rest_alerts(replicas, reader)
    want = expected_alerts(names)
    got = Counter((a["run"], a["rule"], tuple(a["layers"])) for a in alerts)
    last_ack = max((t for t, _n, _d in seen["inserted"]), default=end)
    kill = {
        k: (v - t0 if isinstance(v, float) else v)
        for k, v in outcome.items()
        if k.endswith("_at") and k != "stats_at_restart"
    }
    victim = f"r{cfg.replicas - 1}"
    served_after = (
        int(after[victim]["stot"]) - int(outcome["stats_at_restart"][victim]["stot"])
        if "stats_at_restart" in outcome
        else None
    )
    return {
        "config": dataclasses.asdict(cfg),
        "runs": len(names),
        "points": points,
        "alerts": {
            "expected": len(want),
            "raised": sum(got.values()),
            "missing": sorted(map(list, want - set(got))),
            "unexpected": sorted(map(list, set(got) - want)),
            "more_than_once": sorted([[*k, n] for k, n in got.items() if n > 1]),
            "notifications_firing_per_alert": sorted({a["firing_notifications"] for a in alerts}),
            "states": dict(Counter(a["state"] for a in alerts)),
            "rest_equal_on_every_replica": all(x == rest_alerts[0] for x in rest_alerts),
            "rest_count": [len(x) for x in rest_alerts],
        },
        "lambdas": lambdas,
        "latency": {
            "post": percentiles([d for _t, d in seen["posts"]]),
            "post_outside_kill": percentiles([d for t, d in seen["posts"] if not _in_kill_window(t, outcome)]),
            "delivery": percentiles(seen["delivery"]),
            "other": {
                call: percentiles([d for c, d in seen["other"] if c == call])
                for call in sorted({c for c, _d in seen["other"]})
            },
        },
        "posts": {
            "ok": len(seen["posts"]),
            "failed": dict(results["failures"]),
            "replayed_points": sum(d for _t, _n, d in seen["inserted"]),
        },
        "rates": {
            "offered_points_per_s": _offered(cfg),
            "sent_points_per_s": points["sent"] / (results["load_end"] - t0),
            "stored_points_per_s": points["stored"] / (last_ack - t0),
            "points_per_post": sum(n + d for _t, n, d in seen["inserted"]) / max(1, len(seen["inserted"])),
            "drain_s": last_ack - results["load_end"],
            "producer_lag_max_s": results["lag_max"],
        },
        "kill": {
            **kill,
            "replica": victim,
            "requests_served_after_restart": served_after,
            "probe_after_the_load": outcome["probe"],
            "haproxy_chkdown": {n: int(r["chkdown"] or 0) for n, r in after.items()},
            "haproxy_requests": {n: int(r["stot"] or 0) - int(before[n]["stot"] or 0) for n, r in after.items()},
            "sampler_failures": outcome["sample_failures"],
        },
        "cpu": {
            **outcome["cpu_s"],
            "points_per_collector_cpu_s": points["stored"] / max(outcome["cpu_s"]["collector"], 1e-9),
            "points_per_database_cpu_s": points["stored"] / max(outcome["cpu_s"]["database"], 1e-9),
        },
        "statuses": dict(Counter(statuses.values())),
        "sizes": sizes,
    }


def _in_kill_window(t: float, outcome: dict[str, Any]) -> bool:
    """From the kill until 10 s after HAProxy saw the replica up again."""
    start = outcome.get("killed_at")
    return start is not None and start <= t <= (outcome.get("seen_up_at") or start) + 10.0


def _offered(cfg: FleetConfig) -> float:
    """Points per second the ranks send: owned layers x metrics per report, scalars, and rank 0's losses."""
    per_layer = len(WEIGHT_METRICS) + len(ACTIVATION_METRICS) + len(SPECTRA_METRICS) / cfg.spectra_every
    layer_points = cfg.layers * per_layer  # over the ranks of one run
    scalars = (
        7 * cfg.ranks_per_run + 2
    )  # each rank's agent_* (with agent_dropped_total), rank 0's lambda_source/version
    per_run = (layer_points + scalars) / (cfg.report_every * cfg.step_seconds) + 1 / cfg.step_seconds  # + the loss
    return per_run * cfg.runs


def _stored(conn: sa.Connection) -> dict[str, dict[str, float]]:
    rows = conn.execute(
        sa.text(
            "SELECT r.name, count(*), sum(p.value), count(DISTINCT (p.metric_id, p.head, p.layer, p.step, p.attempt)) "
            "FROM points p JOIN runs r ON r.pk = p.run_pk GROUP BY r.name"
        )
    ).all()
    frames = dict(
        conn.execute(
            sa.text("SELECT r.name, count(*) FROM frames f JOIN runs r ON r.pk = f.run_pk GROUP BY r.name")
        ).all()
    )
    return {
        name: {"points": n, "sum": float(total or 0.0), "distinct": distinct, "frames": frames.get(name, 0)}
        for name, n, total, distinct in rows
    }


def _points(ranks: list[dict[str, Any]], stored: dict[str, dict[str, float]]) -> dict[str, Any]:
    sent: dict[str, dict[str, float]] = defaultdict(lambda: {"points": 0, "sum": 0.0, "frames": 0})
    for r in ranks:
        sent[r["run"]]["points"] += r["points"]
        sent[r["run"]]["sum"] += r["value_sum"]
        sent[r["run"]]["frames"] += r["frames"]
    lost = sum(max(0, s["points"] - stored.get(run, {}).get("points", 0)) for run, s in sent.items())
    extra = sum(max(0, st["points"] - sent.get(run, {}).get("points", 0)) for run, st in stored.items())
    sums_differ = [
        run
        for run, s in sent.items()
        if not math.isclose(s["sum"], stored.get(run, {}).get("sum", 0.0), rel_tol=1e-9, abs_tol=1e-6)
    ]
    return {
        "sent": sum(s["points"] for s in sent.values()),
        "stored": sum(st["points"] for st in stored.values()),
        "lost": lost,
        "duplicated": extra + sum(st["points"] - st["distinct"] for st in stored.values()),
        "runs_whose_value_sums_differ": sums_differ,
        "frames_sent": sum(s["frames"] for s in sent.values()),
        "frames_stored": sum(st["frames"] for st in stored.values()),
        "pending_bytes_left": sum(r["pending_bytes"] for r in ranks),
        "dead_lettered": sum(r["dead_lettered"] for r in ranks),
        "agent_retries": sum(r["retried"] for r in ranks),
    }


def _alerts(conn: sa.Connection) -> list[dict[str, Any]]:
    rows = conn.execute(
        sa.text(
            "SELECT r.name, a.id, a.rule, a.layers, a.state, "
            "(SELECT count(*) FROM alert_notifications n WHERE n.alert_id = a.id AND n.status = 'firing') "
            "FROM alerts a JOIN runs r ON r.pk = a.run_pk ORDER BY a.id"
        )
    ).all()
    return [
        {"run": n, "id": i, "rule": rule, "layers": json.loads(layers), "state": state, "firing_notifications": f}
        for n, i, rule, layers, state, f in rows
    ]


def _rest_alerts(replicas: list[CollectorProcess], token: str) -> list[list[tuple[Any, ...]]]:
    """``GET /v1/alerts`` from every replica directly: (id, run, rule, layers, state, onset) of each."""
    out = []
    for replica in replicas:
        with replica.client(token) as c:
            out.append(sorted((a.id, a.run_name, a.rule, tuple(a.layers), a.state, a.onset_step) for a in c.alerts()))
    return out


def _lambdas(
    cfg: FleetConfig,
    ranks: list[dict[str, Any]],
    replicas: list[CollectorProcess],
    token: str,
    run_ids: dict[str, str],
    observed: list[tuple[str, int, list[Any], str]],
) -> dict[str, Any]:
    """Every replica's lambdas of every run, read directly, against each other and against the EMA of what was sent."""
    from qkwatch.contract.scheduling import ScheduleConfig, entropy_floor

    h: dict[str, dict[int, float]] = defaultdict(dict)
    for r in ranks:
        h[r["run"]].update({int(k): v for k, v in r["h"].items()})
    differ, wrong = [], []
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(headers=headers, timeout=30) as http:
        for name, run_id in sorted(run_ids.items()):
            answers = [http.get(f"{r.url}/v1/runs/{run_id}/lambdas").raise_for_status().json() for r in replicas]
            if any(a != answers[0] for a in answers):
                differ.append(name)
            schedule = ScheduleConfig(**answers[0]["schedule"])
            expect = entropy_floor([h[name].get(layer) for layer in range(cfg.layers)], schedule)
            served = answers[0]["lambdas"]
            if len(served) != len(expect) or not all(
                math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) for a, b in zip(served, expect, strict=True)
            ):
                wrong.append(name)
    by_version: dict[tuple[str, int], set[str]] = defaultdict(set)
    for run_id, version, values, _who in observed:
        by_version[(run_id, version)].add(json.dumps(values))
    split = sorted(f"{run}@{version}" for (run, version), v in by_version.items() if len(v) > 1)
    return {
        "runs_whose_replicas_differ": differ,
        "runs_not_the_ema_of_what_was_sent": wrong,
        "answers_observed": len(observed),
        "versions_observed": len(by_version),
        "versions_with_two_answers": split,
    }


def _sizes(conn: sa.Connection) -> dict[str, Any]:
    """Bytes on disk per table (heap, indexes, TOAST) and per row, after the session."""
    conn.execute(sa.text("ANALYZE"))
    rows = conn.execute(
        sa.text(
            "SELECT c.relname, pg_total_relation_size(c.oid), pg_relation_size(c.oid) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND c.relkind = 'r'"
        )
    ).all()
    tables = {}
    for name, total, heap in rows:
        count = conn.execute(sa.text(f'SELECT count(*) FROM "{name}"')).scalar_one()
        tables[name] = {
            "rows": count,
            "bytes": total,
            "heap_bytes": heap,
            "bytes_per_row": total / count if count else None,
        }
    points = tables["points"]["rows"] or 1
    database = conn.execute(sa.text("SELECT pg_database_size(current_database())")).scalar_one()
    return {
        "tables": tables,
        "database_bytes": database,
        "all_tables_bytes_per_point": sum(t["bytes"] for t in tables.values()) / points,
    }


def problems(result: dict[str, Any]) -> list[str]:
    """What the session got wrong (empty: nothing lost or doubled, alerts once, lambdas agree)."""
    out = []
    p, a, la = result["points"], result["alerts"], result["lambdas"]
    if p["lost"] or p["duplicated"] or p["sent"] != p["stored"]:
        out.append(f"points: sent {p['sent']}, stored {p['stored']}, lost {p['lost']}, duplicated {p['duplicated']}")
    if p["runs_whose_value_sums_differ"]:
        out.append(f"points: stored values differ from those sent in {p['runs_whose_value_sums_differ']}")
    if p["frames_sent"] != p["frames_stored"]:
        out.append(f"frames: sent {p['frames_sent']}, stored {p['frames_stored']}")
    if p["pending_bytes_left"] or p["dead_lettered"]:
        out.append(f"spools: {p['pending_bytes_left']} bytes undelivered, {p['dead_lettered']} reports dead-lettered")
    if a["missing"] or a["unexpected"] or a["more_than_once"]:
        out.append(
            f"alerts: missing {a['missing']}, unexpected {a['unexpected']}, more than once {a['more_than_once']}"
        )
    if a["notifications_firing_per_alert"] not in ([], [1]):
        out.append(f"alerts: firing notifications per alert {a['notifications_firing_per_alert']}")
    if result["statuses"] == {"finished": result["runs"]} and a["states"] not in ({}, {"ended": a["raised"]}):
        out.append(f"alerts: every run finished while its alerts fired, yet their states are {a['states']}")
    if not a["rest_equal_on_every_replica"]:
        out.append("alerts: the replicas' GET /v1/alerts differ")
    if la["runs_whose_replicas_differ"] or la["runs_not_the_ema_of_what_was_sent"] or la["versions_with_two_answers"]:
        out.append(f"lambdas: {la}")
    return out
