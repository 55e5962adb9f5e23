"""Every parameter the `openai` SDK declares, and Spool's answer to it: one declaration.

Each create-params TypedDict of the installed SDK (chat, completions, Responses) has one entry per
key here: honoured, accepted with no effect here (and why), or refused (and why: only where
honouring is impossible and ignoring would change the result). The schemas declare each accepted
key with OpenAI's type, so a wrong type is still a 400 naming it; the refusals below are raised with
these words (core/protocol/translate.py, core/protocol/responses.py). docs/parameters.md's table is
`markdown()` (tests/unit/test_sdk_params.py checks it is current, and that a key a newer SDK adds
fails until it is decided here).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["CHAT", "COMPLETIONS", "ENDPOINTS", "RESPONSES", "Answer", "Decision", "markdown", "refusal", "refused"]


class Answer(StrEnum):
    honoured = "honoured"
    no_effect = "accepted, no effect"
    refused = "refused"


@dataclass(frozen=True)
class Decision:
    answer: Answer
    note: str = ""  # what it does here, or why it does nothing
    refusal: str | None = None  # the 400's words: always for `refused`, for some values otherwise


def _ok(note: str = "") -> Decision:
    return Decision(Answer.honoured, note)


def _noop(note: str) -> Decision:
    return Decision(Answer.no_effect, note)


def _refuse(words: str) -> Decision:
    return Decision(Answer.refused, refusal=words)


_TEXT_ONLY = "Spool's models produce text only: audio output is not supported."
_NO_HOSTED_TOOLS = "Spool runs no hosted tools: web search is not supported."
_NO_MODERATION = "validated; no moderation model runs here, so nothing is scored or blocked"
_NO_REASONING = "the model does not reason (SmolLM2): there is no reasoning to bound"
_CACHE = "the engine keeps its own prefix cache per tenant (docs/performance.md), whatever this says"

# Chat and Responses both take these, with the same meaning.
_SHARED: dict[str, Decision] = {
    "moderation": _noop(_NO_MODERATION),
    "prompt_cache_key": _ok(
        "prefix affinity (core/jobs/affinity.py): requests of one tenant with one key go to the same worker, whose "
        "prefix cache then serves them (`usage.prompt_tokens_details.cached_tokens`); a key past "
        "SPOOL_AFFINITY_KEY_RATE requests a second spills to the next workers"
    ),
    "prompt_cache_retention": _noop(_CACHE),
    "safety_identifier": _noop("no abuse detection runs here"),
    "service_tier": _ok(
        "its lane in the fair dispatcher (core/jobs/tiers.py): `flex` beside batch work, refused with 429 "
        "`resource_unavailable` past SPOOL_FLEX_MAX_QUEUED waiting; `priority` (and `scale`, `fast`, `ultrafast`) "
        "ahead of `default` for tenants with `allow_priority`, others served at `default`; `auto` is `default`; "
        "the response, usage and /metrics say which tier served it"
    ),
}

CHAT: dict[str, Decision] = {
    "audio": _refuse(_TEXT_ONLY),
    "frequency_penalty": _ok(),
    "function_call": _ok("the legacy `tool_choice`: `none`, `auto` or `{name}`; the call comes back as `tool_calls`"),
    "functions": _ok("the legacy `tools` (one call at most); not together with `tools`"),
    "logit_bias": _ok(),
    "logprobs": _ok(),
    "max_completion_tokens": _ok(),
    "max_tokens": _ok(),
    "messages": _ok("a final assistant message with `continue_final_message` is continued from its text as written"),
    "metadata": _ok(
        "validated as OpenAI does (16 pairs, 64-character keys, 512-character values); with `store: true`, "
        "kept with the completion, echoed by the stored-completion routes and filtered on by their list"
    ),
    "modalities": Decision(Answer.honoured, '`["text"]`; a list naming `audio` is refused', _TEXT_ONLY),
    "model": _ok(),
    "moderation": _SHARED["moderation"],
    "n": _ok(),
    "parallel_tool_calls": _ok(),
    "prediction": _ok(
        "the CPU engine's speculative draft (docs/performance.md): same answer, faster where it matches; "
        "counted in `usage.completion_tokens_details`; other engines draft nothing"
    ),
    "presence_penalty": _ok(),
    "prompt_cache_key": _SHARED["prompt_cache_key"],
    "prompt_cache_options": _noop(_CACHE),
    "prompt_cache_retention": _SHARED["prompt_cache_retention"],
    "reasoning_effort": _noop(_NO_REASONING),
    "response_format": _ok(),
    "safety_identifier": _SHARED["safety_identifier"],
    "seed": _ok(),
    "service_tier": _SHARED["service_tier"],
    "stop": _ok(),
    "store": _ok(
        "`true`: once it succeeds, the completion is served by `GET`, `POST` (metadata) and `DELETE "
        "/v1/chat/completions/{id}`, `GET /v1/chat/completions` and `.../{id}/messages`; omitted or `false` "
        "(OpenAI's default): not kept there (its job is still read at /v1/jobs/{id}); a batch line's: no effect"
    ),
    "stream": _ok(),
    "stream_options": _ok(),
    "temperature": _ok(),
    "tool_choice": _ok("`none`, `auto`, `required` or a named function; `allowed_tools` and custom tools are 400s"),
    "tools": _ok("function tools; custom tools are 400s"),
    "top_logprobs": _ok(),
    "top_p": _ok(),
    "user": _ok("stored with the job"),
    "verbosity": _noop("the model's length is not steered by it; bound it with `max_completion_tokens`"),
    "web_search_options": _refuse(_NO_HOSTED_TOOLS),
}

COMPLETIONS: dict[str, Decision] = {
    "best_of": _ok(),
    "echo": _ok(),
    "frequency_penalty": _ok(),
    "logit_bias": _ok(),
    "logprobs": _ok("0 to 5"),
    "max_tokens": _ok(),
    "model": _ok(),
    "n": _ok(),
    "presence_penalty": _ok(),
    "prompt": _ok(),
    "seed": _ok(),
    "stop": _ok(),
    "stream": _ok(),
    "stream_options": _ok(),
    "suffix": _ok("where the model has fill-in-the-middle tokens (SmolLM2 has none: a 400)"),
    "temperature": _ok(),
    "top_p": _ok(),
    "user": _ok("stored with the job"),
}

RESPONSES: dict[str, Decision] = {
    "access_programs": _noop("no access programs apply here"),
    "background": _ok(),
    "background_options": _noop("a background response runs as soon as it can; no discounted window"),
    "context_management": _refuse("'context_management' is not supported: Spool does not compact the context."),
    "conversation": _refuse("Spool keeps conversations with 'previous_response_id'; 'conversation' is not supported."),
    "image": _noop("image inputs are refused, so there is nothing to compress"),
    "include": _ok("`message.output_text.logprobs`; other values are 400s"),
    "input": _ok("text messages and function calls and outputs; images, files and hosted items are 400s"),
    "instructions": _ok(),
    "max_output_tokens": _ok(),
    "max_tool_calls": _noop("it bounds hosted tool calls, and none run here; echoed"),
    "metadata": _ok("validated as OpenAI does, and echoed on the response"),
    "model": _ok(),
    "moderation": _SHARED["moderation"],
    "parallel_tool_calls": _ok(),
    "previous_response_id": _ok(),
    "prompt": _refuse("Stored prompt templates ('prompt') are not supported; send 'instructions' and 'input'."),
    "prompt_cache_key": Decision(Answer.honoured, _SHARED["prompt_cache_key"].note + "; echoed"),
    "prompt_cache_options": Decision(
        Answer.no_effect,
        f"{_CACHE}; `prewarm: true` is refused (it asks for no output, and one would be generated)",
        "'prompt_cache_options.prewarm' is not supported: Spool cannot warm the cache without generating.",
    ),
    "prompt_cache_retention": _SHARED["prompt_cache_retention"],
    "reasoning": _noop(f"`effort` and `summary` validated and echoed; {_NO_REASONING}, nor to summarize"),
    "safety_identifier": _noop("no abuse detection runs here; echoed"),
    "service_tier": _SHARED["service_tier"],
    "store": _ok(),
    "stream": _ok(),
    "stream_options": _noop("no obfuscation field is sent"),
    "temperature": _ok(),
    "text": _ok("`format`; `verbosity` validated and echoed, with no effect (as chat's `verbosity`)"),
    "tool_choice": _ok("`none`, `auto`, `required` or a function; hosted tool types are 400s"),
    "tools": _ok("function tools; hosted tools are 400s"),
    "top_logprobs": _ok(),
    "top_p": _ok(),
    "truncation": _ok(),
    "user": _ok(),
}

# Each endpoint's declaration, and the SDK module whose create-params TypedDicts it answers.
ENDPOINTS: dict[str, tuple[dict[str, Decision], str]] = {
    "/v1/chat/completions": (CHAT, "openai.types.chat.completion_create_params"),
    "/v1/completions": (COMPLETIONS, "openai.types.completion_create_params"),
    "/v1/responses": (RESPONSES, "openai.types.responses.response_create_params"),
}


def refused(decisions: dict[str, Decision]) -> list[str]:
    """The parameters refused whatever their value."""
    return [n for n, d in decisions.items() if d.answer is Answer.refused]


def refusal(decisions: dict[str, Decision], name: str) -> str:
    """The 400's words for refusing `name` (a refused parameter, or a refused value of another)."""
    words = decisions[name].refusal
    assert words is not None, name
    return words


def markdown() -> str:
    """The table docs/parameters.md carries between its `sdk-params` markers."""
    lines: list[str] = []
    for endpoint, (decisions, module) in ENDPOINTS.items():
        lines += [f"`{endpoint}` (`{module}`):", "", "| parameter | answer | here |", "| --- | --- | --- |"]
        for name in sorted(decisions):
            d = decisions[name]
            here = d.refusal if d.answer is Answer.refused else d.note or "as documented above"
            lines.append(f"| `{name}` | {d.answer} | {here} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


# The chat parameters the SDK declares beyond what the completions translation reads: the chat
# translation reads them (or refuses them), and a Responses body never forwards them.
CHAT_SDK_EXTRAS = frozenset(
    {
        "functions",
        "function_call",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "safety_identifier",
        "reasoning_effort",
        "verbosity",
        "moderation",
        "prediction",
        "modalities",
        "audio",
        "web_search_options",
    }
)
