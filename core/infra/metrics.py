"""Prometheus metrics, named as vLLM names them where they exist (`vllm:` becomes `spool_`), so the
dashboards people already have read them with a prefix change.

Each process exposes its own: the API at /metrics, the worker and the dispatcher on
SPOOL_METRICS_PORT (0 = off). `spool api --workers N` runs prometheus_client's multiprocess mode
(PROMETHEUS_MULTIPROC_DIR, set by the CLI), so the API's /metrics sums every process."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)

# API
ADMITTED = Counter("spool_requests_admitted_total", "Completion requests accepted", ["tenant", "model"])
REFUSED = Counter("spool_requests_refused_total", "Requests refused by a limit (429)", ["tenant", "limit"])

# Where jobs end (worker, reaper, API cancel)
REQUESTS = Counter("spool_jobs_finished_total", "Jobs that ended, by outcome", ["tenant", "model", "outcome"])
TOKENS = Counter("spool_tokens_total", "Tokens of finished jobs", ["tenant", "model", "kind"])
TIERS = Counter(
    "spool_service_tier_jobs_total", "Jobs that ended, by the service tier that served them", ["model", "service_tier"]
)
FLEX_REFUSED = Counter(
    "spool_flex_refused_total", "Flex requests refused (429) because the flex backlog was past its bound", ["model"]
)
AFFINITY = Counter(
    "spool_affinity_routed_total",
    "API requests sent to one worker's own queue by prefix affinity: to their key's home, or spilled for its load "
    "or the key's rate",
    ["model", "how"],
)
RECLAIMED = Counter(
    "spool_affinity_reclaimed_total", "Messages moved from a gone worker's own queue to the shared one", ["model"]
)
SECONDS = Counter("spool_engine_seconds_total", "Engine time of finished jobs (GPU-seconds)", ["tenant", "model"])
PROMPT_TOKENS = Counter("spool_prompt_tokens_total", "Prompt tokens processed", ["model"])
GENERATION_TOKENS = Counter("spool_generation_tokens_total", "Tokens generated", ["model"])
REAPED = Counter("spool_leases_reaped_total", "Running jobs whose worker stopped renewing its lease", ["model"])

# Worker (per attempt)
QUEUE_WAIT = Histogram(
    "spool_request_queue_time_seconds", "Job creation to start of generation", ["model", "kind"], buckets=LATENCY
)
TTFT = Histogram(
    "spool_time_to_first_token_seconds", "Job creation to its first generated token", ["model", "kind"], buckets=LATENCY
)
ITL = Histogram(
    "spool_inter_token_latency_seconds",
    "Time between two tokens of one sequence, as the worker receives them",
    ["model"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5),
)
E2E = Histogram(
    "spool_e2e_request_latency_seconds", "Job creation to its end (succeeded)", ["model", "kind"], buckets=LATENCY
)
RUNNING = Gauge("spool_num_requests_running", "Sequences the worker's engine is decoding", ["model", "worker"])
WAITING = Gauge(
    "spool_num_requests_waiting", "Sequences waiting in the worker's engine for a slot", ["model", "worker"]
)

# Dispatcher (from the ledger and the heartbeats, once per interval)
QUEUED = Gauge("spool_queue_depth", "Jobs waiting in Postgres", ["model", "kind"])
OLDEST = Gauge("spool_oldest_queued_job_age_seconds", "Age of the oldest job waiting in Postgres", ["model", "kind"])
LIVE_WORKERS = Gauge("spool_live_workers", "Workers whose heartbeat is fresh", ["model"])
WANTED_WORKERS = Gauge(
    "spool_wanted_workers", "Workers a model wants: its min_workers, and one while it has queued jobs", ["model"]
)
AWAITING_WORKER = Gauge(
    "spool_requests_awaiting_worker", "API requests held in Postgres because the model has no live worker", ["model"]
)
STORED_REDIS = Gauge(
    "spool_tenant_redis_bytes",
    "Bytes a tenant's ended jobs hold in Redis (streams and marks), counted as they end (an upper bound)",
    ["tenant"],
)
STORED = Gauge(
    "spool_tenant_stored_bytes",
    "Bytes a tenant stores, per store: jobs (its jobs' and batches' rows in Postgres), files (its uploads), "
    "redis (what its ended jobs hold there)",
    ["tenant", "store"],
)


def exported() -> list[MetricWrapperBase]:
    """The metric objects this module defines, in the order it defines them."""
    return [v for v in globals().values() if isinstance(v, MetricWrapperBase)]


def exposed_name(metric: MetricWrapperBase) -> str:
    """The name a scrape shows: prometheus_client keeps a counter's name without its `_total`."""
    return metric._name + ("_total" if metric._type == "counter" else "")


def markdown() -> str:
    """docs/operations.md's metrics table: every metric this module defines, as Prometheus exposes it
    (a histogram adds `_bucket`, `_sum` and `_count`). tests/unit/test_reference_tables.py keeps the
    doc's copy current; `python -m ops.docs` rewrites it."""
    rows = ["| metric | type | labels | help |", "| --- | --- | --- | --- |"]
    for m in exported():
        labels = ", ".join(f"`{label}`" for label in m._labelnames) or "none"
        rows.append(f"| `{exposed_name(m)}` | {m._type} | {labels} | {m._documentation} |")
    return "\n".join(rows)
