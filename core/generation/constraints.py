"""Constrained decoding requests -> one llguidance grammar, validated at the edge.

Compiling a constraint costs more than linear time in its size (50k `guided_choice` strings took
7 s, 200k four minutes), so `check` bounds every constraint's size first, from the request's values
alone, before anything is compiled: the count and bytes of choices, the bytes of a grammar or a
regex, the bytes and nesting depth of a JSON schema (`Limits`; docs/parameters.md, "Limits on
constraints"). `build` checks them again before it compiles.

Every form the seed documents accept (`grammar` as GBNF or mistral.rs's {type, value}, `json_schema`,
`response_format`, `regex`, `guided_choice`) becomes an llguidance grammar string here. Engines
then build an `LLMatcher` from it with their own tokenizer and mask each step's logits; that part
is shared too: workers/attempt.py compiles one `LLMatcher` per job and gives each sequence a copy.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

JSON_STYLE: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# llguidance's Earley parser refuses a row of more than 2,000 items (`LLParserLimits.max_items_in_row`);
# `start: "a" | "b" | ...` puts the start item and one item per choice in its first row, so 2,000
# choices pass validation and then fail in the worker at the first token ("max is 2000"): 1,999 is
# the most llguidance accepts.
LLGUIDANCE_MAX_CHOICES = 1999


@dataclass(frozen=True)
class Limits:
    """The largest constraint a request may carry (the settings `max_guided_choices`, ...)."""

    choices: int = LLGUIDANCE_MAX_CHOICES  # entries of `guided_choice`
    choice_bytes: int = 64 * 1024  # UTF-8 bytes of all `guided_choice` entries together
    grammar_bytes: int = 64 * 1024  # a `grammar`'s text (GBNF or lark)
    regex_bytes: int = 4 * 1024  # a `regex` (or grammar {type: regex})
    schema_bytes: int = 64 * 1024  # a JSON schema, as compact JSON (also a forced tool call's schemas)
    schema_depth: int = 32  # nested objects and arrays in a JSON schema document


DEFAULT_LIMITS = Limits()


class ConstraintError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))  # lone surrogates are refused later, by name


def _too_large(param: str, what: str, size: int, limit: int, unit: str = "bytes") -> ConstraintError:
    return ConstraintError(
        param, f"'{param}' is too large: {what} is {size} {unit}; the limit is {limit}. Use a smaller constraint."
    )


def _depth_over(value: Any, limit: int) -> bool:
    """Whether `value` nests objects and arrays deeper than `limit` (iterative: no recursion limit)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if d > limit:
            return True
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _json_depth_over(text: str, limit: int) -> bool:
    """`_depth_over` of a JSON document's text, without parsing it (json.loads recurses)."""
    depth, in_str, esc = 0, False, False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def check_schema(schema: Any, param: str, limits: Limits) -> None:
    """A JSON schema (an object, or its JSON text) within `schema_depth` and `schema_bytes`."""
    if isinstance(schema, str):
        if _nbytes(schema) > limits.schema_bytes:
            raise _too_large(param, "the JSON schema", _nbytes(schema), limits.schema_bytes)
        if _json_depth_over(schema, limits.schema_depth):
            raise _too_large(param, "the JSON schema's nesting", limits.schema_depth + 1, limits.schema_depth, "levels")
        return
    if _depth_over(schema, limits.schema_depth):
        raise _too_large(param, "the JSON schema's nesting", limits.schema_depth + 1, limits.schema_depth, "levels")
    try:
        size = _nbytes(json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
    except (TypeError, ValueError):
        return  # not JSON: `build` names it
    if size > limits.schema_bytes:
        raise _too_large(param, "the JSON schema", size, limits.schema_bytes)


def check_choices(choices: Any, limits: Limits) -> None:
    if not isinstance(choices, list):
        return
    if len(choices) > limits.choices:
        raise ConstraintError(
            "guided_choice",
            f"'guided_choice' has {len(choices)} entries; the limit is {limits.choices}"
            + (" (what llguidance accepts)." if limits.choices >= LLGUIDANCE_MAX_CHOICES else "."),
        )
    size = sum(_nbytes(c) for c in choices if isinstance(c, str))
    if size > limits.choice_bytes:
        raise _too_large("guided_choice", "the total of its entries", size, limits.choice_bytes)


def _check_text(param: str, what: str, text: Any, limit: int) -> None:
    if isinstance(text, str) and _nbytes(text) > limit:
        raise _too_large(param, what, _nbytes(text), limit)


def _check_one(param: str, value: Any, limits: Limits) -> None:
    if param == "guided_choice":
        check_choices(value, limits)
    elif param == "regex":
        _check_text(param, "the regex", value, limits.regex_bytes)
    elif param == "json_schema":
        check_schema(value, param, limits)
    elif param == "grammar":
        if isinstance(value, str):
            _check_text(param, "the grammar", value, limits.grammar_bytes)
        elif isinstance(value, dict):
            kind, body = value.get("type"), value.get("value")
            if kind == "json_schema":
                check_schema(body, param, limits)
            elif kind == "regex":
                _check_text(param, "the regex", body, limits.regex_bytes)
            else:
                _check_text(param, "the grammar", body, limits.grammar_bytes)
    elif param == "response_format" and isinstance(value, dict):
        inner = value.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else value.get("schema")
        if schema is not None:
            check_schema(schema, param, limits)


def _single_to_double_quotes(gbnf: str) -> str:
    """GBNF literals are double-quoted; llama.cpp's own docs also show 'x'. Rewrite those, leaving
    double-quoted strings, character classes and comments untouched."""
    out: list[str] = []
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c in '"[':
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < n and gbnf[j] != close:
                j += 2 if gbnf[j] == "\\" else 1
            out.append(gbnf[i : j + 1])
            i = j + 1
        elif c == "#":
            j = gbnf.find("\n", i)
            j = n if j < 0 else j
            out.append(gbnf[i:j])
            i = j
        elif c == "'":
            j = i + 1
            buf: list[str] = []
            while j < n and gbnf[j] != "'":
                if gbnf[j] == "\\" and j + 1 < n:
                    buf.append(gbnf[j : j + 2])
                    j += 2
                    continue
                buf.append('\\"' if gbnf[j] == '"' else gbnf[j])
                j += 1
            out.append('"' + "".join(buf) + '"')
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def from_gbnf(gbnf: str) -> str:
    try:
        return LLMatcher.grammar_from_lark(gbnf_to_lark(_single_to_double_quotes(gbnf)))
    except GbnfToLarkError as exc:
        raise ConstraintError("grammar", f"Invalid GBNF grammar: {exc}") from exc


def from_json_schema(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ConstraintError(param, f"'{param}' is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise ConstraintError(param, f"'{param}' must be a JSON Schema object.")
    try:
        # Compact JSON (", " and ": " only): with free whitespace small models pad with spaces
        # and newlines until max_tokens runs out.
        return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
    except Exception as exc:  # llguidance raises plain ValueError/RuntimeError for bad schemas
        raise ConstraintError(param, f"Invalid JSON schema in '{param}': {exc}") from exc


def from_choices(choices: list[str]) -> str:
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise ConstraintError("guided_choice", "'guided_choice' must be a non-empty list of non-empty strings.")
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _given(
    grammar: Any, json_schema: Any, response_format: dict[str, Any] | None, regex: str | None, guided_choice: Any
) -> tuple[str, Any] | None:
    """The one constraint a request carries, as (parameter, value); None: none."""
    given = {
        k: v
        for k, v in {
            "grammar": grammar,
            "json_schema": json_schema,
            "regex": regex,
            "guided_choice": guided_choice,
        }.items()
        if v is not None
    }
    if response_format is not None and response_format.get("type", "text") != "text":
        given["response_format"] = response_format
    if len(given) > 1:
        raise ConstraintError(sorted(given)[1], f"Only one output constraint per request; got {sorted(given)}.")
    if not given:
        return None
    ((param, value),) = given.items()
    return param, value


def check(
    *,
    grammar: Any = None,
    json_schema: Any = None,
    response_format: dict[str, Any] | None = None,
    regex: str | None = None,
    guided_choice: list[str] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> tuple[str, Any] | None:
    """Refuse, naming the parameter, a request with more than one constraint or one over `limits`;
    cheap (nothing is compiled). Returns the constraint, (parameter, value); None: there is none."""
    given = _given(grammar, json_schema, response_format, regex, guided_choice)
    if given is not None:
        _check_one(*given, limits)
    return given


def build(*, limits: Limits = DEFAULT_LIMITS, **constraint: Any) -> str | None:
    """The llguidance grammar for whichever one constraint the request carries (`check`'s keyword
    arguments; None: no constraint), its size checked (`check`) before it is compiled."""
    given = check(**constraint, limits=limits)
    return None if given is None else compiled(*given)


class Cache:
    """Compiled constraints (and refusals) by the constraint's canonical text, least recently used
    dropped past `entries`: a batch's 50k lines that carry one schema compile it once, not 50k times
    (core/batches/ingest.py holds one per validation). The grammar does not depend on the model: an
    llguidance grammar is bound to a tokenizer only when a worker builds its matcher."""

    def __init__(self, entries: int = 256) -> None:
        self.entries = entries
        self.held: OrderedDict[str, str | ConstraintError] = OrderedDict()

    @staticmethod
    def key(param: str, value: Any) -> str | None:
        # Keys keep their order: a JSON schema's property order is the order its grammar emits them in.
        try:
            return param + "\0" + json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError):
            return None

    def get(self, key: str) -> str | ConstraintError | None:
        hit = self.held.get(key)
        if hit is not None:
            self.held.move_to_end(key)
        return hit

    def put(self, key: str, out: str | ConstraintError) -> None:
        self.held[key] = out
        while len(self.held) > self.entries:
            self.held.popitem(last=False)


_cache: ContextVar[Cache | None] = ContextVar("spool_constraint_cache", default=None)


@contextmanager
def caching(cache: Cache) -> Iterator[Cache]:
    """`compiled` answers from `cache` inside the block (this thread's context only)."""
    token = _cache.set(cache)
    try:
        yield cache
    finally:
        _cache.reset(token)


def compiled(param: str, value: Any) -> str:
    """The llguidance grammar of one constraint that `check` passed, as it returned it (parameter, value);
    from the `caching` block's cache when there is one."""
    cache = _cache.get()
    key = None if cache is None else Cache.key(param, value)
    if cache is None or key is None:
        return _compile(param, value)
    hit = cache.get(key)
    if isinstance(hit, ConstraintError):
        raise ConstraintError(hit.param, str(hit))  # a fresh one each time: never the cached one's traceback
    if hit is not None:
        return hit
    try:
        out = _compile(param, value)
    except ConstraintError as exc:
        cache.put(key, ConstraintError(exc.param, str(exc)))  # without the frames the raised one holds
        raise
    cache.put(key, out)
    return out


def _compile(param: str, value: Any) -> str:
    try:
        # Every string of the value must be encodable: a lone surrogate ("\ud800") cannot cross into
        # llguidance's Rust strings, and json.dumps' ASCII escapes would otherwise smuggle one through.
        json.dumps(value, ensure_ascii=False).encode()
        if param == "grammar":
            out = _grammar_param(value)
        elif param == "json_schema":
            out = from_json_schema(value, "json_schema")
        elif param == "regex":
            out = LLMatcher.grammar_from_regex(value)
        elif param == "guided_choice":
            out = from_choices(value)
        else:
            out = _response_format(value)
        error = LLMatcher.validate_grammar(out)
    except UnicodeError as exc:
        raise ConstraintError(param, f"'{param}' must be valid Unicode text (no lone surrogates).") from exc
    if error:
        raise ConstraintError(param, f"Invalid '{param}': {error.strip()}")
    return out


def _grammar_param(value: Any) -> str:
    if isinstance(value, str):
        return from_gbnf(value)
    if isinstance(value, dict) and set(value) <= {"type", "value"} and "type" in value:
        kind, body = value["type"], value.get("value")
        if kind in ("regex", "lark", "gbnf") and not isinstance(body, str):
            raise ConstraintError("grammar", f"grammar.value must be a string for type '{kind}'.")
        text = body if isinstance(body, str) else ""
        if kind == "regex":
            return LLMatcher.grammar_from_regex(text)
        if kind == "lark":
            return LLMatcher.grammar_from_lark(text)
        if kind == "gbnf":
            return from_gbnf(text)
        if kind == "json_schema":
            return from_json_schema(body, "grammar")
        raise ConstraintError("grammar", f"Unknown grammar type '{kind}' (regex, lark, gbnf or json_schema).")
    raise ConstraintError("grammar", "'grammar' must be a GBNF string or an object {type, value}.")


def _response_format(value: dict[str, Any]) -> str:
    kind = value.get("type")
    if kind == "json_object":
        extra = set(value) - {"type", "schema"}
        if extra:
            raise ConstraintError("response_format", f"Unknown response_format fields: {sorted(extra)}.")
        return from_json_schema(value.get("schema") or {"type": "object"}, "response_format")
    if kind == "json_schema":  # OpenAI's chat form: {"type": "json_schema", "json_schema": {"schema": ...}}
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise ConstraintError("response_format", "response_format.json_schema.schema is required.")
        return from_json_schema(inner["schema"], "response_format")
    raise ConstraintError("response_format", f"Unknown response_format type '{kind}' (text, json_object, json_schema).")


# Keywords whose values are one subschema, a list of them, or a name -> subschema map.
_ONE_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "unevaluatedProperties")
_SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def _subschemas(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(keyword, where, subschema) for every subschema directly inside `schema`."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    for kw in _ONE_SCHEMA:
        v = schema.get(kw)
        if isinstance(v, dict):
            out.append((kw, kw, v))
        elif kw == "items" and isinstance(v, list):  # draft 4's tuple form
            out += [(kw, f"{kw}[{i}]", x) for i, x in enumerate(v) if isinstance(x, dict)]
    for kw in _SCHEMA_LIST:
        v = schema.get(kw)
        if isinstance(v, list):
            out += [(kw, f"{kw}[{i}]", x) for i, x in enumerate(v) if isinstance(x, dict)]
    for kw in _SCHEMA_MAP:
        v = schema.get(kw)
        if isinstance(v, dict):
            out += [(kw, f"{kw}.{k}", x) for k, x in v.items() if isinstance(x, dict)]
    return out


def _is_object(schema: dict[str, Any]) -> bool:
    t = schema.get("type")
    return t == "object" or (isinstance(t, list) and "object" in t) or "properties" in schema


def closed_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of a function's parameters in which an object that declares `properties` admits only
    those keys unless it says otherwise (`additionalProperties` or `patternProperties` given).

    JSON Schema's default admits any other key, so a grammar built from the schema as written lets a
    small model invent keys until `max_tokens` runs out. llama.cpp's grammar (json-schema-to-grammar)
    admits only declared keys, and OpenAI's strict function calling requires `additionalProperties:
    false`: Spool does the same for tool calls. An object directly inside `allOf` is left as written
    (closing each part would refuse the keys the other parts declare). Iterative: the depth was
    bounded by `check_schema` first, but a list of work keeps the stack flat anyway."""
    root = json.loads(json.dumps(schema))  # a deep copy of plain JSON
    work: list[tuple[dict[str, Any], bool]] = [(root, True)]
    while work:
        node, may_close = work.pop()
        if (
            may_close
            and "properties" in node
            and "additionalProperties" not in node
            and "patternProperties" not in node
        ):
            node["additionalProperties"] = False
        work += [(sub, kw != "allOf") for kw, _, sub in _subschemas(node)]
    return root


# OpenAI's strict mode (Structured Outputs, "Supported schemas"): composition it does not support.
_STRICT_UNSUPPORTED = ("allOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas")


def strict_schema_problem(schema: Any) -> str | None:
    """Why a function's `parameters` is not a valid strict schema as OpenAI defines it (None: it is):
    the root is an object (`type: "object"`, not `anyOf`); every object sets `additionalProperties:
    false` and lists every key of its `properties` in `required`; no `allOf`, `not`, `if`/`then`/
    `else`, `dependentRequired`, `dependentSchemas`. `$defs` and `$ref` are allowed."""
    if not isinstance(schema, dict):
        return "the parameters must be a JSON Schema object"
    if schema.get("type") != "object" or "anyOf" in schema:
        return "the root must be 'type: \"object\"' (not anyOf)"
    work: list[tuple[dict[str, Any], str]] = [(schema, "parameters")]
    while work:
        node, where = work.pop()
        bad = [k for k in _STRICT_UNSUPPORTED if k in node]
        if bad:
            return f"'{bad[0]}' is not supported in strict mode (at {where})"
        if _is_object(node):
            if node.get("additionalProperties") is not False:
                return f"'additionalProperties' must be supplied and be false (at {where})"
            props = node.get("properties") or {}
            required = node.get("required") or []
            missing = [k for k in props if not isinstance(required, list) or k not in required]
            if missing:
                return f"'required' must list every key in 'properties'; missing '{missing[0]}' (at {where})"
        work += [(sub, f"{where}.{at}") for _, at, sub in _subschemas(node)]
    return None


def tool_calls(
    tools: list[tuple[str, dict[str, Any]]], parallel: bool, limits: Limits = DEFAULT_LIMITS, validate: bool = True
) -> str:
    """Lark source that forces Hermes-style calls to the given functions (`tool_choice` required or
    named): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, the arguments valid
    against the function's JSON schema, whose objects admit only the keys they declare unless they
    say otherwise (`closed_schema`); one call, or several when parallel calls are allowed. The
    functions' schemas are held to the JSON schema limits (together) before anything is compiled;
    `validate=False` leaves compiling to whoever compiles the grammar next."""
    if not tools:
        raise ConstraintError("tools", "No function to call.")
    size = 0
    for _, schema in tools:
        check_schema(schema, "tools", limits)
        try:
            size += _nbytes(json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
        except (TypeError, ValueError):
            pass
        if size > limits.schema_bytes:
            raise _too_large("tools", "the functions' parameter schemas", size, limits.schema_bytes)
    variants = []
    # A function's `$defs` (`definitions`) move to the grammar's root, where its "#/$defs/..." refs point.
    defs: dict[str, dict[str, Any]] = {}
    for name, schema in tools:
        if not isinstance(schema, dict):
            raise ConstraintError("tools", f"The parameters of '{name}' must be a JSON Schema object.")
        arguments = closed_schema(schema)
        for key in ("$defs", "definitions"):
            found = arguments.get(key)
            if not isinstance(found, dict):
                continue  # not a map of definitions: llguidance names the problem when it compiles
            del arguments[key]
            for def_name, d in found.items():
                if defs.setdefault(key, {}).setdefault(def_name, d) != d:
                    raise ConstraintError("tools", f"Two functions define '{key}/{def_name}' differently.")
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    body = variants[0] if len(variants) == 1 else {"anyOf": variants}
    body = {**body, **defs, "x-guidance": JSON_STYLE}
    start = r'start: call ("\n" call)*' if parallel else "start: call"
    lark = "\n".join([start, r'call: "<tool_call>\n" body "\n</tool_call>"', "body: %json " + json.dumps(body), ""])
    error = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark)) if validate else None
    if error:
        raise ConstraintError("tools", f"A function's parameters cannot be enforced: {error.strip()}")
    return lark
