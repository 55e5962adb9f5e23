"""Wire schemas: OpenAI's request and response shapes, with the seed documents' extensions.

Validation of types and ranges lives here; turning a request into engine-neutral parameters lives
in core/protocol/translate.py (the one place that does it), and responses are rendered by
core/protocol/render.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, field_validator

__all__ = ["ChatCompletionRequest", "CompletionRequest"]

PromptPiece = str | int
Prompt = str | list[PromptPiece | list[PromptPiece]]


class _Part(BaseModel):
    """An object inside a request body: strict types, and an unknown field refused, never ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Part):
    include_usage: bool | None = None


class ToolFunction(_Part):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Part):
    type: Literal["function"]
    function: ToolFunction


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: dict[str, str]


class GrammarSpec(_Part):
    """mistral.rs's grammar object."""

    type: Literal["regex", "lark", "json_schema", "gbnf"]
    value: Any


Float = Annotated[float, Field(allow_inf_nan=False)]


def _integral(v: Any) -> Any:
    """16.0 is 16 (OpenAI and llama.cpp accept it); 16.5 stays a float and is refused."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_integral)]


def _bias(v: float | bool) -> float | bool:
    if v is True or (v is not False and not -100 <= v <= 100):  # NaN and inf compare false
        raise ValueError("a logit bias is a number from -100 to 100, or false to ban the token")
    return v


# A `logit_bias` value: a number added to the logit, or llama.cpp's `false` (the token is banned).
LogitBias = Annotated[float | bool, AfterValidator(_bias)]
# llama.cpp's array form: [token id or text, bias]; its parts are checked by position in translate.py.
LogitBiasPair = Annotated[list[int | str | float | bool], Field(min_length=2, max_length=2)]

# llama.cpp's native names its clients send to /v1/completions that Spool cannot honour: refused by
# name whatever SPOOL_UNKNOWN_PARAMS says (the ones it can honour are aliases above).
LLAMACPP_UNSUPPORTED = frozenset(
    {
        "n_keep",
        "id_slot",
        "slot_id",
        "samplers",
        "tfs_z",
        "penalize_nl",
        "n_indent",
        "n_discard",
        "t_max_predict_ms",
        "t_max_prompt_ms",
        "dynatemp_range",
        "dynatemp_exponent",
        "xtc_probability",
        "xtc_threshold",
        "top_n_sigma",
        "lora",
        "return_tokens",
        "post_sampling_probs",
        "timings_per_token",
        "n_cmpl",
        "dry_penalty_last_n",
    }
)


ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"]


class _GenerationRequest(BaseModel):
    """What /v1/completions and /v1/chat/completions share: one set of fields, one set of bounds."""

    # Strict: "max_tokens": "5" is a 400, as with OpenAI. Fields nobody declared are collected
    # (extra="allow") and refused by the route, naming them, unless the deployment relaxes that.
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    model: str
    # Length
    max_tokens: Annotated[Int, Field(ge=-1)] | None = Field(
        None, validation_alias=AliasChoices("max_tokens", "n_predict")
    )
    min_tokens: Annotated[Int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    # Sampling
    temperature: Annotated[Float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[Int, Field(ge=-1)] | None = None
    min_p: Annotated[Float, Field(ge=0, le=1)] | None = None
    typical_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    # Penalties
    presence_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Float, Field(gt=0, le=10)] | None = Field(
        None, validation_alias=AliasChoices("repetition_penalty", "repeat_penalty")
    )
    dry_multiplier: Annotated[Float, Field(ge=0)] | None = None
    dry_base: Annotated[Float, Field(ge=1)] | None = None
    dry_allowed_length: Annotated[Int, Field(ge=0)] | None = None
    # llama.cpp's penalty window: the last n tokens (-1: the whole context, 0: penalties off)
    repeat_last_n: Annotated[Int, Field(ge=-1, le=2**31 - 1)] | None = None
    # Each breaker costs a vocabulary scan per sequence in the engine: bounded.
    dry_sequence_breakers: Annotated[list[Annotated[str, Field(max_length=64)]], Field(max_length=16)] | None = None
    mirostat: Literal[0, 1, 2] | None = None
    mirostat_tau: Annotated[Float, Field(ge=0)] | None = Field(
        None, validation_alias=AliasChoices("mirostat_tau", "mirostat_target")
    )
    mirostat_eta: Annotated[Float, Field(ge=0)] | None = Field(
        None, validation_alias=AliasChoices("mirostat_eta", "mirostat_lr")
    )
    # OpenAI's {"token id": bias} and llama.cpp's forms: {"text": bias}, [[id, bias]], [["text", bias]],
    # and `false` as a bias that bans the token(s). Ids, texts and bounds are read in translate.py.
    logit_bias: dict[str, LogitBias] | list[LogitBiasPair] | None = None
    seed: Annotated[Int, Field(ge=-(2**63), le=2**64 - 1)] | None = None  # negative: no seed (llama.cpp's -1)
    # Stopping and choices
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None  # OpenAI says 4; llama.cpp takes more
    n: Annotated[Int, Field(ge=1, le=128)] | None = None
    # Constrained output
    grammar: str | GrammarSpec | None = None
    json_schema: dict[str, Any] | str | None = None
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    guided_choice: list[str] | None = None
    # Context overflow
    context_length_exceeded_behavior: Literal["truncate", "error"] | None = None
    truncate_sequence: bool | None = None
    # Serving
    cache_prompt: bool | None = None
    # Spool's: speculative decoding for this request (SPOOL_SPECULATIVE when omitted; docs/performance.md)
    speculative: Literal["off", "prediction", "auto"] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Annotated[Int, Field(ge=-100, le=100)] | None = None  # within the tenant: higher runs first
    # OpenAI's tier (core/jobs/tiers.py): its lane in the fair dispatcher; completions take it too.
    service_tier: ServiceTier | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def constrained(self) -> bool:
        """Whether preparing it builds a grammar (a schema, a regex, tools): milliseconds or more of
        llguidance, so never on the event loop."""
        fmt = self.response_format
        plain_format = fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text")
        return (
            bool(self.grammar or self.json_schema or self.regex or self.guided_choice or self.tools) or not plain_format
        )


class CompletionRequest(_GenerationRequest):
    prompt: Prompt
    suffix: str | None = None
    best_of: Annotated[Int, Field(ge=0, le=20)] | None = None
    # Log-probabilities (Llama Stack sends a boolean)
    logprobs: bool | Annotated[Int, Field(ge=0, le=5)] | None = Field(
        None, validation_alias=AliasChoices("logprobs", "n_probs")
    )
    echo: bool | None = None
    prompt_logprobs: Annotated[Int, Field(ge=0, le=20)] | None = None
    images: list[str] | None = None
    # Tools belong to chat; on /v1/completions a non-empty list is refused (never accepted and ignored)

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: Prompt) -> Prompt:
        if isinstance(v, str):
            return v
        if not v:
            raise ValueError("the prompt array must not be empty")
        for item in v:
            pieces = item if isinstance(item, list) else [item]
            if isinstance(item, list) and not item:
                raise ValueError("a prompt inside the array must not be empty")
            if any(isinstance(t, int) and t < 0 for t in pieces):
                raise ValueError("token ids must be non-negative")
        return v


# -- chat ------------------------------------------------------------------------------------------


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Part):
    name: str
    arguments: str


class ToolCall(_Part):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Part):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    def text(self, sep: str = "\n") -> str | None:
        """The content as one string. Text parts are joined by a newline, as llama.cpp's server
        (`common_chat_msg::to_json_oaicompat`: a "\\n" before each part once some text exists) and
        vLLM (`"\\n".join`) do: `["What is", "the best book"]` is "What is\\nthe best book", never
        "What isthe best book". `sep=""`: an assistant message being continued, whose parts llama.cpp
        appends to the prompt as written (`["Wh", "ill"]` goes on from "Whill")."""
        if isinstance(self.content, list):
            text = ""
            for p in self.content:
                text += (sep if text else "") + p.text
            return text
        return self.content


# The `openai` SDK's other chat parameters, typed as OpenAI types them (a wrong type is a 400 naming
# it); what each does here is declared once in core/protocol/sdk_params.py.
ShortStr = Annotated[str, Field(max_length=256)]


def _metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    problem = metadata_problem(v)
    if problem:
        raise ValueError(problem)
    return v


Metadata = Annotated[dict[str, str], AfterValidator(_metadata)]


class LegacyFunction(_Part):
    """An entry of the deprecated `functions`: a function tool's definition."""

    name: Annotated[str, Field(max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class FunctionCallOption(_Part):
    name: str


class PromptCacheOptions(_Part):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class _ModerationMode(_Part):
    mode: Literal["score", "block"]


class ModerationPolicy(_Part):
    input: _ModerationMode | None = None
    output: _ModerationMode | None = None


class Moderation(_Part):
    model: str
    policy: ModerationPolicy | None = None


class Prediction(_Part):
    type: Literal["content"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[Int, Field(ge=-1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[Int, Field(ge=0, le=20)] | None = None
    parallel_tool_calls: bool | None = None
    # Passed to the chat template as variables (vLLM's and llama.cpp's extension), e.g. enable_thinking.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    # The legacy spelling of tools and tool_choice (translate.py maps them)
    functions: Annotated[list[LegacyFunction], Field(min_length=1, max_length=128)] | None = None
    function_call: Literal["none", "auto"] | FunctionCallOption | None = None
    # Kept with the completion when `store` is true (core/jobs/chat_store.py)
    metadata: Metadata | None = None
    store: bool | None = None
    # Accepted with no effect here (sdk_params.CHAT says why), validated as OpenAI does
    prompt_cache_key: ShortStr | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: ShortStr | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    moderation: Moderation | None = None
    prediction: Prediction | None = None
    # ["text"] is what is produced; "audio" is refused (translate.py)
    modalities: Annotated[list[Literal["text", "audio"]], Field(max_length=2)] | None = None
    # Refused when given (translate.py): typed loosely, since any value is refused
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    def constrained(self) -> bool:
        return super().constrained() or bool(self.functions)


# -- responses -----------------------------------------------------------------------------------
# What each route answers, so /openapi.json describes every response. Open to extra fields: these
# document the contract without dropping what a newer renderer adds.


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class UsageObject(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    # `completion_tokens_details` comes only with a `prediction` (its accepted and rejected tokens), as an
    # extra field: declared, a route's response model wrote `null` in every other usage, which the SDK's
    # own schema refuses.


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class Completion(_Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageObject | None = None


class ChatChoice(_Response):
    index: int
    message: dict[str, Any]
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageObject | None = None


class CompletionChunk(Completion):
    """One `data:` event of a streamed completion: OpenAI's stream repeats the `text_completion`
    object with the new text of one choice (`usage` on the last, with `stream_options.include_usage`)."""


class ChatChunkChoice(_Response):
    index: int
    delta: dict[str, Any]  # the role first, then `content` or `tool_calls` pieces
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    """One `data:` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageObject | None = None


class ErrorObject(_Response):
    message: str
    type: str | None = None
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorObject


class JobObject(_Response):
    id: str
    object: Literal["job"]
    model: str
    status: str  # one word across the API (OpenAI's objects and Spool's batches say `status`)
    attempt: int
    created_at: int | None
    started_at: int | None
    finished_at: int | None
    usage: UsageObject | None
    error: ErrorObject | None
    result: Completion | ChatCompletion | None
    events_url: str
    # "worker": queued for a model that has no live worker now (held for one: `min_workers` 0).
    waiting_for: Literal["worker"] | None = None


class ModelObject(_Response):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    context_length: int | None = None


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelObject]


class FileObject(_Response):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str


class FileDeleted(_Response):
    id: str
    object: Literal["file"]
    deleted: bool


class _Page(_Response):
    object: Literal["list"]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileList(_Page):
    data: list[FileObject]


class StoredChatCompletion(ChatCompletion):
    """A stored chat completion (`store: true`, core/jobs/chat_store.py): the object its create
    answered, with its `metadata`."""

    metadata: dict[str, str]


class StoredChatCompletionList(_Page):
    data: list[StoredChatCompletion]


class StoredChatMessage(_Response):
    """One message a stored chat completion was asked with."""

    id: str
    role: str
    content: str | None
    name: str | None = None
    content_parts: list[dict[str, Any]] | None = None


class StoredChatMessageList(_Page):
    data: list[StoredChatMessage]


class ChatCompletionDeleted(_Response):
    id: str
    object: Literal["chat.completion.deleted"]
    deleted: bool


# A batch's `metadata`: OpenAI's limits (a 400 naming `metadata` past them, core/batches/service.py).
METADATA_MAX_PAIRS = 16
METADATA_KEY_MAX_CHARS = 64
METADATA_VALUE_MAX_CHARS = 512


def metadata_problem(meta: Any) -> str | None:
    """Why a `metadata` object is refused, or None: at most 16 pairs, string keys of at most 64
    characters, string values of at most 512 (OpenAI's limits)."""
    if meta is None:
        return None
    if not isinstance(meta, dict):
        return "metadata must be an object of string keys and string values."
    if len(meta) > METADATA_MAX_PAIRS:
        return f"metadata may have at most {METADATA_MAX_PAIRS} key-value pairs; it has {len(meta)}."
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            return "metadata's keys and values must be strings."
        if len(k) > METADATA_KEY_MAX_CHARS:
            return f"metadata keys may be at most {METADATA_KEY_MAX_CHARS} characters; one has {len(k)}."
        if len(v) > METADATA_VALUE_MAX_CHARS:
            return (
                f"metadata values may be at most {METADATA_VALUE_MAX_CHARS} characters; "
                f"the value of '{k}' has {len(v)}."
            )
    return None


class BatchObject(_Response):
    id: str
    object: Literal["batch"]
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    request_counts: dict[str, int] | None = None


class BatchList(_Page):
    data: list[BatchObject]


class TokenizeResponse(_Response):
    tokens: list[int] | list[dict[str, Any]]


class DetokenizeResponse(_Response):
    content: str


class UsageRow(_Response):
    day: str
    tenant_id: int
    model: str
    service_tier: str  # the tier that served these jobs (`default`, `flex`, `priority`)
    requests: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    gpu_seconds: float


class StoreBytes(_Response):
    """Bytes per store: `jobs` (its jobs' and batches' rows in Postgres), `files` (its uploads),
    `redis` (what its ended jobs hold in Redis; None when Redis did not answer)."""

    jobs: int | None = None
    files: int | None = None
    redis: int | None = None


class StoredBytes(StoreBytes):
    """What a tenant stores, per store, and its limits on each (None: no limit)."""

    limits: StoreBytes


class TenantStoredBytes(StoreBytes):
    tenant_id: int


class UsageList(_Response):
    object: Literal["list"]
    data: list[UsageRow]
    # GET /v1/usage: the calling tenant's stored bytes (`redis_bytes`: the same as `stored_bytes.redis`).
    redis_bytes: int | None = None
    stored_bytes: StoredBytes | None = None
    # GET /admin/usage: every tenant's that stores anything (or the one named by `tenant`).
    stored: list[TenantStoredBytes] | None = None


class WebhookSecret(_Response):
    object: Literal["webhook_secret"]
    secret: str  # Standard Webhooks key (`whsec_` + base64): verify deliveries with it


class TenantObject(_Response):
    object: Literal["tenant"]
    id: int
    name: str
    max_stored_bytes: int | None = None  # None: the deployment's default; 0: no limit
    max_redis_bytes: int | None = None
    weight: int | None = None
    allow_priority: bool | None = None  # may be served at `service_tier: "priority"`
    created_at: int | None = None


class TenantList(_Response):
    object: Literal["list"]
    data: list[TenantObject]


class KeyObject(_Response):
    object: Literal["api_key"]
    id: int
    tenant_id: int
    prefix: str
    scope: str
    revoked: bool


class CreatedKey(KeyObject):
    key: str  # the only time the key is shown


class KeyList(_Response):
    object: Literal["list"]
    data: list[KeyObject]
