"""The CPU engine's shared-prefix copy, on and off in one run: `n` sampled choices of one long prompt
(a request's `n`, or requests sharing a system prompt), in-process, one thread. With the copy, the
first choice prefills the prompt and the others copy its KV stream; without it (the copy threshold
set out of reach, as before 2026-11-28), each prefills its own. Prints CPU seconds. The texts are
not compared: prefills that share a step are cut into per-sequence pieces, and llama.cpp's CPU matrix
product takes another kernel below 64 rows, so the choices' KV differs in its last bits between the
two ways (docs/parameters.md, "Reproducibility"); that a copy is exact is a test's
(tests/integration/test_llamacpp_engine.py: test_a_copied_prefix_is_the_one_its_slot_held).

    python -m ops.bench.shared_prefix            # n=16, a ~220-token prompt, 24 tokens each
    python -m ops.bench.shared_prefix 50 400 40  # n, prompt tokens (about), tokens per choice
"""

from __future__ import annotations

import sys
import time

from core.generation.params import GenerationParams
from core.registry import smollm2_gguf
from workers.engine import llamacpp
from workers.engine.base import SeqSpec, TokenEvent


def _run(engine: llamacpp.LlamaCppEngine, tag: str, prompt: list[int], n: int, tokens: int) -> float:
    for slot in engine._decoder.slot_tokens:  # nothing cached from the other run
        engine._decoder.slot_tokens[slot] = []
    p = GenerationParams(max_tokens=tokens, temperature=0.9, ignore_eos=True)
    for c in range(n):
        engine.add(SeqSpec((tag, c), list(prompt), tokens, p, 1000 + c, interactive=True, cache_scope="t"))
    made = 0
    cpu = time.process_time()
    while engine.has_work():
        made += sum(1 for ev in engine.step() if isinstance(ev, TokenEvent) and ev.token_id is not None)
    assert made == n * tokens, made
    return time.process_time() - cpu


def main(n: int = 16, prompt_tokens: int = 220, tokens: int = 24) -> None:
    engine = llamacpp.LlamaCppEngine(
        "smollm2", smollm2_gguf(), n_ctx=1024, max_batch=16, interactive_slots=4, n_threads=1
    )
    words = "A long system prompt that every request of this tenant starts with, word for word. "
    prompt = (engine.tokenize(words * (prompt_tokens // 16 + 1)))[:prompt_tokens]
    on_s = _run(engine, "on", prompt, n, tokens)
    copies = engine._decoder.copies
    threshold, llamacpp._COPY_MIN = llamacpp._COPY_MIN, 10**9
    try:
        off_s = _run(engine, "off", prompt, n, tokens)
    finally:
        llamacpp._COPY_MIN = threshold
    print(
        f"n={n} prompt={len(prompt)} tokens={tokens}: copy off {off_s:.2f} CPU s, on {on_s:.2f} CPU s "
        f"({off_s / on_s:.2f}x less with it), {copies} copies"
    )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
