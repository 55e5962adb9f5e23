"""Jobs end through `Lifecycle`'s public methods (core/jobs/lifecycle.py), never through its private
steps: the dispatcher once failed a queued batch line by calling `Lifecycle._end` itself.

Read from the source, not run: any lifecycle._name (a name or an attribute called `lifecycle`:
`self.lifecycle`, `self.runner.lifecycle`) in api/, core/, workers/ or ops/ outside
core/jobs/lifecycle.py fails the test.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOME = "core/jobs/lifecycle.py"


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, member) for every private member of a lifecycle the source reaches."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        if name.lower() == "lifecycle":
            found.append((node.lineno, node.attr))
    return found


def test_only_the_lifecycle_uses_its_private_steps():
    bad = {
        rel: found
        for pkg in ("api", "core", "workers", "ops")
        for path in sorted((ROOT / pkg).rglob("*.py"))
        if (rel := path.relative_to(ROOT).as_posix()) != HOME and (found := private_uses(path.read_text()))
    }
    assert not bad, f"end jobs through Lifecycle's public methods (add one if none fits): {bad}"


def test_the_check_sees_each_way_in():
    assert private_uses("self.lifecycle._end(stmt, outcome, ev)") == [(1, "_end")]
    assert private_uses("lifecycle._record(s, row, outcome, u, 0.0)") == [(1, "_record")]
    assert private_uses("Lifecycle._counted(job, outcome, u, 0.0)") == [(1, "_counted")]
    assert private_uses("self.lifecycle.fail_queued(job_id, 1, err)\nself._end(x)") == []
