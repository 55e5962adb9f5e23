"""One way to wire a service (CONTRIBUTING.md): the domain gets its dependencies at construction
or as arguments, from an entry point (api/app.py, api/deps.py, workers/, core/cli, the dispatcher).

Read from the source, not run: no module of the domain packages, the pure ones or
core/idempotency.py may read the settings itself (`get_settings`), open the global engines and
session factories of core/infra/db.py, or build a Redis client from a URL (`kv.client`). Those are
what made `create_completion` testable only through the whole stack.

The API's edge is held to the same check: in api/ only api/app.py (which builds the services at
startup) and api/deps.py (which hands them, the settings and the sessions to the routes) reach those
globals; a route or an edge module takes them from there (a dependency, or the app's state
api/app.py filled). A module that still had to open a session of the global factory itself would be
listed in API_KNOWN with its reason, and must stay listed only while it does (none now).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["core/jobs", "core/batches", "core/tenancy", "core/files", "core/protocol", "core/generation"]
MODULES = ["core/idempotency.py"]
GLOBALS = {"get_settings", "sync_sessions", "async_sessions", "sync_engine", "async_engine"}
REDIS_FACTORIES = {"client", "async_client"}  # core/infra/kv: a new Redis client from a URL

# Known exceptions, each with its reason; remove an entry when the module is fixed.
KNOWN: dict[str, str] = {}

API_ENTRY = {"api/app.py", "api/deps.py"}
# Edge modules that open a short session of core/infra/db's global factory themselves. Remove an
# entry when its module takes the sessions from api/deps.py or the app's state.
API_KNOWN: dict[str, str] = {}


def _modules() -> list[Path]:
    out = [ROOT / m for m in MODULES]
    for pkg in PACKAGES:
        out += sorted((ROOT / pkg).rglob("*.py"))
    return out


def _offences(tree: ast.Module) -> list[str]:
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "core.infra.db":
            found.append(f"line {node.lineno}: imports core.infra.db")
        elif (
            isinstance(node, ast.ImportFrom) and node.module == "core.infra" and any(a.name == "db" for a in node.names)
        ):
            found.append(f"line {node.lineno}: imports core.infra.db")
        elif isinstance(node, ast.Import) and any(a.name == "core.infra.db" for a in node.names):
            found.append(f"line {node.lineno}: imports core.infra.db")
        elif isinstance(node, ast.Name) and node.id in GLOBALS:
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in GLOBALS:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and any(a.name in GLOBALS for a in node.names):
            found.append(f"line {node.lineno}: imports {[a.name for a in node.names if a.name in GLOBALS]}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in REDIS_FACTORIES
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "kv"
        ):
            found.append(f"line {node.lineno}: kv.{node.func.attr}(...)")
    return found


def test_the_domain_is_given_its_settings_sessions_and_redis():
    bad: dict[str, list[str]] = {}
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        found = _offences(ast.parse(path.read_text(), rel))
        if found and rel not in KNOWN:
            bad[rel] = found
    assert not bad, f"inject these (as core/jobs/lifecycle.Lifecycle is given them) instead: {bad}"


def test_known_exceptions_still_need_their_entry():
    stale = [m for m in KNOWN if not _offences(ast.parse((ROOT / m).read_text()))]
    assert not stale, f"fixed: remove from KNOWN {stale}"


def test_the_check_sees_each_way_in():
    ways = [
        "from core.config import get_settings",
        "from core.infra.db import sync_sessions",
        "from core.infra import db",
        "settings.get_settings().x",
        "async_sessions()()",
        "kv.client('redis://')",
    ]
    for src in ways:
        assert len(_offences(ast.parse(src))) == 1, src
    assert _offences(ast.parse("def f(sessions, settings):\n    sessions()\n    settings.redis_url")) == []


def _api_offences(tree: ast.Module) -> list[str]:
    """`_offences` for the API's edge, where the routes' parameters carry the same names as the
    globals (`sync_sessions: SyncSessionsDep`): a use of a global is an import of it or a call."""
    calls = [
        f"line {n.lineno}: {name}()"
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and (name := n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")) in GLOBALS
    ]
    return [f for f in _offences(tree) if ": ." not in f and f.split(": ", 1)[1] not in GLOBALS] + calls


def test_the_api_check_sees_each_way_in_but_a_parameter():
    for src in ("from core.infra.db import async_sessions", "db.sync_sessions()", "get_settings()"):
        assert _api_offences(ast.parse(src)), src
    assert _api_offences(ast.parse("async def f(sync_sessions):\n    g(sync_sessions, state.async_sessions)")) == []


def _api_modules() -> list[str]:
    return [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "api").rglob("*.py"))]


def test_the_api_reaches_process_globals_only_in_its_entry_points():
    bad: dict[str, list[str]] = {}
    for rel in _api_modules():
        if rel in API_ENTRY or rel in API_KNOWN:
            continue
        found = _api_offences(ast.parse((ROOT / rel).read_text(), rel))
        if found:
            bad[rel] = found
    assert not bad, f"take these from api/deps.py (or app.state, filled by api/app.py) instead: {bad}"


def test_known_api_exceptions_still_need_their_entry():
    stale = [m for m in API_KNOWN if not _api_offences(ast.parse((ROOT / m).read_text()))]
    assert not stale, f"fixed: remove from API_KNOWN {stale}"


# The API's composition root: it builds the engines and session factories once, at startup, and puts
# them on app.state; api/deps.py hands them to the routes.
API_ROOT = "api/app.py"


def test_only_the_api_root_reaches_the_global_sessions():
    """Routes, the guard, uploads and streams use the sessions api/app.py built (api/deps.py), never
    the global engines and session factories of core/infra/db.py (issue 36: routes opened global
    sessions themselves): no module of api/ but its root imports core/infra/db.py."""
    bad: dict[str, list[str]] = {}
    for path in sorted((ROOT / "api").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        found = [f for f in _offences(ast.parse(path.read_text(), rel)) if f.endswith("imports core.infra.db")]
        if found and rel != API_ROOT:
            bad[rel] = found
    assert not bad, f"take the sessions from app.state (api/deps.py) instead: {bad}"
