"""Constrained decoding requests -> one llguidance grammar, validated at the edge.

Every form the seed documents accept (`grammar` as GBNF or mistral.rs's {type, value}, `json_schema`,
`response_format`, `regex`, `guided_choice`) becomes an llguidance grammar string here. Engines
then build an `LLMatcher` from it with their own tokenizer and mask each step's logits; that part
is shared too: workers/attempt.py builds one `LLMatcher` per sequence for every engine.
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

JSON_STYLE: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


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


def build(
    *,
    grammar: Any = None,
    json_schema: Any = None,
    response_format: dict[str, Any] | None = None,
    regex: str | None = None,
    guided_choice: list[str] | None = None,
) -> str | None:
    """The llguidance grammar for whichever one constraint the request carries (None: no constraint)."""
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


def tool_calls(tools: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
    """Lark source that forces Hermes-style calls to the given functions (`tool_choice` required or
    named): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, the arguments valid
    against the function's JSON schema; one call, or several when parallel calls are allowed."""
    if not tools:
        raise ConstraintError("tools", "No function to call.")
    variants = []
    for name, schema in tools:
        if not isinstance(schema, dict):
            raise ConstraintError("tools", f"The parameters of '{name}' must be a JSON Schema object.")
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": schema},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    body = variants[0] if len(variants) == 1 else {"anyOf": variants}
    body = {**body, "x-guidance": JSON_STYLE}
    start = r'start: call ("\n" call)*' if parallel else "start: call"
    lark = "\n".join([start, r'call: "<tool_call>\n" body "\n</tool_call>"', "body: %json " + json.dumps(body), ""])
    error = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark))
    if error:
        raise ConstraintError("tools", f"A function's parameters cannot be enforced: {error.strip()}")
    return lark
