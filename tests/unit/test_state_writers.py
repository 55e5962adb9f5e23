"""core/jobs/transitions.py is the only writer of `jobs.state`, core/batches/transitions.py the only writer
of `batches.status` (CONTRIBUTING.md, docs/architecture.md).

Read from the source, not run: every module of api/, core/, workers/ and ops/ is parsed, and any of
the three ways to write the column outside transitions fails the test:
- an UPDATE built on the jobs table: `update(Job)`, `update(Job.__table__)` or a name bound to it,
  `Job.__table__.update()`;
- an assignment to a row's `state` (`job.state = ...`, `setattr(job, "state", ...)`); `self.state`
  is an object's own attribute, not a row's, and `job.state = row.state` copies what a statement
  of transitions returned onto an object;
- raw SQL naming it: a string with `UPDATE jobs`.
(migrations/ is the schema's history and may rewrite rows; tests, and ops/factories.py for tests and
benches, set new rows up as they need.)

For `batches.status` the same three ways are looked for (an UPDATE of batches setting `status`, a
batch status assigned to a `.status`, raw SQL), and in api/, core/ and workers/ a batch status
compared as a bare string (`b.status == "completed"`): the service names them by `BatchStatus`.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOME = "core/jobs/transitions.py"
# Builds new rows in the state a test or bench needs (an INSERT, never a transition of a stored job).
SETUP = {"ops/factories.py"}
_RAW_SQL = re.compile(r"\bUPDATE\s+jobs\b", re.IGNORECASE)


def _is_jobs_table(node: ast.AST, aliases: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "Job" or node.id in aliases
    if isinstance(node, ast.Attribute) and node.attr == "__table__":
        return isinstance(node.value, ast.Name) and node.value.id == "Job"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "cast":
        return any(_is_jobs_table(a, aliases) for a in node.args)  # cast(Table, Job.__table__)
    return False


def _aliases(tree: ast.Module) -> set[str]:
    """Names a module binds to the jobs table (`_JOBS = cast(Table, Job.__table__)`)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_jobs_table(node.value, set()):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


def _assigned(node: ast.AST) -> list[tuple[ast.expr, ast.expr | None]]:
    """(target, the value it gets where that can be told apart) for every target an assignment has."""
    if isinstance(node, ast.Assign):
        pairs: list[tuple[ast.expr, ast.expr | None]] = [(t, node.value) for t in node.targets]
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        pairs = [(node.target, node.value)]
    else:
        return []
    flat: list[tuple[ast.expr, ast.expr | None]] = []
    while pairs:
        t, v = pairs.pop()
        if isinstance(t, ast.Tuple | ast.List):
            vs = v.elts if isinstance(v, ast.Tuple | ast.List) and len(v.elts) == len(t.elts) else [None] * len(t.elts)
            pairs.extend(zip(t.elts, vs, strict=True))
        else:
            flat.append((t, v))
    return flat


def _mirrors_a_row(value: ast.expr | None) -> bool:
    """`job.state = row.state`: an object takes the state a statement returned (transitions wrote it)."""
    return isinstance(value, ast.Attribute) and value.attr == "state" and isinstance(value.value, ast.Name)


def state_writes(source: str) -> list[tuple[int, str]]:
    """(line, what) for every write of jobs.state the source makes."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name | ast.Attribute) and (f.id if isinstance(f, ast.Name) else f.attr) == "update":
                if node.args and _is_jobs_table(node.args[0], aliases):
                    found.append((node.lineno, "update(Job)"))
                elif isinstance(f, ast.Attribute) and not node.args and _is_jobs_table(f.value, aliases):
                    found.append((node.lineno, "Job.__table__.update()"))
            if isinstance(f, ast.Name) and f.id == "setattr" and len(node.args) >= 2:
                if isinstance(node.args[1], ast.Constant) and node.args[1].value == "state":
                    found.append((node.lineno, 'setattr(..., "state", ...)'))
        for t, value in _assigned(node):
            if isinstance(t, ast.Attribute) and t.attr == "state" and not _mirrors_a_row(value):
                if not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")):
                    found.append((node.lineno, ".state ="))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _RAW_SQL.search(node.value):
            found.append((node.lineno, "raw SQL UPDATE jobs"))  # an f-string's literal parts are Constants too
    return found


def test_the_detector_sees_every_way_of_writing_state():
    src = """
from sqlalchemy import update, text
_T = cast(Table, Job.__table__)
update(Job).values(state="failed")
sqlalchemy.update(Job.__table__)
update(_T)
Job.__table__.update()
job.state = "failed"
row.state, other = "x", 1
setattr(job, "state", "failed")
text("update  jobs set state = 'failed'")
f"UPDATE jobs SET state = '{s}'"
self.state = state
update(Batch).values(status="failed")
"""
    # Nothing else: not self.state, a row's state copied from a RETURNING row, update(Batch).
    assert Counter(what for _, what in state_writes(src)) == {
        "update(Job)": 3,
        "Job.__table__.update()": 1,
        ".state =": 2,
        'setattr(..., "state", ...)': 1,
        "raw SQL UPDATE jobs": 2,
    }


def found_in_modules(detect: Callable[[str], list[tuple[int, str]]]) -> dict[str, list[tuple[int, str]]]:
    """What `detect` finds in each module of the service and of ops, by path (a module where it finds
    nothing left out)."""
    found = {}
    for pkg in ("api", "core", "workers", "ops"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if in_module := detect(path.read_text()):
                found[path.relative_to(ROOT).as_posix()] = in_module
    return found


def test_only_transitions_writes_job_state():
    writers = {rel: found for rel, found in found_in_modules(state_writes).items() if rel != HOME and rel not in SETUP}
    assert not writers, f"jobs.state written outside {HOME}: {writers}"


def test_transitions_is_found_writing():
    """The home itself is seen by the detector: the test above is not passing for want of matches."""
    assert len(state_writes((ROOT / HOME).read_text())) >= 5


# -- batches.status: core/batches/transitions.py is its only writer ---------------------------------------

BATCH_HOME = "core/batches/transitions.py"
_BATCH_SQL = re.compile(r"\bUPDATE\s+batches\b[^;]*\bstatus\b", re.IGNORECASE | re.DOTALL)


def _batch_status_values() -> set[str]:
    from core.batches.transitions import BatchStatus

    return {s.value for s in BatchStatus}


def _is_batch_table(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "Batch"
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "__table__"
        and isinstance(node.value, ast.Name)
        and node.value.id == "Batch"
    )


def _updates_batches(node: ast.AST) -> bool:
    """Whether a statement chain (`update(Batch).where(...)`, `Batch.__table__.update()`) starts on batches."""
    while isinstance(node, ast.Call | ast.Attribute):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name | ast.Attribute) and (f.id if isinstance(f, ast.Name) else f.attr) == "update":
                if node.args and _is_batch_table(node.args[0]):
                    return True
                if isinstance(f, ast.Attribute) and not node.args and _is_batch_table(f.value):
                    return True
            node = f
        else:
            node = node.value
    return False


# core/states.py's enums that are not batch statuses: their values written to a `.status` are a file's.
OTHER_ENUMS = {"FileStatus", "JobState", "JobKind", "KeyScope", "Ending"}


def _names_a_batch_status(value: ast.expr | None, statuses: set[str]) -> bool:
    """`"completed"`, `BatchStatus.failed`, `BatchStatus.failed.value`, `final.value` (an enum's value)."""
    if value is None:
        return False
    if isinstance(value, ast.Constant):
        return value.value in statuses
    if isinstance(value, ast.Attribute) and value.attr == "value":
        # an enum's value, unless it is plainly another ledger enum's (`FileStatus.processed.value`)
        root = value.value
        while isinstance(root, ast.Attribute):
            root = root.value
        return not (isinstance(root, ast.Name) and root.id in OTHER_ENUMS)
    return any(isinstance(n, ast.Name) and n.id == "BatchStatus" for n in ast.walk(value))


def batch_status_writes(source: str) -> list[tuple[int, str]]:
    """(line, what) for every write of batches.status, and every batch status compared as a bare string."""
    statuses = _batch_status_values()
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "values":
            if any(kw.arg == "status" for kw in node.keywords) and _updates_batches(node.func.value):
                found.append((node.lineno, "update(Batch).values(status=...)"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "status":
                found.append((node.lineno, 'setattr(..., "status", ...)'))
        for t, value in _assigned(node):
            if isinstance(t, ast.Attribute) and t.attr == "status" and _names_a_batch_status(value, statuses):
                if not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")):
                    found.append((node.lineno, ".status = <a batch status>"))
        if isinstance(node, ast.Compare) and any(
            isinstance(side, ast.Attribute) and side.attr == "status" for side in (node.left, *node.comparators)
        ):
            consts = [
                c
                for side in (node.left, *node.comparators)
                for c in ([side] if isinstance(side, ast.Constant) else getattr(side, "elts", []))
                if isinstance(c, ast.Constant)
            ]
            if any(c.value in statuses for c in consts):
                found.append((node.lineno, "status compared with a bare string"))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _BATCH_SQL.search(node.value):
            found.append((node.lineno, "raw SQL UPDATE batches ... status"))
    return found


def test_the_detector_sees_every_way_of_writing_a_batch_status():
    src = """
update(Batch).where(Batch.id == b).values(status="failed")
Batch.__table__.update().values(status=BatchStatus.cancelled.value)
b.status = "completed"
b.status = BatchStatus.finalizing.value
b.status = final.value
f.status = FileStatus.processed.value  # a file's: not found
setattr(b, "status", "expired")
text("UPDATE batches SET status = 'failed' WHERE id = :id")
if b.status == "in_progress": pass
if batch.status in ("cancelling", "finalizing"): pass
update(Batch).values(webhook_state=state)
f.status, f.deleted = "processed", False
out.status = f"http {code}"
self.status = status
if b.status in FINAL: pass
"""
    # Nothing else: not another column of batches, a file's status, a result's, self.status, FINAL.
    assert Counter(what for _, what in batch_status_writes(src)) == {
        "update(Batch).values(status=...)": 2,
        ".status = <a batch status>": 3,
        'setattr(..., "status", ...)': 1,
        "raw SQL UPDATE batches ... status": 1,
        "status compared with a bare string": 2,
    }


def test_only_status_writes_batch_status():
    writers = {}
    for rel, found in found_in_modules(batch_status_writes).items():
        if rel.startswith("ops/"):  # clients (the bench, the harnesses) read OpenAI's words off the wire
            found = [f for f in found if f[1] != "status compared with a bare string"]
        if found and rel != BATCH_HOME:
            writers[rel] = found
    assert not writers, f"batches.status written (or a status spelled) outside {BATCH_HOME}: {writers}"
    assert len(batch_status_writes((ROOT / BATCH_HOME).read_text())) >= 3  # the home is seen writing
