"""``qkwatch alerts backtest`` and ``qkwatch.client.backtest``.

Pure: hand-built histories whose firing and outcome steps are known by construction give exact
first firing steps and leads (negative when late), a false alarm on a healthy run, an unknown
outcome without a loss, and the summary over runs.

Parity: the backtest reproduces the live collector's firing steps exactly. Reports are ingested
into a real ``qkwatch serve`` (SQLite and PostgreSQL) through ``POST /v1/runs/{id}/reports``, and
``/v1/alerts`` is read after each batch; the backtest then reads the same run back over REST and
replays it with the same rules (the default ones, and a custom rules file), and every alert the
collector opened, its rule, onset and firing step, must come out of the replay.
"""

from __future__ import annotations

import json
import math
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from qkwatch.cli import main
from qkwatch.client import backtest as bt
from qkwatch.client.backtest_scores import summarize
from qkwatch.client.outcomes import OutcomeRule
from qkwatch.client.rest import Client, CollectorError
from qkwatch.client.run_history import RunHistory, read
from qkwatch.rules.kinds import ThresholdRule
from qkwatch.rules.loss_rules import LossRule
from qkwatch.rules.ruleset import RuleSet
from qkwatch.rules.transitions import ReportValues, evaluate
from tests.conftest import missing_service
from tests.live import LiveCollector
from tests.monitor.conftest import PG_ADMIN_URL, report

HOT, COLD = 0.9, 0.3
"""QKAI well above and well below the collapse threshold."""
RULES = RuleSet.default()
OUTCOME = OutcomeRule(window=1)
"""These histories log their loss at report steps only: unsmoothed, a jump's outcome is its own step
(the default rule's trailing mean of 20 logged losses is checked in test_outcomes.py)."""


def history(
    qkai: dict[int, list[float | None]], losses: dict[int, float] | None = None, attempt: int = 1, run: str = "p/r"
) -> RunHistory:
    reports = [ReportValues(attempt, step, {"qkai": row}) for step, row in qkai.items()]
    losses = losses or {}
    return RunHistory(run, reports, list(losses), list(losses.values()))


def ramp(steps: range, hot_from: int, layers: tuple[int, ...], n: int = 4) -> dict[int, list[float | None]]:
    """QKAI per report: ``layers`` hot from step ``hot_from`` on, every other layer cold."""
    return {s: [HOT if s >= hot_from and la in layers else COLD for la in range(n)] for s in steps}


def falling_then(steps: range, jump_at: int | None, jump: float = 1.0) -> dict[int, float]:
    """A loss that falls from 5.5 to 2.0 and, from ``jump_at`` on, stays ``jump`` nats higher."""
    out = {}
    for i, s in enumerate(steps):
        loss = max(2.0, 5.5 - 0.25 * i)
        out[s] = loss + (jump if jump_at is not None and s >= jump_at else 0.0)
    return out


# ---- pure ---------------------------------------------------------------------------------------------


def test_first_firing_and_lead_are_exact_on_a_run_built_to_know_them():
    # Layers 1-3 hot from step 100: qkai_high holds at 100, 110 and fires at the third report (120) on
    # each of them, and the band of those three fires at the same report. The loss jumps by 1 nat at
    # step 160 and stays: diverged at 160 (outcome rule: 0.5 nats above the minimum for 5 losses).
    steps = range(0, 210, 10)
    result = bt.backtest(history(ramp(steps, 100, (1, 2, 3)), falling_then(steps, 160)), RULES, OUTCOME)
    assert (result.outcome, result.outcome_step, result.reports) == ("diverged", 160, 21)
    high, band = result.rule("qkai_high"), result.rule("collapse_band")
    assert (high.first_fire_step, high.onset_step, high.layers, high.firings) == (120, 100, (1,), 3)
    assert (band.first_fire_step, band.onset_step, band.layers, band.firings) == (120, 120, (1, 2, 3), 1)
    assert high.lead_steps == band.lead_steps == 40
    assert high.lead_reports == 4  # the reports at 120, 130, 140 and 150
    assert not result.false_alarm
    body = result.to_json()
    assert {k: body[k] for k in ("run", "outcome", "outcome_step")} == {
        "run": "p/r",
        "outcome": "diverged",
        "outcome_step": 160,
    }
    assert [{k: r[k] for k in ("rule", "first_fire_step", "lead_steps")} for r in body["rules"]] == [
        {"rule": "qkai_high", "first_fire_step": 120, "lead_steps": 40},
        {"rule": "collapse_band", "first_fire_step": 120, "lead_steps": 40},
        # the default loss-only alert checks the loss at step 300, which this run never reaches
        {"rule": bt.LOSS_ROW, "first_fire_step": None, "lead_steps": None},
    ]
    assert high.lead_vs_loss == 40  # the loss alert never fired: the outcome's step is what the loss showed


def test_lead_over_the_loss_is_the_loss_alerts_first_firing_minus_the_rules():
    # The loss jumps 1 nat at step 160; a loss alert at 0.5 nats above the minimum for 2 logged values
    # (window 1) fires at 170. The run diverged at 160 (the outcome rule's excursion start): qkai_high fired
    # at 120, 40 steps before the outcome and 40 before the loss alert knew (min(170, 160) = 160).
    steps = range(0, 210, 10)
    judging = bt.Judging(OUTCOME, loss_alert=LossRule.parse("rise:rise=0.5,for_steps=2,window=1"))
    result = bt.backtest(history(ramp(steps, 100, (1, 2, 3)), falling_then(steps, 160)), RULES, judging=judging)
    assert result.loss_step == 170
    assert result.rule("qkai_high").lead_vs_loss == 40
    loss = result.rule(bt.LOSS_ROW)
    assert (loss.first_fire_step, loss.lead_steps, loss.lead_vs_loss) == (170, -10, None)  # after the outcome
    # a loss alert that fires first leaves qkwatch a negative lead over the loss
    early = bt.Judging(OUTCOME, loss_alert=LossRule.parse("level:at=110,above=1"))
    late = bt.backtest(history(ramp(steps, 100, (1, 2, 3)), falling_then(steps, 160)), RULES, judging=early)
    assert (late.loss_step, late.rule("qkai_high").lead_vs_loss, late.rule(bt.LOSS_ROW).lead_vs_loss) == (110, -10, 0)
    summary = {s.rule: s for s in summarize([late])}
    assert summary["qkai_high"].median_lead_vs_loss == -10 and summary[bt.ANY_RULE].median_lead_vs_loss == -10
    assert summary[bt.LOSS_ROW].flagged == 1  # scored as a row of its own, not part of (any rule)


def with_val(h: RunHistory, val: list[float]) -> RunHistory:
    return RunHistory(h.run, h.reports, h.loss_steps, h.losses, val)


def test_against_a_reference_a_run_that_ends_worse_by_delta_is_degraded_at_its_last_step():
    steps = range(0, 200, 10)
    twin = with_val(history(ramp(steps, 500, ()), falling_then(steps, None), run="p/twin"), [3.0, 2.1, 2.0, 2.0])
    hot = with_val(history(ramp(steps, 50, (0, 1, 2)), falling_then(steps, None), run="p/hot"), [3.0, 2.3, 2.2, 2.1])
    judging = bt.Judging(OUTCOME, reference=twin, delta=0.11)
    result = bt.backtest(hot, RULES, judging=judging)
    # final held-out: mean(2.3, 2.2, 2.1) = 2.2 against mean(2.1, 2.0, 2.0) = 2.0333: 0.167 >= 0.11
    assert (result.outcome, result.outcome_step) == ("degraded", 190)
    assert result.final == pytest.approx(2.2) and "reference 2.033 + 0.11" in result.why
    assert result.rule("qkai_high").lead_steps == 190 - 70 and not result.false_alarm
    # the same run within delta of its twin is healthy, and its alert a false alarm; the twin is its own reference
    close = bt.backtest(hot, RULES, judging=bt.Judging(OUTCOME, reference=twin, delta=0.2))
    assert (close.outcome, close.false_alarm) == ("healthy", True)
    assert bt.backtest(twin, RULES, judging=judging).outcome == "healthy"
    # without a held-out loss a run is judged by its loss alone, and says so
    bare = bt.backtest(history(ramp(steps, 50, (0, 1, 2)), falling_then(steps, None)), RULES, judging=judging)
    assert bare.outcome == "healthy" and "no val_loss logged" in bare.why
    summary = {s.rule: s for s in summarize([result, close])}
    assert (summary["qkai_high"].false_alarms, summary["qkai_high"].false_alarm_rate) == (1, 1.0)
    with pytest.raises(ValueError, match="degradation delta must be a number > 0"):
        bt.Judging(delta=0)


def test_a_rule_that_fires_after_the_outcome_has_a_negative_lead():
    steps = range(0, 300, 10)
    result = bt.backtest(history(ramp(steps, 150, (0, 1, 2)), falling_then(steps, 100, jump=2.0)), RULES, OUTCOME)
    assert (result.outcome, result.outcome_step) == ("diverged", 100)
    high = result.rule("qkai_high")
    assert (high.first_fire_step, high.lead_steps, high.lead_reports) == (170, -70, -7)  # 100, 110, ..., 160


def test_a_firing_on_a_healthy_run_is_a_false_alarm_without_a_lead():
    steps = range(0, 200, 10)
    result = bt.backtest(history(ramp(steps, 50, (2,)), falling_then(steps, None)), RULES, OUTCOME)
    assert (result.outcome, result.outcome_step) == ("healthy", None)
    high, band = result.rule("qkai_high"), result.rule("collapse_band")
    assert (high.first_fire_step, high.lead_steps, high.lead_reports, high.firings) == (70, None, None, 1)
    assert (band.first_fire_step, band.firings) == (None, 0)  # one hot layer is no band
    assert result.false_alarm and result.to_json()["false_alarm"] is True


def test_a_run_without_a_loss_has_an_unknown_outcome_and_still_its_firings():
    steps = range(0, 100, 10)
    result = bt.backtest(history(ramp(steps, 0, (0, 1, 2))), RULES, OUTCOME)
    assert (result.outcome, result.outcome_step) == ("unknown", None)
    assert "no training loss" in result.why
    high = result.rule("qkai_high")
    assert (high.first_fire_step, high.lead_steps, high.lead_reports) == (20, None, None)
    assert not result.false_alarm


def test_the_outcome_rule_is_the_one_given():
    steps = range(0, 210, 10)
    run = history(ramp(steps, 100, (1, 2, 3)), falling_then(steps, 160))
    lenient = bt.backtest(run, RULES, OutcomeRule.parse("delta=2,window=1"))  # a 1-nat jump is no excursion of 2
    assert (lenient.outcome, lenient.outcome_step, lenient.false_alarm) == ("healthy", None, True)
    assert lenient.rule("qkai_high").lead_steps is None


def test_the_replay_is_the_evaluators_nan_breaks_a_streak_and_not_measured_does_not():
    # Layer 0 hot at every report, but NaN at step 20; layer 1 hot at every report, not measured at step 20.
    qkai: dict[int, list[float | None]] = {s: [HOT, HOT] for s in range(0, 80, 10)}
    qkai[20] = [math.nan, None]
    reports = history(qkai).reports
    firings = bt.replay(RULES, reports)
    assert [(f.rule, f.layers, f.onset_step, f.step) for f in firings] == [
        ("qkai_high", (1,), 0, 30),  # 0, 10, 30: three reports that measured it
        ("qkai_high", (0,), 30, 50),  # starts over after the NaN
    ]
    together = evaluate(RULES, {}, reports)  # the pure rules over all reports in one go agree
    assert [(t.rule, t.layers, t.onset_step, t.step) for t in together if t.kind == "firing"] == [
        (f.rule, f.layers, f.onset_step, f.step) for f in firings
    ]


def test_a_new_attempt_starts_every_streak_over():
    # Attempt 1: layer 0 hot at its last two reports (a streak of 2, no alert); the run crashes and
    # resumes from step 30 as attempt 2: the collector ended it in between, so the streak starts over
    # and the alert comes at the third hot report of attempt 2.
    a1 = history({s: [HOT if s >= 30 else COLD] for s in range(0, 50, 10)}).reports
    a2 = history({s: [HOT] for s in range(30, 80, 10)}, attempt=2).reports
    firings = bt.replay(RULES, [*a2, *a1])
    assert [(f.attempt, f.onset_step, f.step) for f in firings] == [(2, 30, 50)]
    result = bt.backtest(RunHistory("p/r", [*a1, *a2]), RULES, OUTCOME)
    assert (result.rule("qkai_high").first_fire_step, result.rule("qkai_high").attempt) == (50, 2)


def test_an_alert_firing_when_an_attempt_ends_carries_on_into_the_next():
    # Attempt 1 fires at step 20 and crashes at step 40, still hot; attempt 2 resumes at step 30, still hot:
    # the collector re-opens the alert that ended with attempt 1, so the replay opens no second one.
    # Once attempt 2 cools and heats again, that is a new alert.
    a1 = history({s: [HOT] for s in range(0, 50, 10)}).reports
    a2 = history({s: [HOT if s < 60 or s >= 90 else COLD] for s in range(30, 120, 10)}, attempt=2).reports
    firings = bt.replay(RULES, [*a1, *a2])
    assert [(f.attempt, f.onset_step, f.step) for f in firings] == [(1, 0, 20), (2, 90, 110)]


def test_every_rule_is_reported_whatever_its_kind_and_whether_it_fired():
    rules = RuleSet(
        thresholds=(ThresholdRule("rank_low", metric="stable_rank", op="<", threshold=1.5, for_reports=2),),
        bands=(),
    )
    assert bt.rule_names(RULES) == ["qkai_high", "collapse_band"] and bt.rule_names(rules) == ["rank_low"]
    steps = range(0, 50, 10)
    result = bt.backtest(history(ramp(steps, 0, (0, 1, 2))), rules)  # no stable_rank in the run
    assert [r.to_json() for r in result.rules] == [
        {
            "rule": "rank_low",
            "first_fire_step": None,
            "lead_steps": None,
            "lead_reports": None,
            "lead_vs_loss": None,
            "onset_step": None,
            "attempt": None,
            "layers": [],
            "firings": 0,
            "summary": None,
        }
    ]


def test_a_forecast_firing_carries_its_predicted_crossing_step():
    """QKAI = 0.25 + step / 2048 crosses 0.70 at step 921.6: the replay keeps the forecast's prediction."""
    rules = RuleSet.from_mapping(
        {"rules": [{"name": "qkai_forecast", "kind": "forecast", "window": 4, "horizon_steps": 200}]}
    )
    reports = [ReportValues(1, s, {"qkai": [0.25 + s / 2048]}) for s in range(0, 900, 50)]
    (firing,) = bt.replay(rules, reports)
    assert firing.rule == "qkai_forecast" and firing.step == 750  # the first report within 200 steps of 921.6
    assert firing.predicted_step == 922


def test_a_history_answer_becomes_one_report_per_step_and_the_loss():
    nan = math.nan
    columns = {  # as Client.history(..., frame=False) gives them: a row per (step, layer) measured
        "step": [0, 0, 0, 10, 10, 20],
        "layer": [-1, 0, 2, -1, 1, -1],
        "loss": [5.0, None, None, nan, None, 4.0],
        "qkai": [None, 0.2, nan, None, 0.9, None],
        "stable_rank": [None, 1.5, None, None, None, None],
    }
    run = RunHistory.from_columns("p/r", columns, attempt=3)
    assert [(r.attempt, r.step) for r in run.reports] == [(3, 0), (3, 10)]  # step 20 logged only the loss
    assert repr(run.reports[0].layers) == repr({"qkai": [0.2, None, nan], "stable_rank": [1.5]})
    assert run.reports[1].layers == {"qkai": [None, 0.9]}
    assert run.loss_steps == [0, 10, 20] and repr(run.losses) == repr([5.0, nan, 4.0])
    assert bt.backtest(run, RULES, OUTCOME).outcome_step == 10  # the NaN loss: diverged there


def test_lead_in_reports_counts_reports_between_firing_and_outcome():
    steps = [0, 10, 20, 30, 40]
    assert bt.lead_reports(steps, 10, 40) == 3
    assert bt.lead_reports(steps, 40, 40) == 0
    assert bt.lead_reports(steps, 40, 10) == -3
    assert bt.lead_reports(steps, 15, 35) == 2  # an outcome between reports


def test_the_summary_scores_recall_false_alarms_and_median_leads():
    steps = range(0, 300, 10)
    early = bt.backtest(history(ramp(steps, 100, (0, 1, 2)), falling_then(steps, 200), run="p/early"), RULES, OUTCOME)
    earlier = bt.backtest(
        history(ramp(steps, 50, (0, 1, 2)), falling_then(steps, 200), run="p/earlier"), RULES, OUTCOME
    )
    late = bt.backtest(history(ramp(steps, 250, (0, 1, 2)), falling_then(steps, 200), run="p/late"), RULES, OUTCOME)
    missed = bt.backtest(history(ramp(steps, 999, ()), falling_then(steps, 200), run="p/missed"), RULES, OUTCOME)
    alarm = bt.backtest(history(ramp(steps, 100, (1,)), falling_then(steps, None), run="p/alarm"), RULES, OUTCOME)
    calm = bt.backtest(history(ramp(steps, 999, ()), falling_then(steps, None), run="p/calm"), RULES, OUTCOME)
    unknown = bt.backtest(history(ramp(steps, 0, (0,)), run="p/unknown"), RULES, OUTCOME)
    assert [r.rule("qkai_high").lead_steps for r in (early, earlier, late)] == [80, 130, -70]
    scores = {s.rule: s for s in summarize([early, earlier, late, missed, alarm, calm, unknown])}
    assert list(scores) == ["qkai_high", "collapse_band", bt.ANY_RULE, bt.LOSS_ROW]
    high = scores["qkai_high"]
    assert (high.bad_runs, high.flagged, high.late, high.recall) == (4, 2, 1, 0.5)
    assert (high.healthy_runs, high.false_alarms, high.false_alarm_rate, high.unknown_runs) == (2, 1, 0.5, 1)
    assert (high.median_lead_steps, high.median_lead_reports) == (105.0, 10.5)  # (80, 130) and (8, 13)
    band = scores["collapse_band"]
    assert (band.flagged, band.false_alarms, band.median_lead_steps) == (2, 0, 105.0)
    anyone = scores[bt.ANY_RULE]
    assert (anyone.flagged, anyone.late, anyone.false_alarms, anyone.recall) == (2, 1, 1, 0.5)
    assert json.loads(json.dumps(high.to_json()))["recall"] == 0.5


# ---- parity with a live collector ------------------------------------------------------------------------

LAYERS = 6
CUSTOM_RULES = """\
rules:
  - {name: qkai_high, metric: qkai, op: ">", for_reports: 3, severity: warning}
  - {name: collapse_band, band_of: qkai_high, min_layers: 3, severity: critical}
  - {name: entropy_uniform, metric: attn_entropy, op: ">", threshold: 0.95, for_reports: 2, severity: warning}
  - {name: rank_low, metric: stable_rank, op: "<", threshold: 1.3, for_reports: 4, severity: page}
"""
"""The collector's rules: the defaults (qkai_high takes the collector's collapse threshold) and two more."""
SERVED_COLLAPSE = "0.6"
"""The collector's collapse threshold: not the default, so a backtest that ignored the collector's would differ."""


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rules") / "rules.yml"
    path.write_text(CUSTOM_RULES)
    return path


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, rules_file: Path) -> Iterator[str]:
    """A live ``qkwatch serve --open --rules rules.yml`` at collapse threshold 0.6, on the parameter's database."""
    extra: tuple[str, ...] = ("--rules", str(rules_file))
    if request.param == "postgres":
        url = request.getfixturevalue("pg_url")
        if url is None:
            missing_service(f"PostgreSQL at {PG_ADMIN_URL}")
        extra += ("--database-url", url)  # the last --database-url wins
    env = {"QKWATCH_COLLAPSE_THRESHOLD": SERVED_COLLAPSE}
    live = LiveCollector(tmp_path_factory.mktemp("backtest"), None, *extra, env=env).start()
    try:
        yield live.url
    finally:
        live.stop()


def trouble(seed: int, steps: range, spike_at: int = 300) -> list[dict[str, Any]]:
    """Reports of a run that goes bad: a QKAI band forms over layers 2-4 from step 100 (with a dip, a
    NaN and a value not measured on the way), their attention goes uniform and their stable rank
    falls; the loss falls, then spikes by 1.5 nats at ``spike_at`` and comes back 60 steps later."""
    rng = random.Random(seed)
    out = []
    for i, step in enumerate(steps):
        grown = min(1.0, max(0.0, (step - 100) / 100))
        band = [2 <= la <= 4 for la in range(LAYERS)]
        qkai: list[float | str | None] = [0.3 + 0.55 * grown * b + rng.uniform(-0.04, 0.04) for b in band]
        if step == 220:
            qkai[3] = 0.4  # a dip: the layer (and the band) resolves and fires again
        if step == 250:
            qkai[2] = "nan"  # breaks that layer's streak
        if step == 270:
            qkai[4] = None  # not measured: the streak goes on
        entropy = [0.7 + 0.3 * grown * b + rng.uniform(-0.01, 0.01) for b in band]
        rank = [2.0 - 0.9 * grown * b + rng.uniform(-0.05, 0.05) for b in band]
        loss = max(1.8, 5.5 - 0.1 * i) + rng.uniform(-0.05, 0.05) + (1.5 if spike_at <= step < spike_at + 60 else 0)
        out.append(
            report(
                step,
                {"qkai": qkai, "attn_entropy": entropy, "stable_rank": rank},
                scalars={"loss": loss},
            )
        )
    return out


def ingest(c: Client, run_id: str, reports: list[dict[str, Any]], sizes: list[int]) -> dict[int, int]:
    """Send ``reports`` in batches of ``sizes`` (cycled); returns alert id -> the last step of the batch
    after which the collector first listed it."""
    seen: dict[int, int] = {}
    i, k = 0, 0
    while i < len(reports):
        batch = reports[i : i + sizes[k % len(sizes)]]
        c.send_reports(run_id, batch)
        i, k = i + len(batch), k + 1
        for alert in c.alerts(run=run_id, limit=10_000):
            seen.setdefault(alert.id, batch[-1]["step"])
    return seen


def live_alerts(c: Client, run_id: str, seen: dict[int, int]) -> list[tuple[str, int, int]]:
    """(rule, onset step, step of the batch that raised it) of every alert the collector opened, in order."""
    alerts = c.alerts(run=run_id, limit=10_000).data
    return sorted((a.rule, a.onset_step, seen[a.id]) for a in alerts)


def first_live(alerts: list[tuple[str, int, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for rule, _onset, step in sorted(alerts, key=lambda a: a[2]):
        out.setdefault(rule, step)
    return out


@pytest.mark.parametrize("rules_given", [False, True], ids=["default-rules", "rules-file"])
def test_the_backtest_reproduces_the_live_collectors_firing_steps_exactly(served, rules_file, rules_given, capsys):
    with Client(served) as c:
        run = c.create_run(f"bt-{uuid.uuid4().hex[:8]}", "trouble", config={"n_layers": LAYERS})
        seen = ingest(c, run.id, trouble(1, range(0, 400, 10)), [1])  # a batch per report: exact steps
        live = live_alerts(c, run.id, seen)
        collapse = c.thresholds().collapse
        history = read(c, run.ref)
    assert collapse == float(SERVED_COLLAPSE)
    rules = RuleSet.from_file(rules_file, collapse) if rules_given else RuleSet.default(collapse)
    result = bt.backtest(history, rules, OUTCOME)
    firings = bt.replay(rules, history.reports)
    names = set(bt.rule_names(rules))
    expected = [a for a in live if a[0] in names]
    # what the run was built to show: a band, a layer re-firing after its dip, and the extra rules
    assert {"qkai_high", "collapse_band"} <= {a[0] for a in expected}
    assert sum(a[0] == "qkai_high" for a in expected) > 3
    if rules_given:
        assert {a[0] for a in expected} == names
    assert sorted((f.rule, f.onset_step, f.step) for f in firings) == expected
    first = first_live(expected)
    fired = {r.rule: r.first_fire_step for r in result.rules if r.first_fire_step is not None}
    assert {rule: step for rule, step in fired.items() if rule != bt.LOSS_ROW} == first
    assert (result.outcome, result.outcome_step) == ("spiked", 300)
    assert all(r.lead_steps == 300 - r.first_fire_step for r in result.rules if r.first_fire_step is not None)
    # the command, which takes the collector's collapse threshold itself
    argv = ["alerts", "backtest", run.ref, "--json", "--outcome", "window=1", "--url", served]
    assert main([*argv, *(["--rules", str(rules_file)] if rules_given else [])]) == 0
    (shown,) = json.loads(capsys.readouterr().out)["runs"]
    fired = {r["rule"]: r["first_fire_step"] for r in shown["rules"] if r["first_fire_step"] is not None}
    assert {rule: step for rule, step in fired.items() if rule != bt.LOSS_ROW} == first


def test_batching_does_not_move_a_firing(served, rules_file):
    """Uneven batches: every alert's onset is the replay's, and its firing step lies in the batch that raised it."""
    reports = trouble(2, range(0, 400, 10))
    with Client(served) as c:
        run = c.create_run(f"bt-{uuid.uuid4().hex[:8]}", "batched", config={"n_layers": LAYERS})
        seen = ingest(c, run.id, reports, [3, 1, 7, 2, 5])
        live = live_alerts(c, run.id, seen)
        history = read(c, run.id)
    firings = sorted(
        bt.replay(RuleSet.from_file(rules_file, float(SERVED_COLLAPSE)), history.reports),
        key=lambda f: (f.rule, f.onset_step, f.step),
    )
    assert len(live) > 5 and [(f.rule, f.onset_step) for f in firings] == [(rule, onset) for rule, onset, _ in live]
    steps = [r["step"] for r in reports]
    for f, (_rule, _onset, raised_by) in zip(firings, live, strict=True):
        assert f.step <= raised_by and steps.index(f.step) >= steps.index(raised_by) - 6  # within that batch


def test_a_resumed_run_is_replayed_attempt_by_attempt(served):
    """Attempt 1 ends crashed with a streak under way; attempt 2 resumes from an earlier step: the
    collector starts every streak over, and so does the replay."""
    project = f"bt-{uuid.uuid4().hex[:8]}"
    hot = [HOT] * 3 + [COLD] * 3
    with Client(served) as c:
        run = c.create_run(project, "resumed", attempt_key="first")
        first = [
            report(s, {"qkai": hot if s >= 30 else [COLD] * 6}, scalars={"loss": 5.0 - s / 100})
            for s in range(50)[::10]
        ]
        seen = ingest(c, run.id, first, [1])
        c.set_status(run.id, "crashed", attempt=1)
        assert c.create_run(project, "resumed", attempt_key="second").attempt == 2
        second = [report(s, {"qkai": hot}, scalars={"loss": 5.0 - s / 100}) for s in range(30, 90, 10)]
        seen |= ingest(c, run.id, second, [1])
        live = live_alerts(c, run.id, seen)
        history = read(c, run.id)
    assert {r.attempt for r in history.reports} == {1, 2}
    firings = bt.replay(RuleSet.default(float(SERVED_COLLAPSE)), history.reports)
    assert sorted((f.rule, f.onset_step, f.step) for f in firings) == live
    assert {(f.attempt, f.step) for f in firings} == {(2, 50)}
    assert history.loss_steps == list(range(0, 90, 10))  # the merged view: attempt 2 from step 30


def test_an_alert_carried_into_a_resumed_attempt_is_replayed_as_one(served):
    """Attempt 1 fires (layers 0-2 and their band) and ends crashed while firing; attempt 2 resumes from an
    earlier step, still hot: the collector re-opens the same alerts, and the replay opens none anew."""
    project = f"bt-{uuid.uuid4().hex[:8]}"
    hot = [HOT] * 3 + [COLD] * 3
    with Client(served) as c:
        run = c.create_run(project, "carried", attempt_key="first")
        first = [report(s, {"qkai": hot if s >= 10 else [COLD] * 6}) for s in range(60)[::10]]
        seen = ingest(c, run.id, first, [1])
        c.set_status(run.id, "crashed", attempt=1)
        assert {a.state for a in c.alerts(run=run.id)} == {"ended"}
        assert c.create_run(project, "carried", attempt_key="second").attempt == 2
        seen = ingest(c, run.id, [report(s, {"qkai": hot}) for s in range(40, 90, 10)], [1]) | seen  # first seen
        live = live_alerts(c, run.id, seen)
        assert {a.state for a in c.alerts(run=run.id)} == {"firing"}
        history = read(c, run.id)
    firings = bt.replay(RuleSet.default(float(SERVED_COLLAPSE)), history.reports)
    assert sorted((f.rule, f.onset_step, f.step) for f in firings) == live
    assert {(f.attempt, f.step) for f in firings} == {(1, 30)} and len(live) == 4


class InProcess(httpx.BaseTransport):
    """The client's requests through a TestClient: an app on a real database, in this process."""

    def __init__(self, app_client: TestClient) -> None:
        self.app_client = app_client

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = self.app_client.request(request.method, str(request.url), headers=request.headers, content=request.read())
        headers = {k: v for k, v in r.headers.items() if k.lower() not in ("content-encoding", "content-length")}
        return httpx.Response(r.status_code, headers=headers, content=r.content)


def test_a_run_too_large_for_one_history_answer_is_read_in_step_windows(make_harness, monkeypatch):
    from qkwatch.monitor.api import queries

    h = make_harness()
    run = h.create_run("large")
    h.send(run["id"], trouble(3, range(0, 400, 10)))
    token = h.headers("read")["Authorization"].split()[1]
    with Client("http://testserver", token=token, transport=InProcess(h.client)) as c:
        whole = read(c, run["id"])
        monkeypatch.setattr(queries, "MAX_HISTORY_VALUES", 100)  # 40 reports x 3 metrics x 6 layers = 720
        windowed = read(c, run["id"])
        with pytest.raises(CollectorError) as refused:  # what the windows got round
            c.history(run["id"], frame=False)
    assert refused.value.status == 422
    assert len(whole.reports) == 40 and len(whole.losses) == 40
    assert repr(windowed) == repr(whole)  # repr: a NaN equals itself there


# ---- the command ----------------------------------------------------------------------------------------


def test_the_command_prints_the_backtest_as_json_and_as_a_table(collector, tmp_path, capsys):
    url = collector.start().url
    project = f"cli-{uuid.uuid4().hex[:6]}"
    with Client(url) as c:
        bad = c.create_run(project, "bad")
        seen = ingest(c, bad.id, trouble(4, range(0, 400, 10)), [1])
        live = first_live(live_alerts(c, bad.id, seen))
        calm = c.create_run(project, "calm")
        c.send_reports(calm, [report(s, {"qkai": [COLD] * 3}, scalars={"loss": 5 - s / 50}) for s in range(0, 100, 10)])
        quiet = c.create_run(project, "no-loss")
        c.send_reports(quiet, [report(s, {"qkai": [HOT] * 3}) for s in range(0, 50, 10)])
    assert live and set(live) == {"qkai_high", "collapse_band"}  # the collector's default rules

    argv = ["alerts", "backtest", f"{project}/bad", calm.id, f"{project}/no-loss", "--json", "--outcome", "window=1"]
    assert main([*argv, "--url", url]) == 0
    body = json.loads(capsys.readouterr().out)
    assert set(body) >= {"runs", "summary"}
    runs = {r["run"]: r for r in body["runs"]}
    assert list(runs) == [f"{project}/bad", f"{project}/calm", f"{project}/no-loss"]
    for r in body["runs"]:
        assert {"run", "outcome", "outcome_step", "rules"} <= set(r)
        loss_row = [bt.LOSS_ROW] if r["outcome"] != "unknown" else []  # a run without a loss has no loss alert
        assert [x["rule"] for x in r["rules"]] == ["qkai_high", "collapse_band", *loss_row]
        assert all({"rule", "first_fire_step", "lead_steps", "lead_vs_loss"} <= set(x) for x in r["rules"])
    assert body["loss_alert"] == "level:at=300,above=2.15" and body["reference"] is None
    assert (runs[f"{project}/bad"]["outcome"], runs[f"{project}/bad"]["outcome_step"]) == ("spiked", 300)
    assert {x["rule"]: x["first_fire_step"] for x in runs[f"{project}/bad"]["rules"][:2]} == live
    assert {x["rule"]: x["lead_steps"] for x in runs[f"{project}/bad"]["rules"][:2]} == {
        rule: 300 - step for rule, step in live.items()
    }
    assert runs[f"{project}/calm"]["outcome"] == "healthy" and not runs[f"{project}/calm"]["false_alarm"]
    assert runs[f"{project}/no-loss"]["outcome"] == "unknown" and runs[f"{project}/no-loss"]["outcome_step"] is None
    any_rule = next(s for s in body["summary"] if s["rule"] == bt.ANY_RULE)
    assert (any_rule["bad_runs"], any_rule["flagged"], any_rule["recall"], any_rule["false_alarms"]) == (1, 1, 1.0, 0)

    assert main(["alerts", "backtest", f"{project}/bad", "--outcome", "window=1", "--url", url]) == 0
    table = capsys.readouterr().out
    assert f"{project}/bad: spiked at step 300" in table and "qkai_high" in table and "collapse_band" in table
    assert str(live["qkai_high"]) in table and str(300 - live["qkai_high"]) in table

    rules = tmp_path / "rules.yml"
    rules.write_text("rules:\n  - {name: strict, metric: qkai, op: '>', threshold: 0.99, for_reports: 1}\n")
    assert main(["alerts", "backtest", f"{project}/no-loss", "--rules", str(rules), "--json", "--url", url]) == 0
    (only,) = json.loads(capsys.readouterr().out)["runs"][0]["rules"]
    assert (only["rule"], only["first_fire_step"]) == ("strict", None)
    # the plain listing is still there
    assert main(["alerts", "--run", f"{project}/no-loss", "--url", url]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1 + 4  # the header; qkai_high on 3 layers and the band


def _ending(c: Client, project: str, name: str, hot_layers: int, final: float) -> str:
    """A run whose loss falls smoothly (no spike) to step 290, whose held-out loss ends at ``final``, and
    whose first ``hot_layers`` layers have QKAI above the collapse threshold from step 100 (qkai_high fires
    at 120; three make a band)."""
    run = c.create_run(project, name)
    reports = [
        report(
            s,
            {"qkai": [HOT if s >= 100 and la < hot_layers else COLD for la in range(3)]},
            scalars={"loss": 5.5 - s / 100, **({"val_loss": final + (290 - s) / 100} if s % 50 == 40 else {})},
        )
        for s in range(0, 300, 10)
    ]
    c.send_reports(run.id, reports)
    return run.id


def test_the_command_judges_each_run_against_its_reference(collector, capsys):
    """val_loss is logged at steps 40, 90, ..., 290 as ``final`` + 2.5, 2.0, ..., 0.0: the final held-out loss,
    the mean of the last three, is ``final`` + 0.5 (twin 2.5, hot 2.8, near 2.55)."""
    url = collector.start().url
    project = f"ref-{uuid.uuid4().hex[:6]}"
    with Client(url) as c:
        _ending(c, project, "twin", 0, 2.0)
        _ending(c, project, "hot", 3, 2.3)  # 0.3 above the twin: degraded, flagged at 120
        _ending(c, project, "near", 1, 2.05)  # 0.05 above: healthy, and its qkai_high a false alarm
        c.create_run(project, "no-val")
    argv = ["alerts", "backtest", f"{project}/hot", f"{project}/near", "--reference", f"{project}/twin", "--json"]
    assert main([*argv, "--url", url]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["reference"] == f"{project}/twin" and body["reference_final"] == pytest.approx(2.5)
    assert body["delta"] == 0.11 and "degraded: final held-out loss >= " in body["judged"]
    runs = {r["run"].split("/")[1]: r for r in body["runs"]}
    assert (runs["hot"]["outcome"], runs["hot"]["outcome_step"]) == ("degraded", 290)
    assert runs["hot"]["final"] == pytest.approx(2.8)
    high = {x["rule"]: x for x in runs["hot"]["rules"]}["qkai_high"]
    # the loss alert (smoothed loss above 2.15 at step 300) never fires on a 290-step run: the lead over the
    # loss is to the end, where the user compares final losses
    assert (high["first_fire_step"], high["lead_steps"], high["lead_vs_loss"]) == (120, 170, 170)
    assert (runs["near"]["outcome"], runs["near"]["false_alarm"]) == ("healthy", True)
    summary = {s["rule"]: s for s in body["summary"]}
    assert (summary["qkai_high"]["flagged"], summary["qkai_high"]["false_alarm_rate"]) == (1, 1.0)
    assert summary["qkai_high"]["median_lead_vs_loss"] == 170
    # a larger delta: the hot run ended close enough; the table says how runs were judged
    assert main([*argv[:-1], "--delta", "0.5", "--loss-alert", "none", "--url", url]) == 0
    table = capsys.readouterr().out
    assert f"{project}/hot: healthy" in table and "false alarm" in table and "+ 0.5" in table
    for bad, needle in (
        (["--reference", f"{project}/no-val"], f"--reference {project}/no-val: no finite val_loss logged"),
        (["--reference", f"{project}/twin", "--delta", "0"], "--delta: degradation delta must be a number > 0"),
        (["--loss-alert", "level:at=300"], "--loss-alert: loss rule level: needs above"),
        (["--loss-alert", "wobble:x=1"], "--loss-alert: loss rule kind must be one of level, fall"),
    ):
        assert main(["alerts", "backtest", f"{project}/hot", *bad, "--url", url]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


def test_the_command_names_what_is_wrong_in_one_line(collector, tmp_path, capsys):
    url = collector.start().url
    project = f"cli-{uuid.uuid4().hex[:6]}"
    with Client(url) as c:
        c.create_run(project, "there")
    assert main(["alerts", "backtest", f"{project}/there", f"{project}/nope", "--url", url]) == 1
    err = capsys.readouterr().err
    assert f"{project}/nope" in err and "not found" in err and len(err.strip().splitlines()) == 1
    broken = tmp_path / "rules.yml"
    broken.write_text("rules: [{name: x, metric: qkai, op: '~'}]\n")
    assert main(["alerts", "backtest", f"{project}/there", "--rules", str(broken), "--url", url]) == 2
    err = capsys.readouterr().err
    assert "rules file" in err and "op must be one of" in err and len(err.strip().splitlines()) == 1
    assert main(["alerts", "backtest", f"{project}/there", "--outcome", "delta=-1", "--url", url]) == 2
    assert "outcome delta must be a number > 0" in capsys.readouterr().err
    collector.stop()
    assert main(["alerts", "backtest", f"{project}/there", "--url", url]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the collector" in err and len(err.strip().splitlines()) == 1
