"""What the ExLlamaV3 engine does at start and under load, on the pinned exllamav3's own code (its
`Generator`, `Job`, `Filter` and `Config`, as in test_gpu_promises.py: CUDA extension stubbed, a
stand-in model), each a first-run risk of issue 50:

- the grammar ends the answer: exllamav3's Job ends a sequence whose filter completed (`end_filter`)
  only with `eos_after_completed`; with False it switched the filter off and sampled on unconstrained;
- a job still in the library's prefill, including one whose prefill passes exllamav3 defers while
  others generate (`prefill_cooldown`), is never silent to the engine loop's watchdog: every step it
  either reports an event or is among the engine's `waiting_keys()`, which the watchdog skips;
- top logprobs come from the returned logits, so the job asks the library for no top tokens (it sorted
  the whole vocabulary every token for them), and the top lists are still there;
- the context is capped by the model's maximum as exllamav3's own `Config` reads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_gpu_contract import contract_path  # noqa: F401  (the fixture installing the pinned wheels)

ROOT = Path(__file__).resolve().parents[2]
CASES = ("grammar", "prefill", "top_tokens", "context")
_results: dict[str, Any] = {}


def run_case(case: str, target: Path) -> Any:
    pytest.importorskip("torch", reason="the library generators run on CPU torch (the eval extra)")
    if not _results:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)]), "EXL3_FUSED_SAMPLER": "0"}
        out = subprocess.run(
            [sys.executable, __file__, *CASES], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
        )
        assert out.returncode == 0, out.stderr[-4000:]
        _results.update(json.loads(out.stdout.strip().splitlines()[-1]))
    return _results[case]


def test_the_grammar_ends_the_answer_on_exllamav3s_job(contract_path: Path) -> None:  # noqa: F811
    """A grammar of exactly [7, 9]: the stand-in row prefers 7 always; the job ends at the grammar's end
    ("end_filter" -> stop). With eos_after_completed=False it went on: [7, 9, 7, 7, 7, 7], "length"."""
    got = run_case("grammar", contract_path)
    assert got == {"tokens": [7, 9], "finish": "stop", "error": None, "eos_reason": "end_filter"}


def test_a_prefilling_job_is_never_silent_to_the_watchdog(contract_path: Path) -> None:  # noqa: F811
    """One job generates while three long prompts arrive: exllamav3 runs one prefill pass every
    prefill_cooldown + 1 steps, one prompt a pass in turn, so each prompt sits out many steps with no
    result. Before, they were neither reporting nor waiting, and a watchdog period of that many steps
    failed them (SPOOL_SEQUENCE_STALL_S under load)."""
    got = run_case("prefill", contract_path)
    assert got["deferred_steps"] > 4  # the library did defer them (else this shows nothing)
    assert got["silent_steps"] == {"gen": 0, "long0": 0, "long1": 0, "long2": 0}
    assert got["finish"] == {"gen": "length", "long0": "length", "long1": "length", "long2": "length"}


def test_exllamav3_is_asked_for_no_top_tokens_and_top_logprobs_come_anyway(contract_path: Path) -> None:  # noqa: F811
    got = run_case("top_tokens", contract_path)
    assert got["results_with_top_k"] == 0
    assert got["tokens"] == 8 and got["top_sizes"] == [2] * 8  # every token: its 2 top logprobs


def test_the_context_is_capped_by_the_models_maximum(contract_path: Path) -> None:  # noqa: F811
    """docs/gpu.md: `n_ctx` is capped by the model's own (config.json); exllamav3's Config reads it."""
    assert run_case("context", contract_path) == {"8192": 4096, "2048": 2048}


# -- the subprocess ---------------------------------------------------------------------------------
class GrammarOf:
    """An llguidance matcher's interface over a fixed token sequence (what the engine's filter calls)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.pos, self.error = tokens, 0, None

    def consume_token(self, t: int) -> bool:
        if self.pos >= len(self.tokens) or t != self.tokens[self.pos]:
            self.error = f"token {t} rejected"
            return False
        self.pos += 1
        return True

    def is_stopped(self) -> bool:
        return self.pos == len(self.tokens)

    def is_error(self) -> bool:
        return self.error is not None

    def get_error(self) -> str | None:
        return self.error

    def rollback(self, n: int) -> None:
        self.pos -= n

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        import ctypes

        words = (ctypes.c_int32 * (size // 4)).from_address(ptr)
        for i in range(size // 4):
            words[i] = 0
        if not self.is_stopped():
            t = self.tokens[self.pos]
            words[t // 32] |= 1 << (t % 32)


def _grammar(gen: Any, tok: Any, model: Any) -> Any:
    from tests.unit.test_gpu_promises import _engine, _run_engine, _spec

    eng = _engine("exllamav3", gen, tok, model)
    reasons: list[str] = []
    iterate = gen.iterate

    def iterate_and_note() -> Any:
        out = iterate()
        reasons.extend(r["eos_reason"] for r in out if r.get("eos") and "eos_reason" in r)
        return out

    gen.iterate = iterate_and_note
    spec = _spec("g", "A", [3, 4, 5], 6)
    spec = type(spec)(**{**spec.__dict__, "matcher": GrammarOf([7, 9])})
    evs = _run_engine(eng, [spec])["g"]
    return {
        "tokens": [e.token_id for e in evs if e.token_id is not None],
        "finish": evs[-1].finish_reason,
        "error": evs[-1].error,
        "eos_reason": reasons[-1] if reasons else None,
    }


def _prefill(gen: Any, tok: Any, model: Any) -> Any:
    from tests.unit.test_gpu_promises import LONG, _engine, _spec
    from workers.engine.base import TokenEvent

    eng = _engine("exllamav3", gen, tok, model)
    eng.add(_spec("gen", "A", [3, 4, 5], 80, ignore_eos=True))
    for _ in range(3):
        eng.step()  # "gen" is generating before the long prompts arrive
    for i in range(3):  # three tenants: no prefix reuse between them
        eng.add(_spec(f"long{i}", f"T{i}", LONG, 3, ignore_eos=True))
    silent: dict[str, int] = {}
    longest: dict[str, int] = {}
    finish: dict[str, str | None] = {}
    deferred = 0
    for _ in range(400):
        if not eng.has_work():
            break
        live = set(eng._live) | {s.key for s in eng._waiting}
        before = {k: int(job.sequences[0].kv_position) if job.sequences else 0 for k, (job, _) in eng._live.items()}
        events = eng.step()
        heard = {ev.key for ev in events}
        waiting = eng.waiting_keys()
        for key in live:  # what the loop's watchdog sees after this step: an event, or a wait
            silent[key] = 0 if key in heard or key in waiting else silent.get(key, 0) + 1
            longest[key] = max(longest.get(key, 0), silent[key])
        for k, (job, _) in eng._live.items():
            if k in before and job.sequences and not job.is_prefill_done():
                deferred += int(job.sequences[0].kv_position) == before[k]
        for ev in events:
            if isinstance(ev, TokenEvent) and ev.ended:
                finish[ev.key] = ev.finish_reason
    return {"silent_steps": longest, "finish": finish, "deferred_steps": deferred}


def _top_tokens(gen: Any, tok: Any, model: Any) -> Any:
    from tests.unit.test_gpu_promises import _engine, _run_engine, _spec

    eng = _engine("exllamav3", gen, tok, model)
    seen: list[dict[str, Any]] = []
    iterate = gen.iterate

    def iterate_and_note() -> Any:
        out = iterate()
        seen.extend(out)
        return out

    gen.iterate = iterate_and_note
    evs = _run_engine(eng, [_spec("t", "A", [3, 4, 5], 8, logprobs=2)])["t"]
    return {
        "results_with_top_k": sum("top_k_tokens" in r for r in seen),
        "top_sizes": [len(e.top) for e in evs if e.top is not None],
        "tokens": sum(e.token_id is not None for e in evs),
    }


def _context() -> Any:
    import tempfile

    from exllamav3 import Config

    from workers.engine.exllamav3 import context_for

    llama = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 1000,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "max_position_embeddings": 4096,
    }
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps(llama))
        config = Config.from_directory(folder)
        out["8192"] = context_for(config, 8192)
        out["2048"] = context_for(config, 2048)
    return out


def _child(case: str) -> Any:
    if case == "context":
        return _context()
    from exllamav3 import Generator

    from tests.unit.test_gpu_promises import _stand_ins

    model, cache, tok = _stand_ins(paged=True)
    gen = Generator(model=model, cache=cache, tokenizer=tok, max_batch_size=4, max_chunk_size=512)
    return {"grammar": _grammar, "prefill": _prefill, "top_tokens": _top_tokens}[case](gen, tok, model)


def _bitmask_kernel() -> None:
    """exllamav3_ext's apply_logit_bitmask (a packed grammar mask: bit clear = masked out, tokens past
    the mask's width too), ported to torch as test_gpu_promises ports the kernels its cases reach."""
    import torch

    def apply_logit_bitmask(logits: Any, out: Any, bits: Any) -> None:
        idx = torch.arange(logits.shape[-1])
        words = bits.view(bits.shape[0], -1).to(torch.int64) & 0xFFFFFFFF
        inside = idx < words.shape[-1] * 32
        picked = words[:, (idx >> 5).clamp(max=words.shape[-1] - 1)]
        allowed = ((picked >> (idx & 31)) & 1).bool() & inside
        out.copy_(torch.where(allowed, logits, torch.full_like(logits, float("-inf"))))

    sys.modules["exllamav3.ext"].exllamav3_ext.apply_logit_bitmask.side_effect = apply_logit_bitmask  # type: ignore[attr-defined]


if __name__ == "__main__":
    from tests.unit.test_gpu_promises import _install

    _install()
    _bitmask_kernel()
    print(json.dumps({case: _child(case) for case in sys.argv[1:]}))
