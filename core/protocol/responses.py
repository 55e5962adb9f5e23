"""OpenAI's Responses API (`/v1/responses`): a chat job with another wire shape.

The request becomes a `ChatCompletionRequest` (its input items and the stored chain of
`previous_response_id` as chat messages, its settings as chat's fields), so it runs through the one
chat translation (core/protocol/translate.py): the same `GenerationParams`, the same prompt through
the model's chat template, the same bounds and 400s. What only the Responses API knows (its
settings to echo, the input items to list and chain) rides on the job's `chat` column under
`response` (`meta`). A finished job is rendered as a `response` object from its chat completion
(core/protocol/render.py); its events as typed stream events numbered by `sequence_number` (`Events`,
the one place besides render.py that builds a wire shape: each event wraps render's objects and
items), a pure function of the job's event sequence, so every API process numbers a stream alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from core.errors import DomainError, invalid
from core.generation.events import Cancelled, Delta, Done, Event, Failed, error_of, usage_of
from core.protocol import render, sdk_params
from core.protocol.errors import from_validation
from core.protocol.render import JOB_PREFIX, RESPONSE_PREFIX
from core.protocol.render import response_item_id as _item_id
from core.protocol.render import response_meta as meta_of
from core.protocol.schemas import (
    ChatCompletionRequest,
    Float,
    Int,
    Moderation,
    ServiceTier,
    metadata_problem,
)
from core.protocol.schemas import PromptCacheOptions as _ChatPromptCacheOptions
from core.states import JobState

# The most items one request's `input` may hold.
MAX_INPUT_ITEMS = 2048


def job_id_of(resp_id: str) -> str | None:
    """The job behind a response id, or None when it is not one Spool gives out."""
    if not resp_id.startswith(RESPONSE_PREFIX):
        return None
    rest = resp_id[len(RESPONSE_PREFIX) :]
    if not (0 < len(rest) <= 64) or not all(c in "0123456789abcdef" for c in rest):
        return None
    return JOB_PREFIX + rest


# -- the request -----------------------------------------------------------------------------------

_ShortStr = Annotated[str, Field(max_length=256)]


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class PromptCacheOptions(_ChatPromptCacheOptions):
    ttl: Literal["30m", "12h"] | None = None  # type: ignore[assignment]
    comparison_response_id: _ShortStr | None = None
    prewarm: bool | None = None  # true is refused (`_check`)


class BackgroundOptions(_Part):
    completion_window: Literal["soonest", "2h", "8h"] | None = None
    continuation_id: _ShortStr | None = None


class AccessPrograms(_Part):
    cyber: Literal["standard", "daybreak_blue", "daybreak_red"] | None = None


class ImageOptions(_Part):
    context_compression: Literal["auto", "enabled", "disabled"] | None = None


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`. Items, tools and formats are checked by `to_chat`, which names the exact
    place (`input[2].content[0].type`) of what Spool cannot do."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_INPUT_ITEMS)] | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[Float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Float, Field(ge=0, le=1)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    background: bool | None = None
    previous_response_id: Annotated[str, Field(max_length=128)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: Annotated[list[str], Field(max_length=16)] | None = None
    top_logprobs: Annotated[Int, Field(ge=0, le=20)] | None = None
    user: _ShortStr | None = None
    safety_identifier: _ShortStr | None = None
    prompt_cache_key: _ShortStr | None = None
    service_tier: ServiceTier | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: Annotated[Int, Field(ge=1)] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    # Accepted with no effect here (sdk_params.RESPONSES says why), validated as OpenAI does
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    moderation: Moderation | None = None
    background_options: BackgroundOptions | None = None
    access_programs: AccessPrograms | None = None
    image: ImageOptions | None = None


# Fields of chat a Responses body may also carry (Spool's sampling extensions, as on chat); the rest
# of chat's fields have a Responses name (`max_output_tokens`, `text.format`, ...) or no meaning here.
_NOT_FORWARDED = (
    frozenset(
        {
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "n",
            "stream",
            "stream_options",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "response_format",
            "logprobs",
            "top_logprobs",
            "user",
            "temperature",
            "top_p",
            "add_generation_prompt",
            "continue_final_message",
        }
    )
    | sdk_params.CHAT_SDK_EXTRAS
)
FORWARDED = frozenset(set(ChatCompletionRequest.model_fields) - _NOT_FORWARDED)
# Parts of the Responses API Spool does not have: refused by name (a 400), never ignored.
# The SDK's refused ones, in sdk_params.RESPONSES' words; chat's audio fields, which Responses lacks.
_UNSUPPORTED_FIELDS = {
    **{n: sdk_params.refusal(sdk_params.RESPONSES, n) for n in sdk_params.refused(sdk_params.RESPONSES)},
    "modalities": "Spool's models produce text only; 'modalities' is not supported.",
    "audio": "Spool's models produce text only; 'audio' is not supported.",
}
_INCLUDE_OK = frozenset({"message.output_text.logprobs"})
_HOSTED_TOOLS = "web_search, file_search, code_interpreter, computer use, image generation, MCP and shell"


class ResponseChat(ChatCompletionRequest):
    """The chat request a Responses request becomes, carrying what the job stores for it (`meta`)."""

    _response: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def response(self) -> dict[str, Any]:
        return self._response


def unknown_fields(req: ResponsesRequest) -> list[str]:
    """Fields neither Responses nor chat's extensions know (the route refuses them, or ignores them
    as the deployment says)."""
    return sorted(k for k in (req.model_extra or {}) if k not in FORWARDED and k not in _UNSUPPORTED_FIELDS)


def _text_of(content: Any, where: str, allowed: Sequence[str]) -> str:
    """A message's content (a string or a list of text parts) as its text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "A message's 'content' must be a string or a list of content parts.")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise invalid(f"{where}.content[{j}]", "A content part must be an object.")
        kind = part.get("type")
        if kind in ("input_image", "input_file", "input_audio", "image_url"):
            raise invalid(
                f"{where}.content[{j}].type",
                f"Spool serves text models: '{kind}' content is not supported.",
                "unsupported_parameter",
            )
        if kind not in allowed:
            raise invalid(
                f"{where}.content[{j}].type", f"Unknown content part type {kind!r}; expected {list(allowed)}."
            )
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}.content[{j}].text", "A text part needs its 'text' as a string.")
        out.append(text)
    return "".join(out)


def items_to_messages(items: Sequence[dict[str, Any]], where: str = "input") -> list[dict[str, Any]]:
    """Responses items (input, or a stored response's output) as chat messages: messages as they
    are, `function_call`s as an assistant's `tool_calls` (consecutive calls in one message), and
    `function_call_output`s as `tool` messages."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise invalid(at, "An input item must be an object.")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{at}.role", f"Invalid role {role!r}: expected user, system, developer or assistant.")
            allowed = ("output_text", "refusal", "input_text") if role == "assistant" else ("input_text", "text")
            out.append({"role": role, "content": _text_of(item.get("content"), at, allowed)})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            for field, value in (("call_id", call_id), ("name", name), ("arguments", args)):
                if not isinstance(value, str):
                    raise invalid(f"{at}.{field}", f"A 'function_call' item needs '{field}' as a string.")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise invalid(f"{at}.call_id", "A 'function_call_output' item needs the 'call_id' it answers.")
            text = output if isinstance(output, str) else _text_of(output, at, ("input_text", "text"))
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue  # no reasoning is produced here; a client that echoes one back loses nothing
        elif kind == "item_reference":
            raise invalid(f"{at}.type", "'item_reference' items are not supported; send the item itself.")
        else:
            raise invalid(
                f"{at}.type",
                f"Input items of type {kind!r} are not supported: Spool runs no hosted tools ({_HOSTED_TOOLS}).",
                "unsupported_parameter",
            )
    return out


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as a list of items (a string is one user message)."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return list(req.input)


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    out = []
    for i, t in enumerate(req.tools):
        kind = t.get("type")
        if kind != "function":
            raise invalid(
                f"tools[{i}].type",
                f"Tool type {kind!r} is not supported: Spool runs no hosted tools ({_HOSTED_TOOLS}); "
                "only 'function' tools are.",
                "unsupported_parameter",
            )
        extra = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
        if extra:
            raise invalid(f"tools[{i}].{extra[0]}", f"Unrecognized tool field: {extra[0]}", "unknown_parameter")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function":
        extra = sorted(set(choice) - {"type", "name"})
        if extra or not isinstance(choice.get("name"), str):
            raise invalid("tool_choice", "A function 'tool_choice' is {'type': 'function', 'name': ...}.")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid(
        "tool_choice.type",
        f"tool_choice of type {kind!r} is not supported; use 'none', 'auto', 'required' or a function.",
        "unsupported_parameter",
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if not text:
        return None
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise invalid(f"text.{extra[0]}", f"Unrecognized field text.{extra[0]}", "unknown_parameter")
    if text.get("verbosity") not in (None, "low", "medium", "high"):
        raise invalid("text.verbosity", "'text.verbosity' must be one of 'low', 'medium' or 'high'.")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid("text.format", "'text.format' must be an object with a 'type'.")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format.schema", "A 'json_schema' format needs its 'schema' as an object.")
        if not isinstance(fmt.get("name"), str):
            raise invalid("text.format.name", "A 'json_schema' format needs a 'name'.")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise invalid("text.format.type", f"Unknown text format {kind!r}: expected text, json_object or json_schema.")


_REASONING = {
    "effort": ("none", "minimal", "low", "medium", "high", "xhigh"),
    "summary": ("auto", "concise", "detailed"),
    "generate_summary": ("auto", "concise", "detailed"),
}


def _check(req: ResponsesRequest, model: str) -> None:
    for name in sorted(_UNSUPPORTED_FIELDS):
        if name in (req.model_extra or {}):
            raise invalid(name, _UNSUPPORTED_FIELDS[name], "unsupported_parameter")
    problem = metadata_problem(req.metadata)
    if problem:
        raise invalid("metadata", problem)
    if req.prompt_cache_options is not None and req.prompt_cache_options.prewarm:
        why = sdk_params.refusal(sdk_params.RESPONSES, "prompt_cache_options")
        raise invalid("prompt_cache_options.prewarm", why, "unsupported_parameter")
    if req.background and req.store is False:
        raise invalid("background", "A background response must be stored: 'background' needs 'store' not false.")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is enabled.")
    # Validated and echoed, with no effect: the model does not reason, so there is nothing to bound or
    # summarize, and ignoring them changes no answer (chat's `reasoning_effort` alike: sdk_params).
    reasoning = req.reasoning or {}
    for key in sorted(set(reasoning) - set(_REASONING)):
        raise invalid(f"reasoning.{key}", f"Unrecognized field reasoning.{key}", "unknown_parameter")
    for key, allowed in _REASONING.items():
        if reasoning.get(key) is not None and reasoning[key] not in allowed:
            raise invalid(f"reasoning.{key}", f"'reasoning.{key}' must be one of {', '.join(map(repr, allowed))}.")
    for name in req.include or ():
        if name not in _INCLUDE_OK:
            raise invalid("include", f"include value {name!r} is not supported here.", "unsupported_parameter")
    if req.input is None and req.previous_response_id is None:
        raise invalid("input", "You must provide an 'input' parameter.", "missing_parameter")


def meta(req: ResponsesRequest) -> dict[str, Any]:
    """What the job keeps of the request for the Responses API alone: the settings it echoes, and
    (when stored) its input items, for `input_items` and for chains of `previous_response_id`."""
    text = req.text if req.text and req.text.get("format") else {"format": {"type": "text"}}
    stored = req.store is not False
    out = {
        "instructions": req.instructions,
        "metadata": req.metadata or {},
        "tools": [{**t, "strict": t.get("strict", True)} for t in req.tools or []],
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": text,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "previous_response_id": req.previous_response_id,
        "store": stored,
        "background": bool(req.background),
        "truncation": req.truncation or "disabled",
        "top_logprobs": req.top_logprobs or 0,
        "user": req.user,
        "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": (req.reasoning or {}).get("summary")},
        "service_tier": req.service_tier,  # what was asked; the response echoes `render.service_tier`
        "input": input_items(req) if stored else [],
    }
    if "\\u0000" in json.dumps(out):
        # jobs.chat is JSONB, which cannot hold a NUL character: refused here, never a failed INSERT.
        raise invalid("input", "The request holds a NUL character (\\u0000), which Spool cannot store.")
    return out


def to_chat(req: ResponsesRequest, earlier: list[dict[str, Any]], model: str) -> ResponseChat:
    """A Responses request as the chat request it runs as. `earlier`: the chain of its
    `previous_response_id` as chat messages, oldest first (`chain_messages`). Raises 400s naming
    the Responses field."""
    _check(req, model)
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages += earlier
    messages += items_to_messages(input_items(req))
    if not messages:
        raise invalid("input", "The input holds no messages.", "missing_parameter")
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    for name in FORWARDED & set(req.model_extra or {}):
        body[name] = (req.model_extra or {})[name]
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "stream", "user", "service_tier", "prompt_cache_key"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    tools = _tools(req)
    if tools:
        body["tools"] = tools
    choice = _tool_choice(req.tool_choice)
    if choice is not None and (tools or choice != "auto"):
        body["tool_choice"] = choice
    fmt = _response_format(req.text)
    if fmt is not None:
        body["response_format"] = fmt
    if req.top_logprobs is not None or "message.output_text.logprobs" in (req.include or ()):
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if req.truncation == "auto":
        body["truncate_sequence"] = True
    try:
        chat = ResponseChat.model_validate(body)
    except ValidationError as exc:
        raise rename(from_validation(exc.errors())) from exc
    chat._response = meta(req)
    return chat


_RENAMED = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "grammar": "text.format",
    "prompt": "input",
}


def rename(exc: DomainError) -> DomainError:
    """An error of the chat translation, naming the Responses request's own field."""
    if exc.param:
        head, dot, rest = exc.param.partition(".")
        if head in _RENAMED:
            exc.param = _RENAMED[head] if head == "messages" else _RENAMED[head] + dot + rest
    return exc


# -- the objects answered, as /openapi.json describes them ------------------------------------------
# render.py builds them as dicts (response_object, response_deleted, page); these models only document
# them (each route's `responses`), so a model that lags the renderer allows the extra keys.


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class OutputText(_Answer):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[dict[str, Any]]


class OutputMessage(_Answer):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCall(_Answer):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseUsage(_Answer):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseError(_Answer):
    code: str
    message: str


class ResponseObject(_Answer):
    """OpenAI's `response` object (render.response_object): a job in whatever state it is."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    background: bool
    completed_at: int | None
    error: ResponseError | None
    incomplete_details: dict[str, Any] | None
    instructions: str | list[dict[str, Any]] | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    model: str
    output: list[OutputMessage | FunctionCall]
    parallel_tool_calls: bool
    previous_response_id: str | None
    prompt_cache_key: str | None
    reasoning: dict[str, Any]
    safety_identifier: str | None
    service_tier: str
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_logprobs: int
    top_p: float | None
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, Any]


class ResponseDeleted(_Answer):
    id: str
    object: Literal["response"]
    deleted: bool


class InputItem(_Answer):
    """One of a response's input items as listed (input_item_list): the client's item, with an id."""

    id: str
    type: str


class InputItemList(_Answer):
    object: Literal["list"]
    data: list[InputItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


# -- reading a stored response -------------------------------------------------------------------
# Its `response` object, output items and usage are built in core/protocol/render.py (`response_of`,
# the one home of wire objects); here, what a chain and `input_items` read of it.


def chain_messages(job: render.JobRecord) -> list[dict[str, Any]]:
    """One stored response as chat messages: its input items, then what it answered."""
    out = items_to_messages(meta_of(job).get("input") or [], "previous_response_id")
    if job.state == JobState.succeeded:
        out += items_to_messages(render.response_output(job)[0], "previous_response_id")
    return out


def input_item_list(job: render.JobRecord) -> list[dict[str, Any]]:
    """A stored response's input items as OpenAI lists them: each with an id (kept if it came
    with one) and, for messages, content parts."""
    out = []
    for i, item in enumerate(meta_of(job).get("input") or []):
        d = dict(item)
        kind = d.setdefault("type", "message")
        d.setdefault("id", _item_id("msg" if kind == "message" else "item", job.id, "in", i))
        if kind == "message":
            if isinstance(d.get("content"), str):
                part = "output_text" if d.get("role") == "assistant" else "input_text"
                d["content"] = [{"type": part, "text": d["content"]}]
            d.setdefault("status", "completed")
        out.append(d)
    return out


def page(items: list[dict[str, Any]], after: str | None, before: str | None, limit: int, order: str) -> dict[str, Any]:
    """OpenAI's cursor page over a response's input items (`order`: asc or desc)."""
    seq = items if order == "asc" else list(reversed(items))
    ids = [d["id"] for d in seq]
    start, end = 0, len(seq)
    if after is not None:
        if after not in ids:
            raise invalid("after", f"No input item with id {after[:128]!r} in this response.")
        start = ids.index(after) + 1
    if before is not None:
        if before not in ids:
            raise invalid("before", f"No input item with id {before[:128]!r} in this response.")
        end = ids.index(before)
    window = seq[start:end]
    return render.page(window[:limit], len(window) > limit)


# -- streaming -------------------------------------------------------------------------------------


class Events:
    """A response job's events as the Responses API's typed stream events, each with its
    `sequence_number`. Render every event of the job's stream in order, one at a time (never runs
    merged by how a reader happened to batch them): the numbering then depends on the stream alone,
    so a rejoin anywhere (`starting_after`) neither repeats nor skips."""

    def __init__(self, job: render.JobRecord) -> None:
        self.job = job
        self.meta = meta_of(job)
        self.chunks = render.ChatChunks(job, False, "")
        self.seq = -1
        self.text = ""  # the message's text so far
        self.finish: str | None = None
        self.items: list[dict[str, Any]] = []  # output items done
        self.open: dict[str, Any] | None = None  # the message being written
        self.started = False

    def _ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def _snapshot(self, status: str) -> dict[str, Any]:
        return render.response_object(self.job, self.meta, status, [], None, None, None)

    def start(self) -> list[dict[str, Any]]:
        """The first two events: created (queued for a background response), then in progress."""
        self.started = True
        first = "queued" if self.meta.get("background") else "in_progress"
        return [
            self._ev("response.created", response=self._snapshot(first)),
            self._ev("response.in_progress", response=self._snapshot("in_progress")),
        ]

    def _open_message(self) -> list[dict[str, Any]]:
        if self.open is not None:
            return []
        self.open = render.response_message_item(self.job.id, "", "in_progress")
        item, part = {**self.open, "content": []}, self.open["content"][0]  # the empty text part
        at = len(self.items)
        return [
            self._ev("response.output_item.added", output_index=at, item=item),
            self._ev("response.content_part.added", item_id=item["id"], output_index=at, content_index=0, part=part),
        ]

    def _close_message(self, status: str = "completed") -> list[dict[str, Any]]:
        if self.open is None:
            return []
        item = render.response_message_item(self.job.id, self.text, status)
        at, iid = len(self.items), item["id"]
        part = item["content"][0]
        out = [
            self._ev(
                "response.output_text.done", item_id=iid, output_index=at, content_index=0, text=self.text, logprobs=[]
            ),
            self._ev("response.content_part.done", item_id=iid, output_index=at, content_index=0, part=part),
            self._ev("response.output_item.done", output_index=at, item=item),
        ]
        self.items.append(item)
        self.open = None
        return out

    def _calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            n = sum(1 for i in self.items if i["type"] == "function_call")
            item = render.response_call_item(self.job.id, n, call)
            at, iid, args = len(self.items), item["id"], item["arguments"]
            out += [
                self._ev(
                    "response.output_item.added",
                    output_index=at,
                    item={**item, "arguments": "", "status": "in_progress"},
                ),
                self._ev("response.function_call_arguments.delta", item_id=iid, output_index=at, delta=args),
                self._ev("response.function_call_arguments.done", item_id=iid, output_index=at, arguments=args),
                self._ev("response.output_item.done", output_index=at, item=item),
            ]
            self.items.append(item)
        return out

    def render(self, ev: Event) -> list[dict[str, Any]]:
        out = [] if self.started else self.start()
        if isinstance(ev, Delta):
            if ev.choice != 0:
                return out
            for chunk in self.chunks.render(ev):
                if not isinstance(chunk, dict) or not chunk.get("choices"):
                    continue
                c = chunk["choices"][0]
                delta = c["delta"]
                text = delta.get("content")
                if text:
                    out += self._open_message()
                    self.text += text
                    iid = (self.open or {}).get("id")
                    out.append(
                        self._ev(
                            "response.output_text.delta",
                            item_id=iid,
                            output_index=len(self.items),
                            content_index=0,
                            delta=text,
                            logprobs=[],
                        )
                    )
                if delta.get("tool_calls"):
                    out += self._close_message()
                    out += self._calls([{"id": d["id"], "function": d["function"]} for d in delta["tool_calls"]])
                if c.get("finish_reason"):
                    self.finish = c["finish_reason"]
            return out
        if isinstance(ev, Done):
            incomplete = self.finish == "length"
            if not self.items and self.open is None:
                out += self._open_message()  # an empty answer is still a message, as the object shows
            out += self._close_message("incomplete" if incomplete else "completed")
            status = "incomplete" if incomplete else "completed"
            obj = render.response_object(
                self.job,
                self.meta,
                status,
                self.items,
                ev.usage,
                None,
                {"reason": "max_output_tokens"} if incomplete else None,
                int(ev.t) if not incomplete else None,
            )
            return [*out, self._ev(f"response.{status}", response=obj)]
        if isinstance(ev, Failed):
            obj = render.response_object(self.job, self.meta, "failed", [], None, render.response_error(ev.error), None)
            return [*out, self._ev("response.failed", response=obj)]
        if isinstance(ev, Cancelled):
            # OpenAI's stream has no event of its own for a cancel: `response.failed`, its status `cancelled`.
            # Its snapshot holds what was streamed before the cancel (the usage is the row's: retrieve it).
            done = [render.response_message_item(self.job.id, self.text, "incomplete")] if self.open else []
            obj = render.response_object(self.job, self.meta, "cancelled", self.items + done, None, None, None)
            return [*out, self._ev("response.failed", response=obj)]
        return out


def rebuilt_deltas(
    text: str, finish: str | None, marks: Sequence[tuple[int, int, int, int, bool, bool]]
) -> list[Delta]:
    """An ended job's text cut as its stream's deltas were (the marks kept when it ended: characters
    per entry of choice 0), so a stream read back from the row numbers its events as the live one
    did. What the marks do not cover goes in one last delta."""
    out: list[Delta] = []
    at = 0
    mine = [m for m in marks if m[1] == 0]
    for n, m in enumerate(mine):
        chars = m[2]
        last = n == len(mine) - 1
        piece = text[at : at + chars] if not last else text[at:]
        at += chars
        out.append(Delta(choice=0, text=piece, finish_reason=finish if (m[5] or last) else None))
    if not out:
        out.append(Delta(choice=0, text=text, finish_reason=finish))
    return out


def terminal_of(job: Any) -> Event:
    """The terminal event an ended job's row stands for."""
    if job.state == JobState.succeeded:
        return Done(usage=usage_of(job), t=(job.finished_at.timestamp() if job.finished_at else 0.0))
    if job.state == JobState.cancelled:
        return Cancelled()
    return Failed(error=error_of(job))


def record(job: Any, **changes: Any) -> Any:
    """A copy of a job's rendered fields with `changes` (a stand-in for the row, for rendering)."""
    fields = ("id", "model", "state", "attempt", "params", "chat", "result", "usage", "error")
    base = {f: getattr(job, f, None) for f in fields}
    for f in ("created_at", "started_at", "finished_at"):
        base[f] = getattr(job, f, None)
    return SimpleNamespace(**{**base, **changes})
