"""The collector's alert rules run inside the agent, so a run with sinks and no collector still gets its alerts.

The collector judges each batch of reports with :func:`qkwatch.rules.transitions.evaluate` over the
rules it was started with (``RuleSet.default`` at the collapse threshold, or a rules file). The
sinks' worker does the same, one report at a time, with the same rules: by default
:meth:`RuleSet.default` at ``QKWATCH_COLLAPSE_THRESHOLD`` (0.70 unless set; the collector reads the same
variable), or the rules file given as the ``sink_rules`` setting (the collector's format,
``qkwatch.rules.ruleset``). A rule that begins firing or resolves becomes one :class:`SinkAlert`; a
band that only grows or shrinks while it fires says nothing new.

What it cannot see, it cannot judge: with several ranks each rank's worker sees only its own layers
(``layer % world == rank``), so a band of adjacent layers spread over ranks fires only at the
collector; and a resumed run starts its local streaks over.

Pure: no threads, no I/O (a rules file is read once, when the config builds the worker).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qkwatch.agent.sinks.base import SinkAlert
from qkwatch.contract.thresholds import Thresholds
from qkwatch.contract.values import decode_value
from qkwatch.rules.evaluator import reports_for
from qkwatch.rules.ruleset import RuleSet
from qkwatch.rules.transitions import LayerState, Transition, evaluate

ATTEMPT = 0
"""The local state lives as long as the process: every report it judges is of one attempt."""


def load_rules(path: str | Path | None) -> RuleSet:
    """The collector's default rules at the collapse threshold of the environment, or a rules file's.

    Raises:
        ValueError: a collapse threshold or a rules file the collector would refuse too.
    """
    collapse = Thresholds.from_env().collapse
    return RuleSet.from_file(Path(path), collapse) if path is not None else RuleSet.default(collapse)


class LocalAlerts:
    """The rules' per-layer state for one process, fed one encoded report at a time."""

    def __init__(self, rules: RuleSet):
        self.rules = rules
        self.state: dict[tuple[str, int], LayerState] = {}

    def judge(self, report: Mapping[str, Any]) -> list[SinkAlert]:
        """The alerts that begin or end with ``report`` (the wire's fields; a scalar-only report: none)."""
        metrics = self.rules.metrics
        layers = {
            name: [_decoded(v) for v in values]
            for name, values in (report.get("layers") or {}).items()
            if name in metrics
        }
        reports = reports_for(self.rules, ATTEMPT, [(int(report["step"]), layers)])
        return [sink_alert(t) for t in evaluate(self.rules, self.state, reports) if t.kind != "update"]


def sink_alert(t: Transition) -> SinkAlert:
    """One transition as the sinks receive it."""
    firing = t.kind == "firing"
    span = ", ".join(str(i) for i in t.layers)
    what = "firing" if firing else "resolved"
    title = f"qkwatch {t.rule} {what}: {t.metric} on layer{'s' if len(t.layers) != 1 else ''} {span}"
    return SinkAlert(
        rule=t.rule,
        firing=firing,
        step=t.step,
        title=title,
        text=f"{t.summary}\nstep {t.step} (since step {t.onset_step}), severity {t.severity}",
        severity=t.severity,
        metric=t.metric,
        layers=t.layers,
        onset_step=t.onset_step,
    )


def _decoded(value: Any) -> float | None:
    """A wire value as the collector decodes it; anything it would refuse counts as not measured."""
    try:
        return decode_value(value)
    except ValueError:
        return None
