"""Route llama.cpp's logging into Python logging: errors only (it prints every tensor it loads)."""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("llama.cpp")
_installed = False


def quiet_llama_logs() -> None:
    global _installed
    if _installed:
        return
    import llama_cpp as llc

    @llc.llama_log_callback
    def _cb(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if level == 4:  # GGML_LOG_LEVEL_ERROR
            log.error("%s", text.decode(errors="replace").rstrip())

    quiet_llama_logs._cb = _cb  # type: ignore[attr-defined]  # keep the C callback alive
    llc.llama_log_set(_cb, ctypes.c_void_p(0))
    _installed = True
