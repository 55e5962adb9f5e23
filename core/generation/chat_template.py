"""Chat prompts from the model's own Jinja template, rendered the way `transformers` does it.

The template comes from the model (the GGUF's `tokenizer.chat_template`, or a GPU folder's
`tokenizer_config.json` / `chat_template.jinja`) or an operator's override. It runs in Jinja's
immutable sandbox (no attribute writes, no unsafe calls), with `trim_blocks`/`lstrip_blocks`,
`raise_exception`, a `tojson` that keeps non-ASCII text, and `strftime_now`, as `transformers`
provides them; a template error is the client's 400 or the operator's, never a 500.

Tools: a template that knows them receives `tools` and assistant `tool_calls` as OpenAI's shapes.
For one that does not (SmolLM2's), Spool describes the tools in the system message and asks for
Hermes-style calls (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the format Qwen,
Hermes and SmolLM3 are trained on); past calls and tool results are written in the same format.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class ChatTemplateError(ValueError):
    """The template refused the conversation (its own `raise_exception`) or could not run."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def _compiled(source: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"The model's chat template does not compile: {exc}") from exc


def knows_tools(source: str) -> bool:
    return "tools" in source


def knows_tool_calls(source: str) -> bool:
    return "tool_calls" in source


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """How a template without tool support learns about the tools (Hermes' wording, shortened)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions you can call "
        f"are listed in <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
        "To call a function, answer with one JSON object per call, each inside <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def tool_call_text(calls: list[dict[str, Any]]) -> str:
    """Past assistant tool calls, written back the way the model is asked to write them."""
    out = []
    for c in calls:
        fn = c.get("function", {})
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        out.append(f"{TOOL_CALL_OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': args})}\n{TOOL_CALL_CLOSE}")
    return "\n".join(out)


def _generic_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, source: str) -> list[dict]:
    """Messages rewritten for a template that knows nothing of tools."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls") and not knows_tool_calls(source):
            text = tool_call_text(m.pop("tool_calls"))
            m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
        if m["role"] == "tool" and "tool" not in source.replace("tools", ""):
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
        out.append(m)
    if tools and not knows_tools(source):
        prompt = tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".strip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def render(
    source: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    extra: dict[str, Any] | None = None,
) -> str:
    """The prompt text for a conversation (special tokens as text: the tokenizer parses them)."""
    template = _compiled(source)
    msgs = _generic_tools(messages, tools, source)
    context: dict[str, Any] = {
        **(extra or {}),
        "messages": msgs,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
    }
    if tools and knows_tools(source):
        context["tools"] = tools
    try:
        return template.render(**context)
    except ChatTemplateError:
        raise
    except Exception as exc:  # the sandbox's SecurityError, a TypeError in the template, ...
        raise ChatTemplateError(f"The model's chat template failed on this conversation: {exc}") from exc


def parse_tool_calls(text: str, forced: list[str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """(the text outside tool calls, the calls) from a completion: every `<tool_call>` block whose
    body is a JSON object with a `name` (an unterminated last block counts: max_tokens may cut the
    closing tag); a bare JSON object {"name", "arguments"} as the whole answer counts too.

    `forced`: the functions a grammar forced the model to call (tool_choice named or "required").
    Then the text is nothing but calls, and one that max_tokens cut is still a call, with the
    arguments as far as they got (OpenAI and vLLM do the same), never markup in the content."""
    calls: list[dict[str, Any]] = []
    rest: list[str] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            rest.append(text[pos:])
            break
        rest.append(text[pos:start])
        end = _close_after_object(text, start + len(TOOL_CALL_OPEN))
        if end < 0 and forced is None:  # no whole JSON object there: the first closing tag ends the block
            end = text.find(TOOL_CALL_CLOSE, start)
        # Forced, the grammar closes a block only after a whole object: without one, the block is the
        # call max_tokens cut, to the end of the text, even where an unfinished argument string holds
        # "</tool_call>" (its arguments as far as they got, never "").
        body = text[start + len(TOOL_CALL_OPEN) : end if end >= 0 else len(text)]
        call = _call(body)
        if call is None and forced is not None and end < 0:
            call = _partial_call(body, forced)
        if call is None:
            rest.append(text[start : end + len(TOOL_CALL_CLOSE) if end >= 0 else len(text)])
        else:
            calls.append(call)
        if end < 0:
            break
        pos = end + len(TOOL_CALL_CLOSE)
    if forced is not None:
        # Outside the calls the grammar allows only the newlines between them and, at a cut, part
        # of the next opening tag; cut before any call's body, the call is known by its name alone.
        return "", calls or [_partial_call("", forced)]
    content = "".join(rest).strip()
    if not calls:
        bare = _call(text)
        if bare is not None:
            return "", [bare]
        return text, []
    return content, calls


def _close_after_object(text: str, at: int) -> int:
    """Where the closing tag that follows a whole JSON object starting at `at` begins, or -1. A
    string in the arguments may itself hold "</tool_call>" (a sampled model wrote one inside a city
    name): the block ends after the object, not at the first closing tag."""
    try:
        _, end = _DECODER.raw_decode(text, len(text) - len(text[at:].lstrip()))
    except (json.JSONDecodeError, ValueError):
        return -1
    close = len(text) - len(text[end:].lstrip())
    return close if text.startswith(TOOL_CALL_CLOSE, close) else -1


_DECODER = json.JSONDecoder()


def _call(body: str) -> dict[str, Any] | None:
    s = body.strip()
    try:
        obj, end = json.JSONDecoder().raw_decode(s)
    except (json.JSONDecodeError, ValueError):
        return None
    tail = s[end:].strip()
    if tail and not TOOL_CALL_CLOSE.startswith(tail):  # only a closing tag that max_tokens cut may follow
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}


# The shape the tool-call grammar (core/generation/constraints.py) forces, read up to wherever it was cut.
_PARTIAL_CALL = re.compile(
    r'\s*(?:\{\s*(?:"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)(?P<closed>")?(?:\s*,\s*"arguments"\s*:\s*(?P<args>.*))?)?)?',
    re.S,
)


def _partial_call(body: str, names: list[str]) -> dict[str, Any]:
    """A forced call that max_tokens cut: its name (completed from the offered functions when its
    prefix names one alone) and its arguments' text as generated."""
    m = _PARTIAL_CALL.match(body)
    raw = (m.group("name") if m else None) or ""
    try:
        name = json.loads('"' + raw.rstrip("\\") + '"')
    except json.JSONDecodeError:
        name = raw
    if not (m and m.group("closed")):
        candidates = [n for n in names if n.startswith(name)]
        name = candidates[0] if len(candidates) == 1 else name
    args = ((m.group("args") if m else None) or "").rstrip()
    whole = _whole_json(args)
    return {"name": name, "arguments": json.dumps(whole, ensure_ascii=False) if whole is not None else args}


def _whole_json(text: str) -> Any:
    """The JSON value `text` starts with, when it is complete (then the cut fell after it)."""
    try:
        return json.JSONDecoder().raw_decode(text)[0] if text else None
    except (json.JSONDecodeError, ValueError):
        return None
