"""Issue 21, M2 (the /metrics half): what one run can put on ``GET /metrics`` is bounded.

The red team's run named its scalars ``agent_queue_depth_rank0`` ... ``rank19999`` and got 20,000
series (1.5 MB, 6.6 s a scrape). Now ranks stop at ``metrics_max_ranks``, a run exports at most
``metrics_max_series_per_run`` layer and scalar series, and whatever is left out is counted in
``qkwatch_run_series_dropped``. The scrape shows only the token's project, so these tests share
the session's database.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from qkwatch.monitor.exposition import agent_rank
from tests.monitor.conftest import report


def scrape(h) -> dict[str, list]:
    text = h.client.get("/metrics", headers=h.headers("read")).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def dropped(m: dict[str, list], run: str) -> float:
    (value,) = [s.value for s in m["qkwatch_run_series_dropped"] if s.labels["run"] == run]
    return value


def test_ranks_at_or_above_the_cap_are_left_out_and_counted(make_harness):
    h = make_harness(metrics_max_ranks=4)
    run = h.create_run("many-ranks")
    scalars = {f"agent_queue_depth_rank{r}": float(r) for r in range(40)}
    h.send(run["id"], [report(1, scalars={**scalars, "agent_sent_total_rank2": 5.0, "loss": 2.0})])
    m = scrape(h)
    depth = {s.labels["rank"]: s.value for s in m["qkwatch_agent_queue_depth"]}
    assert depth == {"0": 0.0, "1": 1.0, "2": 2.0, "3": 3.0}
    assert [s.value for s in m["qkwatch_agent_sent"] if s.name.endswith("_total")] == [5.0]
    assert [s.value for s in m["qkwatch_train_loss"]] == [2.0]
    assert dropped(m, "many-ranks") == 36


def test_a_rank_the_agent_never_writes_is_counted_not_exported(make_harness):
    h = make_harness()
    run = h.create_run("odd-ranks")
    odd = {"agent_queue_depth_rank007": 1.0, "agent_queue_depth_rankx": 2.0, "agent_queue_depth_rank1234567890": 3.0}
    h.send(run["id"], [report(1, scalars={**odd, "agent_queue_depth_rank7": 4.0})])
    m = scrape(h)
    assert [(s.labels["rank"], s.value) for s in m["qkwatch_agent_queue_depth"]] == [("7", 4.0)]
    assert dropped(m, "odd-ranks") == 3


def test_agent_rank_reads_only_ranks_as_the_agent_writes_them():
    assert agent_rank("agent_dropped_total_rank3") == ("agent_dropped_total", 3)
    assert agent_rank("agent_dropped_total") == ("agent_dropped_total", 0)
    assert agent_rank("loss") == ("loss", 0)
    for odd in ("agent_dropped_total_rank03", "agent_dropped_total_rank", "agent_dropped_total_rank1e3"):
        assert agent_rank(odd) == ("agent_dropped_total", -1), odd


def test_a_run_exports_at_most_its_series_cap_layers_first(make_harness):
    h = make_harness(metrics_max_series_per_run=10, collapse_threshold=0.7)
    run = h.create_run("wide")
    qkai = [0.1, 0.1, 0.1, 0.1, 0.1, 0.9, 0.9, 0.9]  # the band is in layers the cap leaves out
    h.send(
        run["id"],
        [
            report(
                3,
                {"qkai": qkai, "stable_rank": [2.0] * 8},
                scalars={"loss": 1.5, "agent_queue_depth_rank0": 0.0, "agent_queue_depth_rank1": 1.0},
            )
        ],
    )
    m = scrape(h)
    assert [s.value for s in m["qkwatch_train_loss"]] == [1.5]  # the run-level scalars come first
    assert sorted(int(s.labels["layer"]) for s in m["qkwatch_qkai_ratio"]) == [0, 1, 2, 3, 4]
    assert sorted(int(s.labels["layer"]) for s in m["qkwatch_stable_rank"]) == [0, 1, 2, 3]
    assert m["qkwatch_agent_queue_depth"] == []
    assert dropped(m, "wide") == 1 + 16 + 2 - 10
    # The run's own gauges still see every layer the snapshot holds.
    assert [s.value for s in m["qkwatch_collapse_band_layers"]] == [3]
    assert [s.value for s in m["qkwatch_collapsed_layers"]] == [3]


def test_nothing_dropped_is_zero_for_every_run(make_harness):
    h = make_harness()
    for name in ("a", "b"):
        run = h.create_run(name)
        h.send(run["id"], [report(1, {"qkai": [0.2, 0.3]}, scalars={"agent_sent_total": 4.0})])
    m = scrape(h)
    assert sorted((s.labels["run"], s.value) for s in m["qkwatch_run_series_dropped"]) == [("a", 0.0), ("b", 0.0)]


def test_a_value_of_the_wrong_kind_is_counted_not_exported(make_harness):
    h = make_harness()
    run = h.create_run("mixed-up")
    h.send(run["id"], [report(1, {"loss": [1.0, 2.0], "qkai": [0.3]}, scalars={"qkai": 0.4})])
    m = scrape(h)
    assert m["qkwatch_train_loss"] == []  # the loss per layer is not the run's loss
    assert [(s.labels["layer"], s.value) for s in m["qkwatch_qkai_ratio"]] == [("0", 0.3)]
    assert dropped(m, "mixed-up") == 3
