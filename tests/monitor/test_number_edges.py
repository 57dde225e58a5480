"""Numbers at the edge of a double, from the wire: an integer too large for a float (a 401-digit one) or a
literal beyond a double's range (``1e400``, which Python's parser turns into ``inf``) is a 4xx naming the
field, never a 500, an ``OverflowError`` or a value silently stored as something else (issue 21, M4).

Over HTTP against a real ``qkwatch serve`` on SQLite and PostgreSQL, and on the pure checks behind it."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from qkwatch.contract.scheduling import ScheduleConfig, check_override
from qkwatch.contract.thresholds import Thresholds
from qkwatch.contract.values import decode_value
from qkwatch.rules.ruleset import RuleSet
from tests.monitor.test_serve import serve

pytestmark = pytest.mark.slow

BIG = "1" * 401
"""A 401-digit integer as JSON text."""


def _post(url: str, path: str, body: str) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=30)


def test_numbers_beyond_a_double_are_a_422_naming_the_field_and_store_nothing(db_url: str):
    project = f"edges-{uuid.uuid4().hex[:8]}"
    with serve("--open", "--database-url", db_url) as url:
        for key in ("lambda_0", "h_star", "beta", "ema", "lambda_max", "floor"):
            for number in (BIG, "-" + BIG, "1e400"):
                body = f'{{"project": "{project}", "name": "r", "config": {{"schedule": {{"{key}": {number}}}}}}}'
                answer = _post(url, "/v1/runs", body)
                assert answer.status_code == 422, (key, number, answer.text)
                assert f"schedule.{key}" in answer.text, answer.text
        body = f'{{"project": "{project}", "name": "r", "config": {{"n_layers": {BIG}}}}}'
        answer = _post(url, "/v1/runs", body)
        assert answer.status_code == 422 and "config.n_layers" in answer.text, answer.text
        free = f'{{"project": "{project}", "name": "r", "config": {{"recipe": {{"lr": [0.1, 1e400]}}}}}}'
        answer = _post(url, "/v1/runs", free)
        assert answer.status_code == 422 and "recipe.lr[1]" in answer.text, answer.text  # was 200, stored as null
        assert httpx.get(f"{url}/v1/runs", params={"project": project}).json()["count"] == 0

        run = httpx.post(f"{url}/v1/runs", json={"project": project, "name": "r", "config": {"n_layers": 2}}).json()
        event = {"step": 0, "time": 1.0, "scalars": {"loss": 2.5}, "events": [{"kind": "k", "data": {"x": 0}}]}
        batch = json.dumps({"batch_id": str(uuid.uuid4()), "reports": [event]}).replace('{"x": 0}', '{"x": 1e400}')
        answer = _post(url, f"/v1/runs/{run['id']}/reports", batch)
        assert answer.status_code == 422 and "events" in answer.text and "x is a number" in answer.text, answer.text
        for number in (BIG, "1e400"):
            answer = httpx.put(
                f"{url}/v1/runs/{run['id']}/lambdas/overrides",
                content=f'{{"1": {number}}}',
                headers={"Content-Type": "application/json"},
            )
            assert answer.status_code == 422, answer.text
        assert httpx.get(f"{url}/v1/runs/{run['id']}/metrics").json()["metrics"] == {}  # the batch left nothing
        assert httpx.get(f"{url}/v1/runs/{run['id']}/lambdas").json()["overrides"] == {}


@pytest.mark.parametrize("number", [10**400, -(10**400)])
def test_the_pure_checks_refuse_an_integer_too_large_for_a_float_with_a_value_error(number: int):
    with pytest.raises(ValueError, match="collapse must be a finite number, got an integer of"):
        Thresholds(collapse=number)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="override for layer 0 must be a finite number"):
        check_override(0, number, ScheduleConfig(), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="too large for a float"):
        decode_value(number)  # what the agent does with the lambdas the collector serves
    with pytest.raises(ValueError, match="rule 'r': threshold must be a finite number, got an integer of"):
        RuleSet.from_mapping({"rules": [{"name": "r", "metric": "qkai", "op": ">", "threshold": number}]})
