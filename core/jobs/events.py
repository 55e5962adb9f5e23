"""Moved: the engine-neutral events and results live in core/generation/events.py.

core/protocol renders them and may import only core.generation, so they sit below it there. These
names stay importable from here only until core/jobs/lifecycle.py and workers/runner.py (in other
hands while this moved) import them from their home; new code imports core.generation.events.
"""

from core.generation.events import (
    TERMINAL,
    Cancelled,
    ChoiceResult,
    Delta,
    Done,
    ErrorInfo,
    Event,
    Failed,
    JobResult,
    TerminalRow,
    TokenScore,
    TopToken,
    Usage,
    decode,
    encode,
    error_of,
    from_row,
    is_terminal,
    result_of,
    usage_of,
)

__all__ = [
    "TERMINAL",
    "Cancelled",
    "ChoiceResult",
    "Delta",
    "Done",
    "ErrorInfo",
    "Event",
    "Failed",
    "JobResult",
    "TerminalRow",
    "TokenScore",
    "TopToken",
    "Usage",
    "decode",
    "encode",
    "error_of",
    "from_row",
    "is_terminal",
    "result_of",
    "usage_of",
]
