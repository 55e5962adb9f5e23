"""Speculative decoding on the real CPU engine and SmolLM2: drafts change how many tokens a step
brings, never which tokens, their log-probabilities or how many (greedy and sampled alike)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from core.generation.params import GenerationParams
from core.registry import smollm2_gguf
from ops.bench.speculative import EXTRACT, REWRITE, chat_ids, prediction_ids
from ops.harness import ENGINE_THREADS
from workers.engine import drafts
from workers.engine.base import SeqSpec, TokenEvent
from workers.engine.llamacpp import SMALL_KERNEL_ROWS, LlamaCppEngine


@pytest.fixture(scope="module")
def engine() -> LlamaCppEngine:
    return LlamaCppEngine("smollm2", smollm2_gguf(), n_ctx=1024, max_batch=4, n_threads=ENGINE_THREADS)


def run(engine: LlamaCppEngine, specs: list[SeqSpec], mode: str) -> dict:
    """Per key: its events (token, eos, logprob, top, finish) and its accepted / rejected counts. The
    prompt cache is emptied first: a prompt prefilled in other chunks may differ in its last bits
    (docs/parameters.md, "Reproducibility"), which is not what is compared here."""
    for slot in engine._decoder.slot_tokens:
        engine._decoder.slot_tokens[slot] = []
    engine.speculative = mode
    try:
        for s in specs:
            engine.add(s)
        out: dict = defaultdict(lambda: {"events": [], "drafted": 0, "rejected": 0})
        while engine.has_work():
            for ev in engine.step():
                if isinstance(ev, TokenEvent):
                    assert ev.error is None, ev.error
                    assert not out[ev.key]["events"] or not out[ev.key]["events"][-1][-1], "an event after the end"
                    out[ev.key]["events"].append((ev.token_id, ev.eos_id, ev.logprob, ev.top, ev.finish_reason))
                    out[ev.key]["drafted"] += ev.drafted
                    out[ev.key]["rejected"] += ev.rejected
        return out
    finally:
        engine.speculative = None


def cases(engine: LlamaCppEngine, n: int, **kw) -> list[SeqSpec]:
    """Rewrites with their prediction (the input with the edits made) and extractions (prompt lookup)."""
    specs = []
    for i, (ask, prediction) in enumerate(REWRITE[:2]):
        p = GenerationParams(max_tokens=n, prediction=prediction_ids(engine, prediction), **kw)
        specs.append(SeqSpec(("rewrite", i), chat_ids(engine, ask), n, p, kw.get("seed", 0)))
    for i, ask in enumerate(EXTRACT[:2]):
        p = GenerationParams(max_tokens=n, **kw)
        specs.append(SeqSpec(("extract", i), chat_ids(engine, ask), n, p, kw.get("seed", 0)))
    return specs


def test_greedy_output_and_logprobs_are_the_same_with_drafts(engine):
    kw = {"temperature": 0.0, "logprobs": 3, "seed": 0}
    plain = run(engine, cases(engine, 96, **kw), "off")
    for mode in ("auto", "force"):
        got = run(engine, cases(engine, 96, **kw), mode)
        for key, want in plain.items():
            assert got[key]["events"] == want["events"], f"{key} changed with drafts ({mode})"
    # The prediction's drafts were taken, and the counts add up: no more accepted than emitted.
    auto = run(engine, cases(engine, 96, **kw), "auto")
    for r in auto.values():
        assert r["drafted"] < len(r["events"])
    assert sum(auto[("rewrite", i)]["drafted"] for i in range(2)) > 10
    assert sum(auto[("extract", i)]["drafted"] for i in range(2)) > 0


def test_drafts_never_pass_max_tokens(engine):
    for n in (1, 2, 5):
        got = run(engine, cases(engine, n, temperature=0.0), "force")
        for key, r in got.items():
            tokens = [e for e in r["events"] if e[0] is not None]
            assert len(tokens) <= n and r["events"][-1][-1] in ("length", "stop"), key


def test_sampled_output_is_the_same_with_drafts_and_a_wrong_rule_is_caught(engine, monkeypatch):
    """Each row is drawn as plain decoding draws it (one draw of the sequence's own random stream per
    emitted token), so with the same seed the text is the same: the distribution is, a fortiori. A
    planted rule that keeps every draft token changes it (the check sees it)."""

    def specs():
        out = []
        for seed in range(12):
            ask, prediction = REWRITE[0]
            p = GenerationParams(
                max_tokens=24, temperature=1.0, seed=seed, prediction=prediction_ids(engine, prediction)
            )
            out.append(SeqSpec(("s", seed), chat_ids(engine, ask), 24, p, seed))
        return out

    plain = run(engine, specs(), "off")
    forced = run(engine, specs(), "force")
    assert all(forced[k]["events"] == plain[k]["events"] for k in plain)

    def keep_everything(draft, sample):
        """A planted wrong rule: every row's draw is emitted, as if each draft token had been taken."""
        out = []
        for i in range(len(draft) + 1):
            out.append(sample(i))
            if out[-1] is None:
                break
        return out, len(out) - 1

    monkeypatch.setattr(engine, "verify", keep_everything)
    wrong = run(engine, specs(), "force")
    changed = sum(wrong[k]["events"] != plain[k]["events"] for k in plain)
    assert changed >= 3, changed  # the correct rule changed none of the 12


def test_a_cancelled_sequence_mid_draft_leaves_a_consistent_cache(engine):
    """A stop string above the engine cancels a sequence whose step brought several tokens: its slot
    keeps only verified tokens, and a later prompt reusing that prefix continues exactly."""
    ask, prediction = REWRITE[0]
    ids = chat_ids(engine, ask)
    p = GenerationParams(max_tokens=60, temperature=0.0, prediction=prediction_ids(engine, prediction))
    whole = run(engine, [SeqSpec("whole", ids, 60, p, 0)], "off")["whole"]["events"]
    engine.speculative = "force"
    engine.add(SeqSpec("cut", ids, 60, p, 0))
    for _ in range(4):
        engine.step()
    slot = engine._decoder.live["cut"].slot
    engine.cancel("cut")
    held = engine._decoder.slot_tokens[slot]  # its KV, kept for a later prompt to reuse
    assert held[: len(ids)] == ids and len(held) > len(ids) + 4
    assert held[len(ids) :] == [e[0] for e in whole][: len(held) - len(ids)], "an unverified draft token was kept"
    engine.speculative = None
    again = run(engine, [SeqSpec("again", ids, 60, p, 0)], "off")["again"]["events"]
    assert again == whole


def test_the_budget_rule_keeps_one_sequences_rows_where_the_kernels_match():
    # llama.cpp's CPU kernels give a sequence's rows the logits of one-token steps below 64 rows a step.
    assert drafts.K_MAX + 1 < 64 and SMALL_KERNEL_ROWS < 64


def test_every_slot_drafting_at_once_changes_no_token(engine):
    """Eight sequences at once (every slot), drafts forced: 8 x 9 rows would pass 64 rows a step, where
    llama.cpp's larger kernel sums in another order; the step's draft rows are held under it."""
    kw = {"temperature": 0.0, "seed": 0}

    def specs() -> list[SeqSpec]:
        return [
            SeqSpec((copy, *s.key), s.prompt_ids, s.max_new_tokens, s.params, s.seed)
            for copy in ("a", "b")
            for s in cases(engine, 48, **kw)
        ]

    plain = run(engine, specs(), "off")
    forced = run(engine, specs(), "force")
    assert len(plain) == 8
    for key, want in plain.items():
        assert forced[key]["events"] == want["events"], key
    assert sum(r["drafted"] for r in forced.values()) > 20
