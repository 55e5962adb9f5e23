"""The clients people use read a stream through a pause (issue 24).

A pause is what crash-resume, preemption, a lease takeover or a slow step look like from outside: the
stream goes silent and Spool sends keep-alives. The worker is frozen with SIGSTOP after the third
chunk for 5 s (longer than the 2 s keep-alive interval and the test stack's 3 s lease, so the job is
also taken over and resumed); each client must read on and end with the undisturbed run's text.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import pytest

from tests.conftest import MODEL

# wallclock: each client reads through a 5 s SIGSTOP (42 s of wall, 22 s of CPU in a shard)
# ops/test.sh runs it beside the CPU-bound shards.
pytestmark = pytest.mark.wallclock

PAUSE_S = 5.0
MAX_TOKENS = 120
PROMPT = "Write a long story about a lighthouse keeper and a storm."
MESSAGES = [{"role": "user", "content": PROMPT}]


def _read_through_pause(stack, pieces: Iterable[str]) -> tuple[str, float]:
    """Read every piece; freeze the worker after the third for PAUSE_S. Returns (text, longest gap)."""
    pid = stack.procs["worker"].pid
    text, n, gap, last = [], 0, 0.0, time.monotonic()
    timer: threading.Timer | None = None
    try:
        for piece in pieces:
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            if not piece:
                continue
            text.append(piece)
            n += 1
            if n == 3:
                os.kill(pid, signal.SIGSTOP)
                timer = threading.Timer(PAUSE_S, os.kill, (pid, signal.SIGCONT))
                timer.start()
    finally:
        if timer is not None:
            timer.join()
        os.kill(pid, signal.SIGCONT)
    return "".join(text), gap


def _check(stack, make: Callable[[], Iterator[str]]) -> None:
    undisturbed = "".join(make())
    assert len(undisturbed) > 40, undisturbed
    text, gap = _read_through_pause(stack, make())
    # The stream really paused mid-way (else the test proves nothing)...
    assert gap >= PAUSE_S - 1.5, f"longest silence {gap:.1f}s: the worker finished before the pause"
    # ...and the client read on to the same text.
    assert text == undisturbed


def _sdk_completion(stack) -> Iterator[str]:
    client = stack.openai()
    for chunk in client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},  # a plain prompt may end at once; the pause needs a long stream
    ):
        yield chunk.choices[0].text if chunk.choices else ""


def _sdk_chat(stack) -> Iterator[str]:
    client = stack.openai()
    for chunk in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
    ):
        yield (chunk.choices[0].delta.content or "") if chunk.choices else ""


def test_openai_sdk_completion_stream_reads_through_a_pause(stack):
    _check(stack, lambda: _sdk_completion(stack))


def test_openai_sdk_chat_stream_reads_through_a_pause(stack):
    _check(stack, lambda: _sdk_chat(stack))


def test_langchain_chatopenai_stream_reads_through_a_pause(stack):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=stack.base_url + "/v1",
        api_key=stack.keys["alpha"],
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        timeout=120,
    )

    def pieces() -> Iterator[str]:
        for chunk in llm.stream(PROMPT):
            yield chunk.content if isinstance(chunk.content, str) else ""

    _check(stack, pieces)


def test_litellm_stream_reads_through_a_pause(stack, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list at import
    litellm = pytest.importorskip("litellm")

    def pieces() -> Iterator[str]:
        for chunk in litellm.completion(
            model=f"openai/{MODEL}",
            api_base=stack.base_url + "/v1",
            api_key=stack.keys["alpha"],
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            num_retries=0,
            timeout=120,
        ):
            yield (chunk.choices[0].delta.content or "") if chunk.choices else ""

    _check(stack, pieces)
