"""The "only here" rules of CONTRIBUTING.md about names and shapes, read from the source of api/,
core/, workers/ and ops/:

- Redis key literals live in core/infra/ (core/infra/redis_keys.py, and core/infra/streams/keys.py for
  the event stream's own keys): a string that starts with one of Spool's key namespaces anywhere
  else fails. Everyone else calls the functions there, so a key is spelled once.
- Celery task and queue names (`spool.run_job`, `spool.model.<m>.interactive`, ...) are spelled in
  core/infra/broker.py only, and only core/infra/ and the worker's task bodies (workers/tasks.py)
  import celery or kombu.
- GPU libraries (torch, exllamav2, exllamav3, flash-attn) are imported only in workers/engine/, and
  there only inside a function (when an engine is built), never at a module's top level.
- Every body the API answers or a file holds is built in core/protocol/render.py, namely objects (an
  "object" field), the error envelope `{"error": ...}`, a batch file's output and error lines, the
  tokenize/detokenize answers. Two shapes have a home of their own, named in OTHER_HOMES: the
  Responses API's stream events (core/protocol/responses.py) and the webhook's event envelope
  (core/batches/webhooks.py). Each detector is shown finding a planted violation.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "core", "workers", "ops")

KEY_HOME = "core/infra/"
NAMESPACES = ("job", "rl", "spool", "ui")  # see core/infra/redis_keys.py
_KEY = re.compile(rf"^({'|'.join(NAMESPACES)}):(?!\s)")
# Files not yet moved to the rule, each with who moves it (none now: keep it so).
KEY_KNOWN: dict[str, str] = {}

WIRE_HOME = "core/protocol/render.py"
# The two shapes built beside render.py, each in one named place (core/protocol/render.py's docstring):
OTHER_HOMES = {
    # The Responses API's typed stream events, numbered by `Events` around render's objects and items.
    "stream event": "core/protocol/responses.py",
    # Standard Webhooks' envelope around render's batch object: the webhook task runs in the worker,
    # and workers never import core.protocol (an import contract).
    "webhook event": "core/batches/webhooks.py",
}
# Files not yet moved to the rule, each with who moves it (none now: keep it so).
WIRE_KNOWN: dict[str, str] = {}


@cache
def _sources() -> list[tuple[str, str]]:
    return [
        (p.relative_to(ROOT).as_posix(), p.read_text()) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
    ]


@cache
def _parse(source: str) -> ast.Module:
    return ast.parse(source)


def _texts(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant, and of every f-string's leading text."""
    tree = _parse(source)
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                out.append((node.lineno, first.value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts:
            out.append((node.lineno, node.value))
    return out


def key_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string, or f-string's leading text, that names a Redis key."""
    return sorted((line, text) for line, text in _texts(source) if _KEY.match(text))


def _fields(node: ast.AST) -> tuple[dict[str, ast.expr], bool] | None:
    """The named fields of a dict literal or a `dict(...)` call, and whether it also spreads another
    mapping into itself (`{**base, ...}`, `dict(base, ...)`); None for anything else."""
    if isinstance(node, ast.Dict):
        named = {k.value: v for k, v in zip(node.keys, node.values, strict=True) if isinstance(k, ast.Constant)}
        return {k: v for k, v in named.items() if isinstance(k, str)}, any(k is None for k in node.keys)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        named = {kw.arg: kw.value for kw in node.keywords if kw.arg is not None}
        return named, bool(node.args) or any(kw.arg is None for kw in node.keywords)
    return None


def _kind(fields: dict[str, ast.expr], spread: bool) -> str | None:
    """Which wire body a dict's fields make, if any.

    - "object": anything with an `object` field (OpenAI's objects and lists, Spool's own objects);
    - "error envelope": `{"error": ...}` and nothing else, OpenAI's body of every error;
    - "batch line": a batch file's line (`custom_id` + `response`) or its `response` part
      (`status_code` + `request_id` + `body`);
    - "tokenize": the /tokenize and /detokenize answers (`{"tokens": ...}`, `{"content": ...}`, each
      alone, and a token's `{"id", "piece"}`);
    - "stream event": a Responses API stream event (it carries a `sequence_number`);
    - "webhook event": an event envelope (`type` + `data`).
    A sole-field shape spread from another mapping is an edit of one, not a new body."""
    names = set(fields)
    if "object" in names:
        return "object"
    if names == {"error"} and not spread:
        return "error envelope"
    if {"custom_id", "response"} <= names or {"status_code", "request_id", "body"} <= names:
        return "batch line"
    if (names in ({"tokens"}, {"content"}) and not spread) or {"id", "piece"} <= names:
        return "tokenize"
    if "sequence_number" in names:
        return "stream event"
    if {"type", "data"} <= names:
        return "webhook event"
    return None


def wire_bodies(source: str) -> list[tuple[int, str, str]]:
    """(line, kind, what) of every dict literal or `dict(...)` call that builds one of the wire bodies
    (`_kind`). Two places hold dicts that are no body Spool emits, skipped: pydantic's own error
    context (`"ctx": {"error": ...}` in a validation error), and a request a client sends (the `json=`
    of an HTTP call: ops/ asks /tokenize with `{"content": ...}`)."""
    tree = _parse(source)
    contexts = {id(v) for n in ast.walk(tree) if (f := _fields(n)) is not None for k, v in f[0].items() if k == "ctx"}
    contexts |= {
        id(kw.value) for n in ast.walk(tree) if isinstance(n, ast.Call) for kw in n.keywords if kw.arg == "json"
    }
    found = []
    for node in ast.walk(tree):
        f = _fields(node)
        if f is None or id(node) in contexts:
            continue
        kind = _kind(*f)
        if kind is not None:
            what = ast.unparse(f[0]["object"]) if kind == "object" else ", ".join(sorted(f[0]))
            found.append((getattr(node, "lineno", 0), kind, what))
    return sorted(found)


def wire_dicts(source: str) -> list[tuple[int, str]]:
    """(line, object) of every body with an "object" field (the first kind the detector knew)."""
    return [(line, what) for line, kind, what in wire_bodies(source) if kind == "object"]


def home_of(kind: str) -> str:
    return OTHER_HOMES.get(kind, WIRE_HOME)


def test_the_key_detector():
    src = """
a = f"job:{job_id}:readers"
b = "spool:dispatcher:wake"
c = f"rl:t{t}:tpd:{day}"
d = "ui:session:" + token
e = f"{prefix}job:{x}"
f = "job: finished"
g = text("SELECT pg_advisory_xact_lock(hashtext('spool:storage'), :t)")
h = "redis://127.0.0.1:6379/0"
"""
    assert [line for line, _ in key_literals(src)] == [2, 3, 4, 5]


def test_redis_key_literals_live_in_core_infra():
    stray = {
        rel: found
        for rel, src in _sources()
        if not rel.startswith(KEY_HOME) and rel not in KEY_KNOWN and (found := key_literals(src))
    }
    assert not stray, f"Redis keys named outside {KEY_HOME} (add a function to core/infra/redis_keys.py): {stray}"


def test_every_namespace_is_named_in_its_home():
    home = "".join(src for rel, src in _sources() if rel.startswith(KEY_HOME))
    seen = {text.split(":")[0] for _, text in key_literals(home)}
    assert seen == set(NAMESPACES)


CELERY_HOME = "core/infra/broker.py"
CELERY_IMPORTERS = ("core/infra/", "workers/tasks.py")  # the app and its adapters; the task bodies


def celery_names() -> set[str]:
    """The task and queue names (and f-string heads, `spool.model.`) broker.py spells."""
    return {t for _, t in _texts((ROOT / CELERY_HOME).read_text()) if t.startswith("spool.")}


def celery_offences(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, what): a Celery name spelled (a string equal to one, or starting with a head such as
    `spool.model.`), or an import of celery or kombu."""
    found = [
        (line, t) for line, t in _texts(source) if t in names or any(t.startswith(n) for n in names if n[-1] == ".")
    ]
    for node in ast.walk(_parse(source)):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module]
        found += [(node.lineno, f"import {m}") for m in mods if m.split(".")[0] in ("celery", "kombu")]
    return sorted(found)


def test_the_celery_detector():
    names = celery_names()
    assert {"spool.run_job", "spool.run_jobs", "spool.deliver_webhook", "spool.webhooks", "spool.model."} <= names
    src = """
import celery
from kombu import Connection
a = "spool.run_job"
b = f"spool.model.{model}.interactive"
c = logging.getLogger("spool.access")
d = "spool.run_jobs_of_mine"
"""
    assert [line for line, _ in celery_offences(src, names)] == [2, 3, 4, 5]


def test_celery_names_are_spelled_in_the_broker():
    names = celery_names()
    stray = {
        rel: found
        for rel, src in _sources()
        if rel != CELERY_HOME and (found := celery_offences(src, names))
        if not (rel.startswith(CELERY_IMPORTERS) and all(w.startswith("import ") for _, w in found))
    }
    assert not stray, f"Celery names outside {CELERY_HOME}, or celery imported outside {CELERY_IMPORTERS}: {stray}"


GPU_HOME = "workers/engine/"
# The GPU proof kit runs on the GPU machine itself, outside the service: its probe and its model writer
# use torch (inside functions too, since the bundle and the CI dry run import them without CUDA).
GPU_HOMES = (GPU_HOME, "ops/gpu_proof/")
GPU_LIBS = ("torch", "exllamav2", "exllamav3", "flash_attn", "flashinfer")


def gpu_imports(source: str) -> list[tuple[int, str, bool]]:
    """(line, module, at module level) of every import of a GPU library."""
    tree = _parse(source)
    top = {id(n) for n in tree.body} | {
        id(m) for n in tree.body if isinstance(n, ast.If | ast.Try) for m in ast.walk(n) if isinstance(m, ast.stmt)
    }
    found = []
    for node in ast.walk(tree):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module]
        found += [(node.lineno, m, id(node) in top) for m in mods if m.split(".")[0] in GPU_LIBS]
    return sorted(found)


def test_the_gpu_import_detector():
    src = """
import torch
from exllamav2 import ExLlamaV2
try:
    import flash_attn
except ImportError:
    pass
def build():
    import exllamav3
    from torch import nn
import torchvision
"""
    assert gpu_imports(src) == [
        (2, "torch", True),
        (3, "exllamav2", True),
        (5, "flash_attn", True),
        (9, "exllamav3", False),
        (10, "torch", False),
    ]


def test_gpu_libraries_are_imported_only_inside_the_engine_adapters_when_built():
    """CONTRIBUTING.md: GPU libraries are imported only inside workers/engine/, and there only inside
    the function that builds an engine (they compile or load CUDA code at import, which fails
    without CUDA): never at a module's top level."""
    bad = {
        rel: found
        for rel, src in _sources()
        if (found := [f for f in gpu_imports(src) if not rel.startswith(GPU_HOMES) or f[2]])
    }
    assert not bad, f"GPU libraries imported outside {GPU_HOME}, or at a module's top level: {bad}"
    assert any(gpu_imports(src) for rel, src in _sources() if rel.startswith(GPU_HOME))  # the home is seen


# Schema changes: DDL on what lives inside the database (a database itself is created and dropped by
# core/infra/dbadmin.py and the test harness; a transaction's own TEMP table is no schema change).
_DDL = re.compile(
    r"^\s*(CREATE|ALTER|DROP)\s+(OR\s+REPLACE\s+)?(UNIQUE\s+)?(UNLOGGED\s+)?"
    r"(TABLE|INDEX|TRIGGER|FUNCTION|VIEW|TYPE|EXTENSION|SCHEMA|SEQUENCE|MATERIALIZED\s+VIEW)\b",
    re.IGNORECASE | re.MULTILINE,
)  # a statement starts a line of its string: "could not drop sequence %s" in a log line is none
_DDL_CALLS = {"create_all", "drop_all"}


def schema_changes(source: str) -> list[tuple[int, str]]:
    """(line, what) of every DDL string and every `metadata.create_all/drop_all` call."""
    found = [(line, t[:60]) for line, t in _texts(source) if _DDL.search(t)]
    for node in ast.walk(_parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _DDL_CALLS:
            found.append((node.lineno, f".{node.func.attr}()"))
    return sorted(found)


def test_the_schema_change_detector():
    src = """
conn.execute(text("ALTER TABLE jobs ADD COLUMN x int"))
cur.execute("create index ix_a on jobs (a)")
Base.metadata.create_all(engine)
cur.execute(f"DROP TABLE {name}")
cur.execute("CREATE OR REPLACE FUNCTION f() RETURNS trigger AS $$ $$ LANGUAGE plpgsql")
cur.execute("CREATE TEMP TABLE batch_staging (LIKE jobs INCLUDING DEFAULTS) ON COMMIT DROP")
conn.execute(text('CREATE DATABASE "spool"'))
self._drop_all()
log.warning("engine could not drop sequence %s", key)
"""
    assert [line for line, _ in schema_changes(src)] == [2, 3, 4, 5, 6]


def test_the_schema_changes_only_in_migrations():
    """README: migrations/ (Alembic) is the only way the schema changes."""
    stray = {rel: found for rel, src in _sources() if (found := schema_changes(src))}
    assert not stray, f"schema changed outside migrations/: {stray}"
    home = [p for p in sorted((ROOT / "migrations" / "versions").glob("*.py"))]
    assert any(schema_changes(p.read_text()) for p in home)  # the detector sees the home


def test_the_wire_detector():
    src = """
a = {"object": "list", "data": []}
b = {"type": "object", "properties": {}}
c = dict(object="model", id=1)
d = {**base, "object": kind}
"""
    assert wire_dicts(src) == [(2, "'list'"), (4, "'model'"), (5, "kind")]


# One planted violation of each kind of body, and near misses that are not bodies.
PLANTED = """
a = {"error": {"message": m, "type": t, "param": None, "code": c}}
b = JSONResponse({"error": err}, status_code=422)
c = dict(error=render.failure(row))
d = {"id": rid, "custom_id": job.custom_id, "response": None, "error": err}
e = {"status_code": 200, "request_id": job.id, "body": body}
f = {"tokens": ids}
g = {"tokens": [{"id": t, "piece": tok.token_text(t)} for t in ids]}
h = {"content": tok.decode(ids)}
i = {"type": "response.output_text.delta", "sequence_number": n, "delta": text}
j = json.dumps({"type": f"batch.{status}", "timestamp": now, "data": batch})
k = {"error": error[:2000], "t": time.time()}
l = [{**err, "ctx": {"error": e.msg}}]
m = {**out[0], "content": prompt}
n = {"role": "user", "content": text}
o = {"tokens": 1, "t": 2}
p = http.post("/tokenize", json={"content": text})
"""


def test_the_wire_detector_sees_a_planted_body_of_every_kind():
    found = wire_bodies(PLANTED)
    kinds = {line: kind for line, kind, _ in found}
    assert kinds == {
        2: "error envelope",
        3: "error envelope",
        4: "error envelope",
        5: "batch line",
        6: "batch line",
        7: "tokenize",
        8: "tokenize",  # the list's {"id", "piece"}: reported on its own line too
        9: "tokenize",
        10: "stream event",
        11: "webhook event",
    }, found
    assert [k for _, k, _ in found].count("tokenize") == 4  # line 8 holds two: the body and its items


def test_a_planted_body_outside_its_home_fails_the_rule():
    """The rule's own check, run on a tree that holds one stray body of each kind: every one is named."""
    planted = [(f"api/routes/x{n}.py", line) for n, line in enumerate(PLANTED.strip().splitlines()[:10])]
    assert sorted(_stray(planted)) == sorted(rel for rel, _ in planted)
    # render.py may build every kind but the two with a home of their own
    render_kinds = "\n".join(PLANTED.strip().splitlines()[:8])
    assert _stray([(WIRE_HOME, render_kinds)]) == {}
    assert sorted(k for _, k, _ in _stray([(WIRE_HOME, PLANTED)])[WIRE_HOME]) == ["stream event", "webhook event"]
    # each home may build its own kind only
    assert _stray([(OTHER_HOMES["webhook event"], 'a = {"type": t, "data": d}')]) == {}
    assert _stray([(OTHER_HOMES["webhook event"], 'a = {"error": e}')]) != {}
    assert _stray([(OTHER_HOMES["stream event"], 'a = {"object": "list"}')]) != {}


def _stray(sources: list[tuple[str, str]]) -> dict[str, list[tuple[int, str, str]]]:
    out: dict[str, list[tuple[int, str, str]]] = {}
    for rel, src in sources:
        if rel in WIRE_KNOWN:
            continue
        found = [f for f in wire_bodies(src) if home_of(f[1]) != rel]
        if found:
            out[rel] = found
    return out


def test_wire_bodies_are_built_in_their_home():
    stray = _stray(_sources())
    assert not stray, f"wire bodies built outside {WIRE_HOME} (or their named home, OTHER_HOMES): {stray}"
    home = wire_bodies((ROOT / WIRE_HOME).read_text())
    seen = {kind for _, kind, _ in home}
    assert seen == {"object", "error envelope", "batch line", "tokenize"}  # the detector sees the home too
    for kind, rel in OTHER_HOMES.items():
        assert kind in {k for _, k, _ in wire_bodies((ROOT / rel).read_text())}, (kind, rel)
