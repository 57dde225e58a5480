"""One layer's series under each points key, and from the frames: what migration 0011 traded.

Raw ``sqlite3`` (no qkwatch code), one run of ``--steps`` steps x ``--layers`` layers x 2 metrics:

* ``points`` keyed (run, metric, head, layer, step, attempt), the key before 0011;
* ``points`` keyed (run, metric, head, step, layer, attempt), the key since 0011;
* ``frames`` (one float64 array per step and metric), the layer's 8 bytes cut out in SQL, as
  ``monitor.store.values.reads._series_from_frames`` reads them.

Each query is run 3 times; the best is kept. Usage::

    .venv/bin/python -m bench.layer_series        # 100,000 steps x 48 layers, about 2 minutes
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import struct
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

LAYER = 17


def best_ms(fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def points_db(path: Path, key: str, steps: int, layers: int) -> sqlite3.Connection:
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE points (run_pk INT, metric_id INT, head INT, layer INT, step BIGINT, attempt INT, value FLOAT, "
        f"PRIMARY KEY (run_pk, metric_id, head, {key}, attempt)) WITHOUT ROWID"
    )
    rows = ((1, m, -1, la, s, 1, random.random()) for s in range(steps) for m in (1, 2) for la in range(layers))
    db.executemany("INSERT INTO points VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    db.commit()
    return db


def frames_db(path: Path, steps: int, layers: int) -> sqlite3.Connection:
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE frames (run_pk INT, metric_id INT, step BIGINT, attempt INT, mask TEXT, vals BLOB, "
        "present BLOB, has_nan BOOL, PRIMARY KEY (run_pk, metric_id, step, attempt, mask)) WITHOUT ROWID"
    )
    rows = (
        (1, m, s, 1, f"a{layers}", array("d", (random.random() for _ in range(layers))).tobytes(), None, False)
        for s in range(steps)
        for m in (1, 2)
    )
    db.executemany("INSERT INTO frames VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    db.commit()
    return db


def point_reads(db: sqlite3.Connection, where: str, width: int) -> tuple[float, float, float]:
    """(count-min-max, every value, buckets) ms of one layer's points, as the points' read did."""
    count = best_ms(lambda: db.execute(f"SELECT count(*), min(step), max(step) FROM points WHERE {where}").fetchall())
    every = best_ms(lambda: db.execute(f"SELECT step, value FROM points WHERE {where} ORDER BY step").fetchall())
    buckets = best_ms(
        lambda: db.execute(
            f"SELECT step / {width} AS b, min(step), sum(value), min(value), max(value), count(value) "
            f"FROM points WHERE {where} GROUP BY b ORDER BY b"
        ).fetchall()
    )
    return count, every, buckets


def frame_read(db: sqlite3.Connection, layer: int) -> float:
    unpack = struct.Struct("d").unpack
    q = (
        f"SELECT step, substr(vals, {8 * layer + 1}, 8), substr(present, {layer + 1}, 1) FROM frames "
        "WHERE run_pk = 1 AND metric_id = 1 ORDER BY step, attempt, mask"
    )
    return best_ms(lambda: [(s, unpack(v8)[0]) for s, v8, _ in db.execute(q)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--layers", type=int, default=48)
    args = p.parse_args()
    layer = min(LAYER, args.layers - 1)
    where = f"run_pk = 1 AND metric_id = 1 AND head = -1 AND layer = {layer}"
    width = max(1, args.steps // 1000)
    print(f"layer {layer} of a {args.steps:,}-step x {args.layers}-layer run (2 metrics), best of 3, ms")
    print("| read | count, min, max | every value | 1,000 buckets |")
    print("|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, key in (
            ("points, key (.., layer, step, ..)", "layer, step"),
            ("points, key (.., step, layer, ..)", "step, layer"),
        ):
            db = points_db(Path(tmp) / f"{key.replace(', ', '_')}.db", key, args.steps, args.layers)
            count, every, buckets = point_reads(db, where, width)
            print(f"| {label} | {count:.0f} | {every:.0f} | {buckets:.0f} |")
            db.close()
        db = frames_db(Path(tmp) / "frames.db", args.steps, args.layers)
        print(f"| frames, the layer's 8 bytes cut out in SQL | - | {frame_read(db, layer):.0f} | - |")
        db.close()


if __name__ == "__main__":
    main()
