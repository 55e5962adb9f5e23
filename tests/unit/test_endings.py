"""Every way a job ends goes through core/jobs/lifecycle.py (CONTRIBUTING.md, docs/architecture.md):
the transition and its usage row in one transaction, then the rate-limit settlement, then the
terminal event.

Read from the source, not run. The endings are the statements of core/jobs/transitions.py that set
`finished_at` (a job's end), and the names built on them (`SUCCEED = _ending(...)`, `succeed`
returning SUCCEED), found by walking transitions.py itself, so a new ending is covered the day it is
written. Outside lifecycle.py no module of api/, core/, workers/ or ops/ may name one, however it
reached it (`transitions.fail`, `jobs.fail` for `import transitions as jobs`, `from
core.jobs.transitions import fail`). test_state_writers.py keeps everyone else from writing the state
some other way.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRANSITIONS = "core/jobs/transitions.py"
HOME = "core/jobs/lifecycle.py"
# Known exceptions, each with its reason (docs/architecture.md names it too).
KNOWN = {
    # Clears the synthetic backlog the fairness scenario wrote into the ledger itself: no usage row,
    # settlement or event (nobody waits on those jobs and nothing was reserved for them).
    "ops/fairness.py": {"cancel_queued_of_tenant"},
}


def _top_level(tree: ast.Module) -> dict[str, ast.stmt]:
    out: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            out |= {t.id: node for t in node.targets if isinstance(t, ast.Name)}
    return out


def endings(source: str) -> set[str]:
    """The names of a transitions module that end a job: whatever sets `finished_at`, and whatever
    uses one of those (to a fixed point)."""
    defs = _top_level(ast.parse(source))
    found = {
        name
        for name, node in defs.items()
        if any(isinstance(n, ast.keyword) and n.arg == "finished_at" for n in ast.walk(node))
    }
    while True:
        more = {
            name
            for name, node in defs.items()
            if name not in found and any(isinstance(n, ast.Name) and n.id in found for n in ast.walk(node))
        }
        if not more:
            return found
        found |= more


def _aliases(tree: ast.Module) -> set[str]:
    """The names a module binds to core.jobs.transitions."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "core.jobs":
            out |= {a.asname or a.name for a in node.names if a.name == "transitions"}
        elif isinstance(node, ast.Import):
            out |= {a.asname for a in node.names if a.name == "core.jobs.transitions" and a.asname}
    return out


def ending_uses(source: str, ends: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every ending a module reaches: `<alias>.<ending>`, or imported by its name."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "core.jobs.transitions":
            found += [(node.lineno, a.name) for a in node.names if a.name in ends]
        elif isinstance(node, ast.Attribute) and node.attr in ends:
            base = node.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append((node.lineno, node.attr))
            elif ast.unparse(base) == "core.jobs.transitions":
                found.append((node.lineno, node.attr))
    return sorted(found)


def test_the_endings_are_found_in_transitions():
    ends = endings((ROOT / TRANSITIONS).read_text())
    expected = {"SUCCEED", "FAIL", "succeed", "fail", "fail_queued", "end_queued_lines", "cancel", "fail_lapsed"}
    assert expected | {"cancel_queued_of_tenant"} <= ends
    assert not {"claim", "renew_lease", "requeue_lapsed", "undispatch", "new_row", "is_terminal"} & ends


def test_the_detector_sees_every_way_to_reach_an_ending():
    src = """
from core.jobs import transitions
from core.jobs import transitions as jobs
import core.jobs.transitions as t
import core.jobs.transitions
from core.jobs.transitions import fail, claim
session.execute(transitions.cancel(job_id, tenant, err))
session.execute(jobs.fail_lapsed(3, err))
session.execute(*t.succeed(job_id, 1, result, usage))
session.execute(core.jobs.transitions.FAIL, params)
session.execute(transitions.claim(job_id, 1, "w", 30.0))
lifecycle.fail(job, error)
"""
    ends = {"cancel", "fail_lapsed", "succeed", "FAIL", "fail"}
    assert ending_uses(src, ends) == [
        (6, "fail"),
        (7, "cancel"),
        (8, "fail_lapsed"),
        (9, "succeed"),
        (10, "FAIL"),
    ]  # not: claim (no ending), lifecycle.fail (the lifecycle's own method)


def test_every_ending_goes_through_lifecycle():
    ends = endings((ROOT / TRANSITIONS).read_text())
    bad: dict[str, list[tuple[int, str]]] = {}
    for pkg in ("api", "core", "workers", "ops"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in (HOME, TRANSITIONS):
                continue
            found = [u for u in ending_uses(path.read_text(), ends) if u[1] not in KNOWN.get(rel, set())]
            if found:
                bad[rel] = found
    assert not bad, f"a job ended outside {HOME} (call a Lifecycle method instead): {bad}"
    assert len(ending_uses((ROOT / HOME).read_text(), ends)) >= 5  # the home is seen ending jobs


def test_known_exceptions_still_need_their_entry():
    ends = endings((ROOT / TRANSITIONS).read_text())
    for rel, names in KNOWN.items():
        used = {name for _, name in ending_uses((ROOT / rel).read_text(), ends)}
        assert names <= used, f"{rel} no longer ends jobs with {names - used}: remove it from KNOWN"
