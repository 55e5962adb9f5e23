"""The GPU engines keep the CPU engine's promises, shown on the real generators of the pinned
exllamav2 and exllamav3 (.venv/gpu-contract, as in test_gpu_contract.py), with no GPU:

- prefix reuse never crosses tenants, and `cached_tokens` counts only the tenant's own prefix;
- presence and frequency penalties count the output only;
- logprobs are of the model's row, before penalties, bias and the blocked EOS of min_tokens;
- the EOS token that ends a sequence is reported with its logprob;
- a job failing inside the library ends alone, and the scheduling both engines share
  (exllama_base.ExLlamaEngine: priority, admission, cancel, a failed step) behaves alike.

Each case runs in a subprocess (this file as a script), which stubs what needs CUDA and nothing
else: the libraries' compiled extensions (a MagicMock module, with the few kernels these paths call
ported to torch from the C++/CUDA sources in the wheels: prefix match count, repetition and
presence/frequency penalties, greedy sampling, row add, exllamav3's decode staging stores), pinned
host memory and CUDA synchronize, flash-attn's presence (exllamav2's paged mode asks for it), and
the model and its KV cache: a stand-in whose forward returns fixed logits rows. Everything else is
the libraries' own code: `ExLlamaV2DynamicGenerator` and `exllamav3.Generator` built by their
constructors and driven by `iterate()` (page table, hashing, allocation, prefill, sampling,
streaming), with jobs made by the engines' own `make_job` and results read by
`exl2_mapping.events_from_result`, as the engines do. exllamav3's fused sampling kernel is off
(EXL3_FUSED_SAMPLER=0, its step-by-step path); the penalty steps it keeps ahead of it are the same.
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
PAGE = 256
V = 1000  # vocabulary of the stand-in model (its head is padded to 1024)
EOS = 2
LONG = [(i * 7919) % 997 + 3 for i in range(5 * PAGE + 17)]  # five full pages and 17 tokens
SHORT = [(i * 31) % 991 + 3 for i in range(200)]  # less than one page
TAIL = [(i * 17) % 983 + 3 for i in range(10)]


# Each engine's cases run in one child process (torch and the library imported once, ~3 s), each on
# stand-ins of its own; the first test of an engine runs them all, the rest read the results.
CASES = {
    "exllamav2": ("prefix", "unpaged", "penalties", "logprobs", "errors", "scheduling"),
    "exllamav3": ("prefix", "penalties", "logprobs", "errors", "scheduling", "semantics"),
}
_results: dict[str, dict[str, Any]] = {}


def run_case(case: str, target: Path) -> Any:
    pytest.importorskip("torch", reason="the library generators run on CPU torch (the eval extra)")
    engine = case.partition(":")[0]
    if engine not in _results:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)]), "EXL3_FUSED_SAMPLER": "0"}
        cases = [f"{engine}:{c}" for c in CASES[engine]]
        out = subprocess.run(
            [sys.executable, __file__, *cases], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
        )
        assert out.returncode == 0, out.stderr[-4000:]
        _results[engine] = json.loads(out.stdout.strip().splitlines()[-1])
    return _results[engine][case]


ENGINES = ["exllamav2", "exllamav3"]


@pytest.mark.parametrize("engine", ENGINES)
def test_same_long_prompt_two_tenants_no_reuse_across_reuse_within(engine: str, contract_path: Path) -> None:  # noqa: F811
    got = run_case(f"{engine}:prefix", contract_path)
    # A's prompt cached; B sends the same tokens: nothing reused, nothing reported; A again: every
    # full page plus the partial last page (all but the last prompt token, which is never cached).
    assert got["long"] == {"A": 0, "B": 0, "A again": len(LONG) - 1}
    # A prompt shorter than a page is reused only as a partial copy of a first page: the page whose
    # predecessor hash is None, which every tenant's first page shares. Not B's to copy; A's own (its
    # whole first prompt: its last token was written to the page with the first output token).
    assert got["short"] == {"A": 0, "B": 0, "A again": len(SHORT)}
    # Pages completed while generating are hashed with the tenant's salt too: a later prompt that
    # starts with A's prompt and output reuses that page for A only.
    assert got["generated"] == {"B": 0, "A": PAGE}
    # cache_prompt: false reuses nothing and leaves the tenant's cached pages for its next request.
    assert got["no_reuse"] == {"A, cache_prompt false": 0, "A": len(LONG) - 1}


def test_unpaged_exllamav2_reuses_the_last_prompt_only_for_its_tenant(contract_path: Path) -> None:  # noqa: F811
    """Without flash-attn exllamav2 runs one job at a time on one page, and a new job reuses what the
    last one left there when it starts with the same tokens."""
    got = run_case("exllamav2:unpaged", contract_path)
    assert got == {"A": 0, "A again": len(SHORT) - 1, "B": 0, "A after B": 0, "A again after A": len(SHORT) - 1}


@pytest.mark.parametrize("engine", ENGINES)
def test_presence_frequency_count_the_output_only(engine: str, contract_path: Path) -> None:  # noqa: F811
    """The stand-in model returns the same row at every step: token 7 at 5.0, 9 at 4.0, EOS at 3.0, the
    rest 0, and the prompt repeats token 7. With presence 3.0 over the output only, greedy picks 7 (the
    prompt's sevens do not count), then 9 (7 is now at 2.0), then EOS (9 at 1.0). Counting the prompt
    would pick 9 first. Frequency 1.0 on top: 7, 9, then EOS (7 at 1.0, 9 at 0.0)."""
    got = run_case(f"{engine}:penalties", contract_path)
    assert got == {"presence": [7, 9, EOS], "frequency": [7, 9, EOS]}


@pytest.mark.parametrize("engine", ENGINES)
def test_logprobs_of_the_model_row_and_the_eos_token_reported(engine: str, contract_path: Path) -> None:  # noqa: F811
    """The stand-in model's row follows the last token (5 -> 7 -> 9 -> EOS at 5.0, a few others above
    0). min_tokens=1 blocks EOS for the first token and a logit bias sits on token 4: neither may show in
    the logprobs, which are log-softmax of the model's own row, for every token and for the EOS that
    ends the sequence. (exllamav3's sampler never edited the row; exllamav2's edited it in place.)"""
    got = run_case(f"{engine}:logprobs", contract_path)
    assert got["tokens"] == [7, 9]
    assert got["eos_id"] == EOS and got["finish"] == "stop"
    assert len(got["logprobs"]) == 3  # 7, 9 and the EOS token
    assert got["logprobs"] == pytest.approx(got["raw_logprobs"], abs=1e-5)
    assert [[t for t, _ in top] for top in got["top"]] == [[7], [9], [EOS]]
    assert [lp for top in got["top"] for _, lp in top] == pytest.approx(got["raw_logprobs"], abs=1e-5)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_jobs_failure_in_the_library_fails_that_sequence_alone(engine: str, contract_path: Path) -> None:  # noqa: F811
    """The engine itself (its step, the generator attached by its own `attach`) over the library's
    generator: a job whose prefill raises (exllamav3 reports it as an "error" result carrying the job
    but no identifier; exllamav2 raised out of iterate() for the whole batch) and a job whose sampling
    raises (exllamav3's NonFiniteLogits; a constraint whose mask fails) end with the library's message,
    and only they: the co-batched job generates every token, and the engine holds nothing after."""
    got = run_case(f"{engine}:errors", contract_path)
    assert got["prefill"]["error"] and "illegal memory access (stand-in)" in got["prefill"]["error"]
    assert got["sampling"]["error"] and got["sampling"]["error"].startswith("engine error (")
    assert got["good"] == {"tokens": 6, "finish": "length", "error": None}
    assert got["left"] == {"has_work": False, "generator_jobs": 0}


@pytest.mark.parametrize("engine", ENGINES)
def test_the_engines_schedule_alike(engine: str, contract_path: Path) -> None:  # noqa: F811
    """The scheduling both engines share (exllama_base.ExLlamaEngine) over the library's generator, two
    jobs of batch room: waiting interactive sequences start before batch ones; one that cannot start
    fails alone and one of max_new_tokens 0 ends, both in the step that admits them; a cancelled one
    says no more; a failed iterate() raises and leaves nothing behind, in the engine or the generator."""
    got = run_case(f"{engine}:scheduling", contract_path)
    assert got["first_step"] == [
        ["bad", "failed: cannot start"],
        ["p0", "prompt"],
        ["p0", "length"],
        ["good", "prompt"],
        ["good", "token"],
        ["gone", "prompt"],
        ["gone", "token"],
    ]
    assert got["waiting_after_first_step"] == ["batch1", "batch2"]
    assert got["ends"] == {"good": "length", "batch1": "length", "batch2": "length", "gone": None}
    assert got["tokens"] == {"good": 3, "batch1": 3, "batch2": 3, "gone": 4}
    assert got["iterate_failed"] == {"raised": "iterate failed", "has_work": False, "generator_jobs": 0}


def test_exllamav3_keeps_the_cpu_engines_semantics(contract_path: Path) -> None:  # noqa: F811
    """On exllamav3's own generator: `ignore_eos` never samples an EOS (with presence 3.0 over the output
    the stand-in's row puts EOS first after 7 and 9: without a stop condition exllamav3 emitted it and
    went on), and best_of > n without logprobs gets the logits its ranking needs."""
    got = run_case("exllamav3:semantics", contract_path)
    assert got["ignore_eos"] == [7, 9, 7, 7, 7, 7]
    assert got["best_of_logprobs"] is True


# -- the subprocess ---------------------------------------------------------------------------------
def _install() -> None:
    """The CUDA extensions and triton as stubs, with the kernels the cases reach ported to torch."""
    import functools
    import types
    from unittest import mock

    class Stub(types.ModuleType):  # a compiled extension / triton: any attribute is a mock
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return mock.MagicMock(name=name)

    for name in ("exllamav2.ext", "exllamav3.ext", "triton", "triton.language"):
        sys.modules[name] = Stub(name)
    ext2 = sys.modules["exllamav2.ext"].exllamav2_ext = mock.MagicMock(name="exllamav2_ext")  # type: ignore[attr-defined]
    ext3 = sys.modules["exllamav3.ext"].exllamav3_ext = mock.MagicMock(name="exllamav3_ext")  # type: ignore[attr-defined]

    import torch

    def unpinned(fn: Any) -> Any:  # pinned host memory needs a CUDA driver
        @functools.wraps(fn)
        def call(*a: Any, pin_memory: bool = False, **kw: Any) -> Any:
            return fn(*a, **kw)

        return call

    for fn in ("zeros", "empty", "full", "ones", "tensor"):
        setattr(torch, fn, unpinned(getattr(torch, fn)))
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

    # -- kernels, ported from the wheels' sources ----------------------------------------------
    def count_match(a: Any, b: Any, limit: int) -> int:  # leading equal tokens, at most `limit`
        x, y = a[0, :limit], b[0, :limit]
        n = min(len(x), len(y))
        diff = (x[:n] != y[:n]).nonzero()
        return int(diff[0, 0]) if len(diff) else n

    def rep_penalty(seq: Any, rep_p: float, sustain: int, decay: int, freq: float, pres: float, logits: Any) -> None:
        """exllamav2_ext/cpp/sampling.cpp: apply_rep_penalty_cpu (no decay)."""
        assert decay == 0
        row = logits.view(-1)
        ids = seq[0].tolist()
        window = ids[max(len(ids) - (len(ids) if sustain == -1 else sustain), 0) :]
        seen: set[int] = set()
        for t in reversed(window):
            if t not in seen:
                row[t] = row[t] / rep_p if row[t] > 0 else row[t] * rep_p
                row[t] -= pres
                seen.add(t)
            row[t] -= freq

    def sample_basic(logits: Any, temperature: float, top_k: int, *rest: Any) -> list[float]:
        """exllamav2_ext sample_basic, greedy only (top_k 1): the argmax, probability 1."""
        assert top_k == 1
        tokens, probs = rest[6], rest[7]
        tokens[:, 0] = logits[:, 0, :].argmax(-1)
        probs[:, 0] = 1.0
        return []

    def fadd(a: Any, b: Any) -> None:
        a += b

    ext2.count_match.side_effect = count_match
    ext2.apply_rep_penalty.side_effect = rep_penalty
    ext2.sample_basic.side_effect = sample_basic
    ext2.fast_fadd_cpu.side_effect = fadd
    ext2.partial_strings_match.return_value = -1

    def pens(factor: Any, past: Any, sustain: int, decay: int) -> Any:
        """Which vocabulary entries the last `sustain` past ids hold (exllamav3_ext/generator/rep_pen.cu)."""
        assert decay == 0
        ids = past[0, max(past.shape[-1] - sustain, 0) :] if sustain > 0 else past[0, :0]
        return torch.bincount(ids, minlength=factor.shape[-1])[: factor.shape[-1]].to(torch.float)

    def rep_pens(inp: Any, out: Any, past: Any, rep_p: float, sustain: int, decay: int) -> None:
        seen = pens(inp, past, sustain, decay) > 0
        v = inp.float()
        out.copy_(torch.where(seen, torch.where(v > 0, v / rep_p, v * rep_p), v))

    def pres_freq_pens(inp: Any, out: Any, past: Any, pres: float, freq: float, sustain: int, decay: int) -> None:
        counts = pens(inp, past, sustain, decay)
        out.copy_(inp.float() - counts * freq - (counts > 0).float() * pres)

    def stage_decode(arena: Any, width: int, block_index: Any, kv_position: Any, rope: Any, *decode: Any) -> None:
        """exllamav3_ext/generator/staging.cpp: the token stores (the tables are the model's business)."""
        batch_ids, seq_ids, page_seq, page_offset = decode
        for b, ids in enumerate(seq_ids):
            tok = ids.view(-1)[kv_position[b]]
            batch_ids[b, 0] = tok
            page_seq[b].view(-1)[page_offset[b]] = tok

    ext3.count_match_tensor.side_effect = count_match
    ext3.generator_stage_decode.side_effect = stage_decode
    ext3.apply_rep_pens.side_effect = rep_pens
    ext3.apply_pres_freq_pens.side_effect = pres_freq_pens


def _child(case: str) -> Any:
    engine, _, what = case.partition(":")
    return (_exl2 if engine == "exllamav2" else _exl3)(what)


ROW = {7: 5.0, 9: 4.0, EOS: 3.0}  # the stand-in model's constant row (the rest 0)
CHAIN = {5: 7, 7: 9, 9: EOS}  # ... or, for the logprobs case, the winner after each token
CHAIN_BASE = {11: 2.0, 12: 1.0, 7: 0.5, 9: 0.25, EOS: 0.125}


def _model_row(width: int, last: int | None = None) -> Any:
    import torch

    row = torch.zeros(width)
    values = ROW if last is None else {**CHAIN_BASE, CHAIN.get(last, 7): 5.0}
    for t, v in values.items():
        row[t] = v
    return row


POISON = 0  # a prompt holding it fails its prefill (no other case's prompt does: theirs start at 3)
NAN_AFTER = 1  # the stand-in model's row after this token is not finite


def _stand_ins(paged: bool, chain: bool = False) -> tuple[Any, Any, Any]:
    import torch

    class Config:
        vocab_size = V
        max_input_len = 2048
        max_batch_size = 16
        max_seq_len = 4096
        no_flash_attn = False
        infer_params = None

        class arch:
            class lm:
                mrope = False

    class Model:  # the GPU: a forward that returns the same row at every position
        config = Config()
        caps: dict[str, Any] = {}
        output_device = torch.device("cpu")
        loaded_tp = False

        def logits(self, ids: Any) -> Any:
            if ids.shape[-1] > 1 and bool((ids == POISON).any()):
                raise RuntimeError("CUDA error: an illegal memory access (stand-in)")
            if bool((ids == NAN_AFTER).any()):
                out = _model_row(1024).repeat(ids.shape[0], ids.shape[1], 1)
                out[ids == NAN_AFTER] = float("nan")
                return out
            if not chain:
                return _model_row(1024).repeat(ids.shape[0], ids.shape[1], 1)
            rows = [[_model_row(1024, int(t)) for t in seq] for seq in ids]
            return torch.stack([torch.stack(r) for r in rows])

        def forward_chunk(self, input_ids: Any, preprocess_only: bool = False, **kw: Any) -> Any:
            if input_ids.shape[-1] > 1 and bool((input_ids == POISON).any()):  # exllamav2's prefill
                raise RuntimeError("CUDA error: an illegal memory access (stand-in)")
            return None if preprocess_only else {"logits": self.logits(input_ids)}

        def forward(self, input_ids: Any, params: Any = None, **kw: Any) -> Any:
            return self.logits(input_ids)

        def prefill(self, input_ids: Any, params: Any) -> None:
            if bool((input_ids == POISON).any()):
                raise RuntimeError("CUDA error: an illegal memory access (stand-in)")

        def get_cache_layers(self) -> list[Any]:
            return []

        def prefetch_tokens(self, ids: Any) -> None:
            pass

    class Cache:  # KV storage: the copies are the GPU's business, the page table is the library's
        max_seq_len = 64 * PAGE if paged else 4096  # room for every case: nothing is evicted
        max_num_tokens = 64 * PAGE
        batch_size = 1
        initialized = True

        def all_tensors(self) -> list[Any]:
            return []

        def copy_states(self, *a: Any) -> None:
            pass

        def copy_page(self, *a: Any) -> None:
            pass

    class Tokenizer:
        actual_vocab_size = V

        def get_id_to_piece_list(self, special: bool = False) -> list[str]:
            return [f"<{i}>" for i in range(V)]

        def get_vocab_size(self) -> int:
            return V

    return Model(), Cache(), Tokenizer()


def _drive(gen: Any, job: Any, key: Any, want_logprobs: bool = False) -> tuple[int, list[Any]]:
    """Run one job to its end as the engine's step() does: (the prompt tokens its PromptEvent reports
    as cached, which become the usage's `cached_tokens`; its TokenEvents)."""
    from workers.engine.base import PromptEvent
    from workers.engine.exl2_mapping import SeqState, events_from_result

    gen.enqueue(job)
    state = SeqState(key, want_logprobs, 1 if want_logprobs else 0)
    events: list[Any] = []
    for _ in range(100):
        for result in gen.iterate():
            events += events_from_result(result, {key: state}, n_vocab=V)
        if events and not isinstance(events[-1], PromptEvent) and events[-1].ended:
            (prompt,) = [e for e in events if isinstance(e, PromptEvent)]
            return prompt.cached, [e for e in events if not isinstance(e, PromptEvent)]
    raise AssertionError("the job did not end")


def _spec(key: Any, tenant: str, ids: list[int], n: int = 4, **params: Any) -> Any:
    from core.generation.params import GenerationParams
    from workers.engine.base import SeqSpec

    p = GenerationParams(**{"temperature": 0.0, **params})
    return SeqSpec(key=key, prompt_ids=ids, max_new_tokens=n, params=p, seed=1, cache_scope=tenant)


def _logprobs(events: list[Any]) -> dict[str, Any]:
    from workers.engine.logits import log_softmax

    tokens = [e.token_id for e in events if e.token_id is not None]
    last = events[-1]
    inputs = [5, *tokens]  # the token each step's row follows
    scored = [*tokens, last.eos_id]
    raw = [float(log_softmax(_model_row(1024, i)[:V].numpy())[t]) for i, t in zip(inputs, scored, strict=True)]
    return {
        "tokens": tokens,
        "eos_id": last.eos_id,
        "finish": last.finish_reason,
        "logprobs": [e.logprob for e in events if e.logprob is not None],
        "raw_logprobs": raw,
        "top": [[list(pair) for pair in e.top] for e in events if e.top],
    }


def _output(events: list[Any]) -> list[int]:
    return [e.token_id if e.eos_id is None else e.eos_id for e in events if e.token_id is not None or e.eos_id]


class BrokenMatcher:
    """An llguidance matcher whose every call fails: the sequence's constraint breaks mid-step."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"matcher broke in {name}")


def _engine(kind: str, gen: Any, tok: Any, model: Any) -> Any:
    """The engine class itself around the library's generator, through its own `attach`."""
    if kind == "exllamav3":
        from workers.engine.exllamav3 import ExLlamaV3Engine

        eng = ExLlamaV3Engine.__new__(ExLlamaV3Engine)
        eng.attach(gen, tok, [EOS])
    else:
        from workers.engine.exllamav2 import ExLlamaV2Engine

        eng = ExLlamaV2Engine.__new__(ExLlamaV2Engine)
        eng.attach(gen, tok, [EOS], V)
        eng._model = model
    eng.model_id, eng.n_ctx, eng.max_batch = "stand-in", 4096, 4
    return eng


def _run_engine(eng: Any, specs: list[Any], steps: int = 200) -> dict[Any, list[Any]]:
    from workers.engine.base import TokenEvent

    for spec in specs:
        eng.add(spec)
    got: dict[Any, list[Any]] = {spec.key: [] for spec in specs}
    for _ in range(steps):
        if not eng.has_work():
            break
        for ev in eng.step():
            if isinstance(ev, TokenEvent):
                got[ev.key].append(ev)
    return got


def _errors(kind: str, gen: Any, tok: Any, model: Any) -> Any:
    from dataclasses import replace

    eng = _engine(kind, gen, tok, model)
    sampling = _spec("sampling", "A", [3, 4, NAN_AFTER], 6)
    if kind == "exllamav2":  # its sampler takes NaN rows without a word: a constraint fails instead
        sampling = replace(_spec("sampling", "A", [3, 4, 5], 6), matcher=BrokenMatcher())
    specs = [_spec("good", "A", [5, 6, 7], 6, ignore_eos=True), _spec("prefill", "B", [POISON, 4, 5], 6), sampling]
    got = _run_engine(eng, specs)

    def last(key: str) -> dict[str, Any]:
        evs = got[key]
        return {"tokens": sum(e.token_id is not None for e in evs), "finish": evs[-1].finish_reason if evs else None,
                "error": evs[-1].error if evs else None}  # fmt: skip

    return {
        "good": last("good"),
        "prefill": last("prefill"),
        "sampling": last("sampling"),
        "left": {"has_work": eng.has_work(), "generator_jobs": gen.num_remaining_jobs()},
    }


def _scheduling(kind: str, gen: Any, tok: Any, model: Any) -> Any:
    from dataclasses import replace

    from workers.engine.base import PromptEvent, TokenEvent

    eng = _engine(kind, gen, tok, model)
    eng.max_batch = 2
    start = eng._start

    def cannot_start(spec: Any) -> Any:
        if spec.key == "bad":
            raise RuntimeError("cannot start")
        return start(spec)

    eng._start = cannot_start
    batch = [replace(_spec(f"batch{i}", "A", [3, 4, 5 + i], 3, ignore_eos=True), interactive=False) for i in (1, 2)]
    interactive = [_spec("bad", "A", [3, 4, 9]), _spec("p0", "B", [3, 4, 9], 0)]
    interactive += [_spec("good", "A", [5, 6, 7], 3, ignore_eos=True), _spec("gone", "A", [6, 7], 50, ignore_eos=True)]
    for spec in [batch[0], *interactive, batch[1]]:
        eng.add(spec)

    def what(ev: Any) -> str:
        if isinstance(ev, PromptEvent):
            return "prompt"
        return f"failed: {ev.error}" if ev.error else ev.finish_reason or "token"

    first = [[ev.key, what(ev)] for ev in eng.step()]
    waiting = sorted(eng.waiting_keys())
    events: dict[str, list[Any]] = {}
    for _ in range(3):  # "gone" makes three more tokens before it is cancelled
        for ev in eng.step():
            events.setdefault(ev.key, []).append(ev)
    eng.cancel("gone")
    for _ in range(40):
        if not eng.has_work():
            break
        for ev in eng.step():
            events.setdefault(ev.key, []).append(ev)
    eng.add(_spec("x", "A", [3, 4, 5], 5, ignore_eos=True))
    eng.step()

    def fail() -> Any:
        raise RuntimeError("iterate failed")

    gen.iterate = fail
    try:
        eng.step()
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    tokens = {k: sum(w == "token" for key, w in first if key == k) for k in events}
    for k, evs in events.items():
        tokens[k] += sum(isinstance(e, TokenEvent) and e.token_id is not None for e in evs)
    return {
        "first_step": first,
        "waiting_after_first_step": waiting,
        "ends": {k: evs[-1].finish_reason for k, evs in events.items()},
        "tokens": tokens,
        "iterate_failed": {"raised": raised, "has_work": eng.has_work(), "generator_jobs": gen.num_remaining_jobs()},
    }


def _semantics(gen: Any, tok: Any, model: Any) -> Any:
    from workers.engine.base import TokenEvent

    eng = _engine("exllamav3", gen, tok, model)
    got = _run_engine(eng, [_spec("ignore", "A", [3, 4, 5], 6, ignore_eos=True, presence_penalty=3.0)])
    _run_engine(eng, [_spec("best", "A", [3, 4, 5], 3, best_of=2)])
    return {
        "ignore_eos": [e.token_id for e in got["ignore"] if isinstance(e, TokenEvent) and e.token_id is not None],
        "best_of_logprobs": _last_job_returned_logits(gen),
    }


LAST_JOBS: list[Any] = []


def _last_job_returned_logits(gen: Any) -> bool:
    return bool(LAST_JOBS) and bool(LAST_JOBS[-1].return_logits)


def _exl2(what: str) -> Any:
    from exllamav2 import attn

    attn.has_flash_attn_with_paged = True  # flash-attn's presence; its kernels are the model's business
    from exllamav2.generator import ExLlamaV2DynamicGenerator

    from workers.engine.exllamav2 import gen_settings, make_job

    model, cache, tok = _stand_ins(paged=what != "unpaged", chain=what == "logprobs")
    gen = ExLlamaV2DynamicGenerator(
        model=model,
        cache=cache,
        tokenizer=tok,
        max_batch_size=4,
        max_seq_len=4096,
        max_chunk_size=512,
        paged=what != "unpaged",
        max_sampling_threads=1,
        filter_background_eval=False,
    )
    if what == "errors":
        return _errors("exllamav2", gen, tok, model)
    if what == "scheduling":
        return _scheduling("exllamav2", gen, tok, model)
    serial = iter(range(1000))

    def run(tenant: str, ids: list[int], n: int = 4, **params: Any) -> tuple[int, list[Any]]:
        key = ("job", next(serial), 0)
        spec = _spec(key, tenant, ids, n, **params)
        job = make_job(spec, [EOS], gen_settings(spec.params, V, gen.padded_vocab_size))
        return _drive(gen, job, key, spec.params.needs_token_logprobs)

    return _cases(what, run)


def _exl3(what: str) -> Any:
    from exllamav3 import Generator

    from workers.engine.exllamav3 import make_job

    model, cache, tok = _stand_ins(paged=True, chain=what == "logprobs")
    gen = Generator(model=model, cache=cache, tokenizer=tok, max_batch_size=4, max_chunk_size=512)
    if what == "errors":
        return _errors("exllamav3", gen, tok, model)
    if what == "scheduling":
        return _scheduling("exllamav3", gen, tok, model)
    if what == "semantics":
        enqueue = gen.enqueue

        def remember(job: Any) -> Any:
            LAST_JOBS.append(job)
            return enqueue(job)

        gen.enqueue = remember
        return _semantics(gen, tok, model)
    serial = iter(range(1000))

    def run(tenant: str, ids: list[int], n: int = 4, **params: Any) -> tuple[int, list[Any]]:
        key = ("job", next(serial), 0)
        spec = _spec(key, tenant, ids, n, **params)
        return _drive(gen, make_job(spec, [EOS]), key, spec.params.needs_token_logprobs)

    return _cases(what, run)


def _cases(what: str, run: Any) -> Any:
    def cached(tenant: str, ids: list[int], n: int = 4, **params: Any) -> int:
        return run(tenant, ids, n, **params)[0]

    if what == "penalties":
        prompt = [7] * 20 + [5]
        return {
            "presence": _output(run("A", prompt, 8, presence_penalty=3.0)[1]),
            "frequency": _output(run("A", prompt, 8, presence_penalty=3.0, frequency_penalty=1.0)[1]),
        }
    if what == "logprobs":
        return _logprobs(run("A", [3, 4, 5], 8, logprobs=1, min_tokens=1, logit_bias={4: 0.5})[1])
    if what == "unpaged":
        return {
            "A": cached("A", SHORT),
            "A again": cached("A", SHORT),
            "B": cached("B", SHORT),
            "A after B": cached("A", SHORT),
            "A again after A": cached("A", SHORT),
        }
    out = {
        "long": {"A": cached("A", LONG), "B": cached("B", LONG), "A again": cached("A", LONG)},
        "short": {"A": cached("A", SHORT), "B": cached("B", SHORT + TAIL), "A again": cached("A", SHORT + TAIL)},
    }
    # A's 250-token prompt and 10 greedy tokens: page 0 fills up while generating (250 + 6 tokens).
    head = [(i * 13) % 977 + 3 for i in range(250)]  # sent by no one before
    _, events = run("A", head, 10, ignore_eos=True)
    output = [e.token_id for e in events if e.token_id is not None]
    follow = head + output[:6] + LONG[:50]  # page 0 is A's prompt and output; LONG does not start with 7
    out["generated"] = {"B": cached("B", follow), "A": cached("A", follow)}
    out["no_reuse"] = {"A, cache_prompt false": cached("A", LONG, cache_prompt=False), "A": cached("A", LONG)}
    return out


if __name__ == "__main__":
    _install()
    print(json.dumps({case: _child(case) for case in sys.argv[1:]}))
