"""The reference lists the docs give, true to the code (issue 52): each generated table (ops/docs.py's
TABLES: metrics, CLI commands, engines, routes, the SDK's parameters) is the one its doc holds between
its markers, and no Markdown page names a metric, route, `spool` command or engine that does not exist.
Each check is shown failing on a false name planted in a copy of the text. Settings: tests/unit/test_compose.py.
"""

from __future__ import annotations

import re
import shutil
from functools import cache
from pathlib import Path

import pytest

from ops import docs

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([*ROOT.glob("*.md"), *ROOT.glob("docs/*.md")])


# -- generated tables ------------------------------------------------------------------------------


def stale(root: Path) -> list[str]:
    """The tables whose doc under `root` does not hold exactly what the code generates now."""
    return [name for name, (doc, make) in docs.TABLES.items() if docs.shown((root / doc).read_text(), name) != make()]


def test_every_generated_table_is_current():
    assert not stale(ROOT), "stale tables: run `python -m ops.docs` and commit what it rewrites"


@pytest.mark.parametrize("name", list(docs.TABLES))
def test_a_planted_change_to_a_table_is_found(tmp_path: Path, name: str):
    doc = docs.TABLES[name][0]
    for d in {d for d, _ in docs.TABLES.values()}:
        (tmp_path / d).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / d, tmp_path / d)
    text = (tmp_path / doc).read_text()
    table = docs.shown(text, name)
    assert table is not None
    last = table.splitlines()[-1]
    (tmp_path / doc).write_text(text.replace(last, last.replace("|", "| x", 1), 1))
    assert stale(tmp_path) == [name]
    assert docs.write(tmp_path) == [name] and stale(tmp_path) == []  # and `python -m ops.docs` mends it


# -- names the pages give ----------------------------------------------------------------------------


@cache
def metric_names() -> frozenset[str]:
    from core.infra import metrics

    names = {metrics.exposed_name(m) for m in metrics.exported()}
    series = {m._name + s for m in metrics.exported() if m._type == "histogram" for s in ("_bucket", "_sum", "_count")}
    return frozenset(names | series)


# `spool_` words that are not metrics, each with what it is.
NOT_METRICS = {
    "spool_bench": "a database the benches use",
    "spool_bulk": "a database the bulk bench uses",
    "spool_fuzz": "a test's database",
    "spool_limits": "a test's database",
    "spool_compose": "a test's database",
    "spool_batch_lines_ended": "a Postgres NOTIFY channel (migration 0011)",
}


def unknown_metrics(text: str) -> list[str]:
    found = set(re.findall(r"(?<![\w./-])(spool_[a-z0-9_]*[a-z0-9])\b", text))
    return sorted(found - metric_names() - set(NOT_METRICS))


@cache
def route_table() -> tuple[tuple[frozenset[str], tuple[str, ...]], ...]:
    from api import costs
    from api.app import create_app

    return tuple(
        (frozenset(r.methods or ()), tuple(r.path.strip("/").split("/"))) for r in costs.routes(create_app()) if r.path
    )


def _placeholder(segment: str) -> bool:
    return segment.startswith("{") or (segment.isupper() and segment.isalpha()) or segment == "..."


def _matches(named: tuple[str, ...], route: tuple[str, ...], prefix: bool) -> bool:
    if len(named) > len(route) or (not prefix and len(named) != len(route)):
        return False
    return all(n == r or r.startswith("{") or _placeholder(n) for n, r in zip(named, route, strict=False))


def unknown_routes(text: str) -> list[str]:
    """`POST /v1/x` must be a route with that method; a backticked `/v1/x` a route, or the start of
    some (`/admin`, `/admin/...`)."""
    out = []
    for method, path in re.findall(r"\b(GET|POST|DELETE|PUT|PATCH) (/[\w{}/.:-]*\w[}]?)", text):
        named = tuple(path.split("?")[0].strip("/").split("/"))
        if not any(method in ms and _matches(named, p, prefix=False) for ms, p in route_table()):
            out.append(f"{method} {path}")
    for path in re.findall(r"`(/(?:v1|admin|health|ready|metrics|ui|tokenize|detokenize|openapi)[^`\s]*)`", text):
        named = tuple(p for p in path.split("?")[0].strip("/").split("/") if p != "...")
        if not any(_matches(named, p, prefix=True) for _, p in route_table()):
            out.append(path)
    return sorted(set(out))


@cache
def cli_commands() -> dict[str, frozenset[str]]:
    """Each command of the `spool` app, and a group's subcommands."""
    import typer.main

    from core.cli.main import app

    group = typer.main.get_command(app)
    return {n: frozenset(getattr(c, "commands", {})) for n, c in group.commands.items()}  # type: ignore[attr-defined]


def _code(text: str) -> list[str]:
    """A page's fenced blocks and inline code spans."""
    blocks = re.findall(r"```.*?```", text, re.S)
    return blocks + re.findall(r"`[^`\n]+`", re.sub(r"```.*?```", "", text, flags=re.S))


def unknown_commands(text: str) -> list[str]:
    """`spool CMD [SUB]` in code: CMD a command, and SUB one of its subcommands where CMD is a group."""
    out = []
    for span in _code(text):
        # `kubectl -n spool ...` names a namespace, not the command.
        found = re.findall(r"(?<![\w./-])(?<!-n )(?<!--namespace )spool ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", span)
        for cmd, sub in found:
            commands = cli_commands()
            if cmd not in commands or (commands[cmd] and sub not in commands[cmd]):
                out.append(f"spool {cmd} {sub}".strip())
    return sorted(set(out))


def unknown_engines(text: str) -> list[str]:
    """An engine a registry entry (`engine = "x"`) or SPOOL_ENGINE=x names is one of core/registry.py's ENGINES."""
    from core.registry import ENGINES

    named = re.findall(r"\bengine ?= ?\"([\w-]+)\"|\bSPOOL_ENGINE=([\w-]+)", text)
    return sorted({a or b for a, b in named} - set(ENGINES))


CHECKS = {"metric": unknown_metrics, "route": unknown_routes, "command": unknown_commands, "engine": unknown_engines}


@pytest.mark.parametrize("kind", list(CHECKS))
def test_the_pages_name_only_what_exists(kind: str):
    wrong = {f"{p.relative_to(ROOT)}": got for p in PAGES if (got := CHECKS[kind](p.read_text()))}
    assert not wrong, f"{kind}s that do not exist: {wrong}"


PLANTED = {
    "metric": ("Alert on `spool_queue_depth` and `spool_jobs_queued`.", ["spool_jobs_queued"]),
    "route": (
        "`POST /v1/jobs/{id}/cancel`, POST /v1/jobs/{id}/retry and `/v1/engines`.",
        ["/v1/engines", "POST /v1/jobs/{id}/retry"],
    ),
    "command": (
        "```bash\nspool init\nspool tenant delete acme\nspool serve\nkubectl -n spool wait job/x\n```",
        ["spool serve", "spool tenant delete"],
    ),
    "engine": ('[[models]]\nengine = "exllamav3"\n\nSPOOL_ENGINE=vllm', ["vllm"]),
}


@pytest.mark.parametrize("kind", list(CHECKS))
def test_a_planted_false_name_is_found(kind: str):
    """Each false name planted into a copy of README.md fails the check, and only it."""
    planted, wrong = PLANTED[kind]
    assert CHECKS[kind]((ROOT / "README.md").read_text() + "\n" + planted + "\n") == wrong
