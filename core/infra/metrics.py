"""Prometheus metrics. Each process exposes its own: the API at /metrics, the worker and the
dispatcher on SPOOL_METRICS_PORT (0 = off)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("spool_jobs_finished_total", "Jobs that ended, by outcome", ["tenant", "model", "outcome"])
TOKENS = Counter("spool_tokens_total", "Tokens of finished jobs", ["tenant", "model", "kind"])
SECONDS = Counter("spool_engine_seconds_total", "Engine time of finished jobs (GPU-seconds)", ["tenant", "model"])
ADMITTED = Counter("spool_requests_admitted_total", "Completion requests accepted", ["tenant", "model"])
REFUSED = Counter("spool_requests_refused_total", "Requests refused by a limit (429)", ["tenant", "limit"])
QUEUE_WAIT = Histogram(
    "spool_queue_wait_seconds",
    "Job creation to start of generation",
    ["kind"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800),
)
QUEUED = Gauge("spool_jobs_queued", "Jobs waiting in Postgres", ["model"])
