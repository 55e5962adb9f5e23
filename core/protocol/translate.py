"""The one place OpenAI JSON becomes engine-neutral `GenerationParams` and token-id prompts.

Everything a request could get wrong that we can know before storing it is refused here with a
400 naming the parameter: prompt shapes and token ids, the context window, parameter combinations,
constraints too large to compile or that do not compile. Nothing is stored for a refused request.

A constraint's size is checked first, before anything is compiled (core/generation/constraints.py,
`Limits`). Compiling it may be deferred (`compile=False`): the API admits the request against the
tenant's limits first, so a tenant over its quota never costs a compile, and then compiles it with
`compile_constraint`.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from pydantic import ValidationError

from core.config import Settings
from core.errors import DomainError, ErrorKind, invalid
from core.generation import capabilities, chat_template, constraints
from core.generation.params import GenerationParams
from core.generation.prompt import Prompt
from core.generation.tokenizer import Tokenizer, context_length
from core.protocol import sdk_params
from core.protocol.errors import from_validation
from core.protocol.schemas import (
    LLAMACPP_UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    FunctionCallOption,
    GrammarSpec,
    NamedToolChoice,
    Tool,
    ToolFunction,
)

_TOKEN_ID = re.compile(r"-?[0-9]{1,10}")


def bad(param: str, message: str, code: str = "invalid_value") -> DomainError:
    return invalid(param, message, code)


def prompts_of(req: CompletionRequest, tok: Tokenizer) -> list[Prompt]:
    """Each prompt's ids, and the text to echo (None: detokenize)."""
    p = req.prompt
    if isinstance(p, str):
        groups: list[Any] = [p]
    elif any(isinstance(x, int) for x in p):
        groups = [p]  # llama.cpp: a flat array with ids (and maybe strings) is one prompt
    else:
        groups = list(p)  # strings and arrays: one prompt each
    out: list[Prompt] = []
    for g in groups:
        if isinstance(g, str):
            out.append(Prompt(tok.encode(g) or _empty_prompt(tok), g))
            continue
        ids: list[int] = []
        for i, piece in enumerate(g):
            ids.extend(tok.encode(piece, add_special=i == 0) if isinstance(piece, str) else [piece])
        bad_ids = [t for t in ids if t >= tok.n_vocab]
        if bad_ids:
            raise bad("prompt", f"Token id {bad_ids[0]} is out of range: the vocabulary has {tok.n_vocab} tokens.")
        out.append(Prompt(ids))  # echoed as the detokenized ids
    return out


def _empty_prompt(tok: Tokenizer) -> list[int]:
    # OpenAI: an empty prompt generates "as if from the beginning of a new document".
    return [getattr(tok, "eos", 0)]


def _fim(req: CompletionRequest, tok: Tokenizer, prompts: list[Prompt]) -> None:
    fim = tok.fim_tokens()
    if fim is None:
        raise bad("suffix", f"The model '{req.model}' has no fill-in-the-middle tokens, so 'suffix' is not supported.")
    if req.echo:
        raise bad("echo", "'echo' cannot be combined with 'suffix'.")
    pre, suf, mid = fim
    tail = tok.encode(req.suffix or "", add_special=False)
    for p in prompts:
        p.ids = [pre, *p.ids, suf, *tail, mid]
        p.text = None


def _fit_context(
    req: CompletionRequest, settings: Settings, tok: Tokenizer, prompts: list[Prompt], want: int | None
) -> None:
    ctx = context_length(tok, settings)
    truncate_prompt = bool(req.truncate_sequence)
    behavior = req.context_length_exceeded_behavior or settings.context_overflow
    for i, p in enumerate(prompts):
        n = len(p.ids)
        need = n + (want if want is not None else 0)
        if n < ctx and (want is None or need <= ctx):
            continue
        if n < ctx and behavior == "truncate":
            continue  # the worker lowers max_tokens to what fits (Fireworks' default behaviour)
        if truncate_prompt:
            keep = ctx - max(1, min(want if want else 1, ctx - 1))
            p.ids = p.ids[-keep:]  # from the left: the end of the prompt is what the completion follows
            p.text = None
            continue
        what = f"{n} in your prompt" + (f", {want} for the completion" if want else "")
        raise DomainError(
            ErrorKind.invalid,
            f"This model's maximum context length is {ctx} tokens. However, you requested {need} tokens "
            f"({what}){'' if len(prompts) == 1 else f' for prompt {i}'}. Please reduce the prompt or the "
            "completion length, or set truncate_sequence / context_length_exceeded_behavior.",
            param="prompt" if n >= ctx else "max_tokens",
            code="context_length_exceeded",
        )


def _bound_logprobs(
    req: CompletionRequest,
    settings: Settings,
    prompts: list[Prompt],
    want: int | None,
    best_of: int,
    logprobs: int | None,
    ctx: int,
) -> None:
    """Log-probabilities grow as sequences x tokens x alternatives: bound what one response carries."""
    entries = 0
    for p in prompts:
        n = len(p.ids)
        gen = max(ctx - n, 0) if want is None else want
        if logprobs is not None:
            entries += best_of * gen * (logprobs + 1)
            if req.echo:
                entries += best_of * n * (logprobs + 1)
        if req.prompt_logprobs is not None:
            entries += best_of * n * (req.prompt_logprobs + 1)
    if entries > settings.max_logprob_entries:
        raise bad(
            "logprobs" if logprobs is not None else "prompt_logprobs",
            f"This request would return about {entries} log-probabilities (sequences x tokens x alternatives); "
            f"the limit per request is {settings.max_logprob_entries}. Ask for fewer tokens, choices or alternatives.",
            "response_too_large",
        )


# A `logit_bias` names each token of the vocabulary at most once, and the texts it names are tokenized
# here, on the request's thread: bounded like the rest of a request (docs/parameters.md).
LOGIT_BIAS_TEXT_BYTES = 64 * 1024  # UTF-8 bytes of all text keys together


def logit_bias(value: dict[str, Any] | list[list[Any]] | None, tok: Tokenizer) -> dict[int, float]:
    """`logit_bias` in every form llama.cpp's server documents, as {token id: bias}.

    - OpenAI's `{"token id": bias}`;
    - `{"text": bias}`: a key that is not an integer is a text, tokenized by the model's tokenizer
      (no BOS), and every token of it gets the bias (llama.cpp: `common_tokenize(vocab, key, false)`);
    - `[[token id, bias], ["text", bias], ...]`: in the array form a string is always a text;
    - a bias of `false` bans the token(s): -inf, not merely -100 (llama.cpp's -INFINITY).

    A token named more than once takes its last bias. Out-of-range ids, empty texts, `true` and
    biases outside -100..100 are 400s naming `logit_bias` (llama.cpp skips them silently)."""
    if not value:
        return {}
    entries: list[tuple[Any, Any, bool]]  # (key, bias, whether a string key may be a token id)
    if isinstance(value, dict):
        entries = [(k, v, True) for k, v in value.items()]
    else:
        entries = [(pair[0], pair[1], False) for pair in value]
    if len(entries) > tok.n_vocab:
        raise bad(
            "logit_bias",
            f"logit_bias has {len(entries)} entries; the model has {tok.n_vocab} tokens, so at most {tok.n_vocab}.",
        )
    text_bytes = 0
    out: dict[int, float] = {}
    for key, raw, ids_as_text in entries:
        shown = str(key) if len(str(key)) <= 100 else str(key)[:100] + "…"  # a client's string, cut
        if raw is False:
            b = float("-inf")
        elif isinstance(raw, bool) or not isinstance(raw, (int, float)) or not -100 <= raw <= 100:
            raise bad(
                "logit_bias",
                f"The logit_bias of '{shown}' must be a number from -100 to 100, or false to ban it; got {raw!r}.",
            )
        else:
            b = float(raw)
        # ASCII digits only: str.isdigit() also accepts "²", which is a text (as llama.cpp's strtol reads it).
        if (isinstance(key, int) and not isinstance(key, bool)) or (ids_as_text and _TOKEN_ID.fullmatch(key)):
            t = int(key)
            if not 0 <= t < tok.n_vocab:
                raise bad("logit_bias", f"logit_bias key '{shown}' is not a token id (0..{tok.n_vocab - 1}).")
            out[t] = b
            continue
        if not isinstance(key, str):
            raise bad("logit_bias", f"A logit_bias entry must start with a token id or a text; got {key!r}.")
        if not key:
            raise bad("logit_bias", "A logit_bias text must not be empty.")
        text_bytes += len(key.encode("utf-8", "surrogatepass"))
        if text_bytes > LOGIT_BIAS_TEXT_BYTES:
            raise bad(
                "logit_bias",
                f"logit_bias's texts are too long together: the limit is {LOGIT_BIAS_TEXT_BYTES} bytes (UTF-8).",
            )
        try:
            ids = tok.encode(key, add_special=False)
        except UnicodeEncodeError as exc:
            raise bad("logit_bias", f"The logit_bias text '{shown}' is not valid Unicode: {exc.reason}.") from exc
        for t in ids:
            out[t] = b
    return out


def limits_of(settings: Settings) -> constraints.Limits:
    return constraints.Limits(
        choices=settings.max_guided_choices,
        choice_bytes=settings.max_guided_choice_bytes,
        grammar_bytes=settings.max_grammar_bytes,
        regex_bytes=settings.max_regex_bytes,
        schema_bytes=settings.max_json_schema_bytes,
        schema_depth=settings.max_json_schema_depth,
    )


def _constraint_args(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    return {
        "grammar": req.grammar.model_dump() if isinstance(req.grammar, GrammarSpec) else req.grammar,
        "json_schema": req.json_schema,
        "response_format": req.response_format,
        "regex": req.regex,
        "guided_choice": req.guided_choice,
    }


def _constraint(req: CompletionRequest, settings: Settings, compile: bool) -> tuple[str | None, bool]:
    """(the compiled grammar, or None when there is none or `compile` is False; whether the request
    carries a constraint). Its size is checked either way, before anything is compiled."""
    try:
        given = constraints.check(**_constraint_args(req), limits=limits_of(settings))
        if given is None:
            return None, False
        # An empty value (`guided_choice: []`, `json_schema: {}`) costs nothing to build: built now,
        # so the caller's `body.constrained()` (which counts only non-empty ones) never misses one.
        return (constraints.compiled(*given) if compile or not given[1] else None), True
    except constraints.ConstraintError as exc:
        raise bad(exc.param, str(exc), code="invalid_constraint") from exc


def compile_constraint(req: CompletionRequest | ChatCompletionRequest, settings: Settings) -> str | None:
    """The grammar of a request translated with `compile=False` (None: it has no constraint); the
    same 400s a compiling translation gives."""
    if isinstance(req, ChatCompletionRequest):
        forced, _, _ = _tool_constraint(legacy_functions(req), settings)
        if forced is not None:
            try:
                return constraints.build(grammar={"type": "lark", "value": forced}, limits=limits_of(settings))
            except constraints.ConstraintError as exc:
                raise _tools_error(exc) from exc
    grammar, _ = _constraint(req, settings, compile=True)  # type: ignore[arg-type]
    return grammar


def _tools_error(exc: Exception) -> DomainError:
    why = exc.message if isinstance(exc, DomainError) else str(exc)
    return bad("tools", f"A function's parameters cannot be enforced: {why}", code="invalid_constraint")


def to_generation(
    req: CompletionRequest, settings: Settings, tok: Tokenizer, compile: bool = True
) -> tuple[GenerationParams, list[Prompt]]:
    """`compile=False`: the constraint is checked (its size, one per request) but not compiled, and
    `params.grammar` is left None for `compile_constraint` to fill in."""
    native = sorted(LLAMACPP_UNSUPPORTED & set(req.model_extra or {}))
    if native:
        raise bad(native[0], f"llama.cpp's '{native[0]}' is not supported by Spool.", "unsupported_parameter")
    if req.tools:
        raise bad("tools", "'tools' belong to /v1/chat/completions; a text completion cannot call them.")
    if req.tool_choice not in (None, "none"):
        raise bad("tool_choice", "'tool_choice' belongs to /v1/chat/completions; a text completion cannot call tools.")
    # A negative seed means "no seed" (llama.cpp's -1): random, and free to take the fast path.
    seeded = req.seed is not None and req.seed >= 0
    if req.images:
        raise bad("images", f"The model '{req.model}' is a text model; 'images' are not supported.")
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is enabled.")

    n = req.n or 1
    best_of = req.best_of or n
    if best_of < n:
        raise bad("best_of", f"best_of ({best_of}) must be greater than or equal to n ({n}).")
    if best_of > n and req.stream:
        raise bad("best_of", "best_of cannot be used with stream: the best choices are known only at the end.")

    if "max_tokens" not in req.model_fields_set:
        want: int | None = settings.default_max_tokens
    elif req.max_tokens is None or req.max_tokens == -1:
        want = None  # null or -1: up to the end of the context
    else:
        want = req.max_tokens
    if req.min_tokens and want is not None and req.min_tokens > want:
        raise bad("min_tokens", f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({want}).")

    logprobs = req.logprobs
    if isinstance(logprobs, bool):
        logprobs = 1 if logprobs else None

    bias = logit_bias(req.logit_bias, tok)

    grammar, constrained = _constraint(req, settings, compile)

    try:
        prompts = prompts_of(req, tok)
    except UnicodeEncodeError as exc:
        raise bad("prompt", f"The prompt is not valid Unicode text: {exc.reason} at position {exc.start}.") from exc
    if req.suffix is not None:
        _fim(req, tok, prompts)
    sequences = len(prompts) * best_of
    if sequences > settings.max_sequences_per_job:
        raise bad(
            "n",
            f"{len(prompts)} prompts x {best_of} choices = {sequences} sequences; the limit per request "
            f"is {settings.max_sequences_per_job}.",
        )
    _fit_context(req, settings, tok, prompts, want)
    _bound_logprobs(req, settings, prompts, want, best_of, logprobs, context_length(tok, settings))

    # What the client left out takes GenerationParams' own default (one table, not restated here).
    given = {
        "min_tokens": req.min_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "min_p": req.min_p,
        "typical_p": req.typical_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "dry_multiplier": req.dry_multiplier,
        "dry_base": req.dry_base,
        "dry_allowed_length": req.dry_allowed_length,
        "dry_sequence_breakers": None if req.dry_sequence_breakers is None else tuple(req.dry_sequence_breakers),
        "mirostat_tau": req.mirostat_tau,
        "mirostat_eta": req.mirostat_eta,
        "cache_prompt": req.cache_prompt,
        "speculative": req.speculative or settings.speculative,
    }
    params = GenerationParams(
        **{k: v for k, v in given.items() if v is not None},
        max_tokens=want,
        ignore_eos=bool(req.ignore_eos),
        top_k=max(req.top_k or 0, 0),
        penalty_last_n=None if req.repeat_last_n in (None, -1) else req.repeat_last_n,
        # Fireworks has no switch: a target or learning rate alone turns Mirostat 2.0 on.
        mirostat=req.mirostat
        if req.mirostat is not None
        else (2 if {"mirostat_tau", "mirostat_eta"} & req.model_fields_set else 0),
        logit_bias=bias,
        # Picked here when the client gave none: on record, and a resumed attempt stays seeded.
        seed=(req.seed if seeded and req.seed is not None else secrets.randbits(63)) % 2**63,
        stop=tuple(s for s in ((req.stop,) if isinstance(req.stop, str) else (req.stop or ())) if s),
        n=n,
        best_of=best_of,
        logprobs=logprobs,
        echo=bool(req.echo),
        prompt_logprobs=req.prompt_logprobs,
        grammar=grammar,
    )
    # A constraint not compiled yet still asks the engine whether it can honour one.
    asked = params.model_copy(update={"grammar": "pending"}) if constrained and grammar is None else params
    for name in capabilities.unsupported(settings.engine, asked):
        raise bad(
            name,
            f"The '{settings.engine}' engine serving '{req.model}' cannot honour '{name}' with this value.",
            code="unsupported_parameter",
        )
    return params, prompts


def reservation(params: GenerationParams, prompts: list[Prompt], ctx: int) -> int:
    """Tokens to reserve against the tenant's limits: every prompt plus the most every candidate
    may generate. Settled to the real usage when the job ends."""
    total = 0
    for p in prompts:
        n = len(p.ids)
        room = max(ctx - n, 0)
        gen = room if params.max_tokens is None else min(params.max_tokens, room)
        total += n + params.candidates * gen
    return total


# -- chat ------------------------------------------------------------------------------------------
# Chat-only fields; everything else is the completions translation, shared (same bounds, same words).
_CHAT_ONLY = (
    frozenset(
        {
            "messages",
            "max_completion_tokens",
            "logprobs",
            "top_logprobs",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "chat_template_kwargs",
            "add_generation_prompt",
            "continue_final_message",
        }
    )
    | sdk_params.CHAT_SDK_EXTRAS
)
# Chat parameters refused whatever their value (sdk_params.CHAT says why).
_CHAT_REFUSED = tuple(sdk_params.refused(sdk_params.CHAT))


def _refused(req: ChatCompletionRequest) -> None:
    """The SDK's chat parameters Spool cannot honour where ignoring them would change the answer."""
    for name in _CHAT_REFUSED:
        if getattr(req, name) is not None:
            raise bad(name, sdk_params.refusal(sdk_params.CHAT, name), "unsupported_parameter")
    if "audio" in (req.modalities or ()):
        raise bad("modalities", sdk_params.refusal(sdk_params.CHAT, "modalities"), "unsupported_parameter")


def legacy_functions(req: ChatCompletionRequest) -> ChatCompletionRequest:
    """The deprecated `functions`/`function_call` as the `tools`/`tool_choice` they became (one call
    at most, as the legacy API makes); the request as it is when it has neither."""
    if req.functions is None:
        if req.function_call is not None:
            raise bad("function_call", "'function_call' needs 'functions'.")
        return req
    if req.tools is not None or req.tool_choice is not None:
        raise bad(
            "functions", "Send 'tools' and 'tool_choice', or the deprecated 'functions' and 'function_call', not both."
        )
    names = [f.name for f in req.functions]
    call = req.function_call
    if isinstance(call, FunctionCallOption) and call.name not in names:
        raise bad("function_call", f"function_call names '{call.name}', which is not in 'functions' ({names}).")
    tools = [
        Tool(type="function", function=ToolFunction(name=f.name, description=f.description, parameters=f.parameters))
        for f in req.functions
    ]
    choice = (
        NamedToolChoice(type="function", function={"name": call.name}) if isinstance(call, FunctionCallOption) else call
    )
    return req.model_copy(update={"tools": tools, "tool_choice": choice, "parallel_tool_calls": False})


def _messages(req: ChatCompletionRequest, continued: bool = False) -> list[dict[str, Any]]:
    """`continued`: the final assistant message is continued, its text parts kept as written."""
    out: list[dict[str, Any]] = []
    last = len(req.messages) - 1
    for i, m in enumerate(req.messages):
        if m.role == "tool" and not m.tool_call_id:
            raise bad(f"messages[{i}].tool_call_id", "A 'tool' message needs the 'tool_call_id' it answers.")
        if m.tool_calls and m.role != "assistant":
            raise bad(f"messages[{i}].tool_calls", "Only 'assistant' messages carry 'tool_calls'.")
        text = m.text("" if continued and i == last else "\n")
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text or ""}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    """A function's parameters; omitted, a function that takes none (OpenAI): the empty object."""
    if schema is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return schema or {"type": "object"}  # `{}`: any object, as before


def _tool_constraint(req: ChatCompletionRequest, settings: Settings) -> tuple[str | None, bool, list[str]]:
    """(the lark source of the grammar that forces a valid call, not compiled yet; whether calls are
    parsed out of the text; the functions it forces). The functions' schemas are size-checked here."""
    tools = req.tools or []
    choice = req.tool_choice
    for i, t in enumerate(tools):
        if t.function.strict:  # OpenAI refuses a strict function whose schema strict mode cannot enforce
            try:  # bounded before it is walked
                constraints.check_schema(t.function.parameters or {}, "tools", limits_of(settings))
            except constraints.ConstraintError as exc:
                raise bad("tools", str(exc), code="invalid_constraint") from exc
            why = constraints.strict_schema_problem(_parameters(t.function.parameters))
            if why:
                raise bad(
                    "tools",
                    f"Invalid schema for function '{t.function.name}' (tools[{i}]) with strict: true: {why}.",
                    code="invalid_function_parameters",
                )
    if not tools:
        if choice not in (None, "none"):
            raise bad("tool_choice", "'tool_choice' needs 'tools'.")
        return None, False, []
    if choice == "none":
        return None, False, []
    if choice in (None, "auto"):
        return None, True, []
    names = [t.function.name for t in tools]
    if not isinstance(choice, str):
        wanted = choice.function.get("name")
        if wanted not in names:
            raise bad("tool_choice", f"tool_choice names '{wanted}', which is not in 'tools' ({names}).")
        names = [wanted]
    chosen = [t for t in tools if t.function.name in names]
    try:
        return (
            constraints.tool_calls(
                [(t.function.name, _parameters(t.function.parameters)) for t in chosen],
                parallel=req.parallel_tool_calls is not False and len(chosen) > 1,
                limits=limits_of(settings),
                validate=False,  # compiled once, with the request's grammar (to_generation / compile_constraint)
            ),
            True,
            names,
        )
    except constraints.ConstraintError as exc:
        raise bad("tools", str(exc), code="invalid_constraint") from exc


def chat_prompt(req: ChatCompletionRequest, tok: Tokenizer, template: str | None) -> list[int]:
    """The conversation as prompt token ids, through the model's own chat template."""
    if not template:
        raise bad("model", f"The model '{req.model}' has no chat template; use /v1/completions.", "no_chat_template")
    final_assistant = bool(req.continue_final_message) and req.messages[-1].role == "assistant"
    messages = _messages(req, continued=final_assistant)
    bos, eos = tok.special_text()
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if req.tool_choice != "none" else None
    try:
        text = chat_template.render(
            template,
            messages,
            tools=tools or None,
            add_generation_prompt=not final_assistant and req.add_generation_prompt is not False,
            bos_token=bos,
            eos_token=eos,
            extra=req.chat_template_kwargs,
        )
    except chat_template.ChatTemplateError as exc:
        raise bad("messages", str(exc), "invalid_conversation") from exc
    if final_assistant:  # continue the last assistant message: cut the template's end-of-turn after it
        last = messages[-1]["content"]
        cut = text.rfind(last)
        text = text[: cut + len(last)] if last and cut >= 0 else text
    try:
        return tok.encode(text, add_special=False)
    except UnicodeEncodeError as exc:
        raise bad("messages", f"The messages are not valid Unicode text: {exc.reason}.") from exc


def prediction_ids(req: ChatCompletionRequest, tok: Tokenizer, settings: Settings) -> tuple[int, ...]:
    """OpenAI's `prediction` as the draft tokens it gives (workers/engine/drafts.py): its text (text
    parts joined as written) tokenized without BOS; no more than the context can hold, since no
    output is longer."""
    assert req.prediction is not None
    content = req.prediction.content
    text = content if isinstance(content, str) else "".join(p.text for p in content)
    try:
        ids = tok.encode(text, add_special=False)
    except UnicodeEncodeError as exc:
        raise bad("prediction", f"The prediction is not valid Unicode text: {exc.reason}.") from exc
    return tuple(ids[: context_length(tok, settings)])


def _chat_param(exc: DomainError, req: ChatCompletionRequest) -> DomainError:
    """An error of the shared completions translation, naming the chat request's own field."""
    if exc.param == "prompt":
        exc.param = "messages"
    elif exc.param == "logprobs":
        exc.param = "top_logprobs"
    return exc


def chat_to_generation(
    req: ChatCompletionRequest, settings: Settings, tok: Tokenizer, template: str | None, compile: bool = True
) -> tuple[GenerationParams, list[Prompt], dict[str, Any]]:
    """A chat request -> (params, prompts, how to render it). The conversation becomes one token-id
    prompt; every other field goes through the completions translation, so bounds and errors agree.
    `compile=False`: as in `to_generation`."""
    _refused(req)
    req = legacy_functions(req)
    forced, parse_tools, forced_names = _tool_constraint(req, settings)
    ids = chat_prompt(req, tok, template)
    shared = {f: getattr(req, f) for f in req.model_fields_set - _CHAT_ONLY if f in type(req).model_fields}
    shared = {k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in shared.items()}
    if req.max_completion_tokens is not None:
        shared["max_tokens"] = req.max_completion_tokens
    elif "max_tokens" not in req.model_fields_set:
        # Chat has no default of 16 (that is legacy completions'): OpenAI and vLLM run to the model's
        # own stop or the context's end. Admission reserves the whole room (`reservation`).
        shared["max_tokens"] = None
    if forced is not None:
        taken = sorted({"grammar", "json_schema", "regex", "guided_choice"} & set(shared))
        if taken or (req.response_format or {}).get("type", "text") != "text":
            raise bad("tool_choice", "A forced tool call cannot be combined with another output constraint.")
        shared["grammar"] = GrammarSpec(type="lark", value=forced)
    if req.top_logprobs and not req.logprobs:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true.")
    try:
        completion = CompletionRequest.model_validate({**shared, "prompt": [ids]})
    except ValidationError as exc:  # every shared field was validated once already: a bug, but a 400
        raise _chat_param(from_validation(exc.errors()), req) from exc
    if req.logprobs:
        # Chat's range (top_logprobs 0..20) is not completions' (logprobs 0..5): set after validation.
        completion = completion.model_copy(update={"logprobs": req.top_logprobs or 0})
    try:
        params, prompts = to_generation(completion, settings, tok, compile)
        if req.prediction is not None:
            params = params.model_copy(update={"prediction": prediction_ids(req, tok, settings)})
    except DomainError as exc:
        if forced is not None and exc.param == "grammar":  # the forced call's grammar: the tools' schemas
            raise _tools_error(exc) from exc
        _chat_param(exc, req)
        raise
    meta: dict[str, Any] = {"tools": parse_tools, "top_logprobs": req.top_logprobs or 0 if req.logprobs else None}
    if forced_names:  # the output is nothing but calls to these: one cut by max_tokens is still a call
        meta["forced"] = forced_names
    return params, prompts, meta
