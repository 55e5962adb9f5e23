"""Validate responses against the schemas of the reference OpenAI spec (tests/reference, in the repo).

The spec is OpenAPI 3.0 (`nullable: true`); it is rewritten to JSON Schema here. Two places where
OpenAI's live API itself sends null where the schema does not allow it are relaxed, explicitly:
`finish_reason` in stream chunks (null until a choice ends), `usage` in stream chunks (null but on
the last, with include_usage), and the first echoed prompt token's
`token_logprobs` / `top_logprobs` entries (nothing predicts it).
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema

SPEC = Path(__file__).resolve().parent / "reference" / "openai-openapi-subset.json"


def _nullable(node: Any) -> Any:
    if isinstance(node, dict):
        node = {k: _nullable(v) for k, v in node.items()}
        if node.pop("nullable", False):
            return {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    return node


@lru_cache
def _spec() -> dict[str, Any]:
    return _nullable(json.loads(SPEC.read_text()))


def schema(name: str, *, chunk: bool = False, echo: bool = False) -> dict[str, Any]:
    spec = _spec()
    s = copy.deepcopy(spec["components"]["schemas"][name])
    if name == "CreateCompletionResponse":
        choice = s["properties"]["choices"]["items"]["properties"]
        if chunk:
            choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
            # OpenAI's own stream sends `usage: null` on every chunk but the last (include_usage).
            s["properties"]["usage"] = {"anyOf": [s["properties"]["usage"], {"type": "null"}]}
        if echo:
            lp = choice["logprobs"]["anyOf"][0]["properties"]
            lp["token_logprobs"]["items"] = {"type": ["number", "null"]}
            lp["top_logprobs"]["items"] = {"anyOf": [lp["top_logprobs"]["items"], {"type": "null"}]}
    return {**s, "components": spec["components"]}


def validate(instance: Any, name: str, **kw: bool) -> None:
    jsonschema.validate(instance, schema(name, **kw))
