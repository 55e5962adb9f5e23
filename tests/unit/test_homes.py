"""Two "only here" rules of CONTRIBUTING.md, read from the source of api/, core/, workers/ and ops/:

- Redis key literals live in core/infra/ (core/infra/redis_keys.py, and core/infra/streams.py for
  the event stream's own keys): a string that starts with one of Spool's key namespaces anywhere
  else fails. Everyone else calls the functions there, so a key is spelled once.
- OpenAI-style wire objects (a dict with an "object" field: "list", "model", "tenant", ...) are
  built in core/protocol/render.py, the one module that knows wire shapes (the Responses API's
  `response` objects included: core/protocol/responses.py translates requests and numbers stream
  events, and builds no object of its own).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "core", "workers", "ops")

KEY_HOME = "core/infra/"
NAMESPACES = ("job", "rl", "spool", "ui")  # see core/infra/redis_keys.py
_KEY = re.compile(rf"^({'|'.join(NAMESPACES)}):(?!\s)")
# Files not yet moved to the rule, each with who moves it (none now: keep it so).
KEY_KNOWN: dict[str, str] = {}

WIRE_HOME = "core/protocol/render.py"
# Files not yet moved to the rule, each with who moves it (none now: keep it so).
WIRE_KNOWN: dict[str, str] = {}


def _sources() -> list[tuple[str, str]]:
    return [
        (p.relative_to(ROOT).as_posix(), p.read_text()) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
    ]


def key_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string, or f-string's leading text, that names a Redis key."""
    tree = ast.parse(source)
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            text = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts:
            text = node.value
        else:
            continue
        if _KEY.match(text):
            found.append((node.lineno, text))
    return sorted(found)


def wire_dicts(source: str) -> list[tuple[int, str]]:
    """(line, object) of every dict literal, or dict(object=...) call, with an "object" field."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values, strict=True):
                if isinstance(k, ast.Constant) and k.value == "object":
                    found.append((node.lineno, ast.unparse(v)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            found += [(node.lineno, ast.unparse(kw.value)) for kw in node.keywords if kw.arg == "object"]
    return sorted(found)


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


def test_the_wire_detector():
    src = """
a = {"object": "list", "data": []}
b = {"type": "object", "properties": {}}
c = dict(object="model", id=1)
d = {**base, "object": kind}
"""
    assert wire_dicts(src) == [(2, "'list'"), (4, "'model'"), (5, "kind")]


def test_wire_objects_are_built_in_render():
    stray = {
        rel: found
        for rel, src in _sources()
        if rel != WIRE_HOME and rel not in WIRE_KNOWN and (found := wire_dicts(src))
    }
    assert not stray, f"wire objects built outside {WIRE_HOME}: {stray}"
    assert len(wire_dicts((ROOT / WIRE_HOME).read_text())) >= 5  # the detector sees the home too
