"""One log format for every process: JSON lines (python-json-logger) carrying the ids that tie a line
to its request and job: request_id, job_id, tenant_id, model, attempt, set for the current request
(API) or attempt (worker thread) through a context variable. `SPOOL_LOG_FORMAT=text` for humans.

Never logged: API keys, prompts or generated text (the access log has method, path, status,
duration and ids only)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pythonjsonlogger.json import JsonFormatter

CONTEXT: ContextVar[dict[str, Any] | None] = ContextVar("spool_log_context", default=None)
FIELDS = ("request_id", "job_id", "tenant_id", "model", "attempt")


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for k, v in (CONTEXT.get() or {}).items():
            if not hasattr(record, k):
                setattr(record, k, v)
        return True


def setup(fmt: str = "json", level: int = logging.INFO) -> None:
    """Configure the root logger once per process (idempotent)."""
    root = logging.getLogger()
    if getattr(root, "_spool_logging", False):
        return
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_ContextFilter())
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "celery"):  # their records go through ours, once
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    root._spool_logging = True  # type: ignore[attr-defined]


def bind(**fields: Any) -> None:
    """Add ids to the current context (this request, or this worker thread's attempt)."""
    CONTEXT.set({**(CONTEXT.get() or {}), **{k: v for k, v in fields.items() if v is not None}})


@contextmanager
def bound(**fields: Any) -> Iterator[None]:
    token = CONTEXT.set({**(CONTEXT.get() or {}), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        CONTEXT.reset(token)
