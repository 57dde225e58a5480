"""The REST paths live once, in ``qkwatch.contract.api``: the collector serves exactly its templates,
and the agent's transport and the client write none of their own, so a path cannot drift."""

from __future__ import annotations

import ast
from pathlib import Path

from qkwatch.contract import api
from qkwatch.monitor.main import create_app
from qkwatch.monitor.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
CALLERS = [
    ROOT / "qkwatch" / "agent" / "shipping" / "transport.py",
    *sorted((ROOT / "qkwatch" / "client").glob("*.py")),
]
"""The agent's transport and every module of the client."""


def served(tmp_path: Path) -> set[str]:
    """The paths the collector's app serves under ``/v1``, as its OpenAPI schema lists them."""
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'collector.db'}", auto_migrate=False, background=False)
    schema = create_app(settings).openapi()  # every /v1 route is in it (FastAPI nests included routers)
    return {path for path in schema["paths"] if path.startswith(f"{api.PREFIX}/")}


def test_the_collector_serves_exactly_the_contract_routes(tmp_path: Path) -> None:
    templates = set(api.ROUTES)
    assert len(templates) == len(api.ROUTES)  # none listed twice
    assert served(tmp_path) == templates
    # Every template of the module is listed (a new constant cannot be left out of ROUTES).
    constants = {v for k, v in vars(api).items() if k.isupper() and isinstance(v, str) and v.startswith(api.PREFIX)}
    assert constants - {api.PREFIX} == templates


def test_path_fills_the_run_as_each_caller_did() -> None:
    assert api.path(api.HEATMAP, "demo/vanilla") == "/v1/runs/demo%2Fvanilla/heatmap"  # the client
    assert api.path(api.RUN, "0123abcd", quoted=False) == "/v1/runs/0123abcd"  # the agent's run id
    assert api.path(api.LAMBDA_AUDIT, "a b") == "/v1/runs/a%20b/lambdas/audit"


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of a module, its classes and functions (prose, not paths used)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_the_transport_and_the_client_write_no_path_of_their_own() -> None:
    for file in CALLERS:
        tree = ast.parse(file.read_text(), filename=str(file))
        prose = _docstrings(tree)
        literals = [
            (node.lineno, node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
        ]
        assert [(line, text) for line, text in literals if "/v1/" in text or text == "/v1"] == [], file
