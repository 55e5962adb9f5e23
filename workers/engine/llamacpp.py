"""CPU engine: llama.cpp through llama-cpp-python's low-level API, with real batching.

The high-level `Llama` object runs one sequence at a time. Here every live sequence owns a KV-cache
sequence id (a slot) and each `step()` is one `llama_decode` over a batch holding one new token per
decoding sequence plus prompt chunks of sequences still in prefill, so N streams cost about one
forward pass per token instead of N.

Sampling uses llama.cpp's own sampler chain per sequence (its native samplers: penalties, DRY,
top-k/p, min-p, typical, temperature, mirostat, logit bias, seeded draw). What the chain cannot do is
done on the logits row in place before it runs: end-of-sequence suppression (`ignore_eos`,
`min_tokens`) and the llguidance grammar mask. Log-probabilities come from the raw row, in numpy,
only for sequences that asked for them.

A finished sequence leaves its tokens in its slot's cache; a later prompt sharing a prefix with
them reuses it (`cache_prompt`), as llama.cpp's server does per slot.

Speculative decoding (workers/engine/drafts.py): a generating sequence may feed its last token and K
draft tokens in the same step, logits on every row; each row is sampled in order exactly as a plain
step would sample it (same chain, same random stream, same grammar and penalty state), the draft
token kept while the draw equals it, and the KV of the first rejected draft token onward removed.
The rows of one sequence in a step stay under 64, where llama.cpp's CPU kernels give every row
bit-for-bit the logits (and write the KV) of one-token steps (see SCORE_CHUNK): the output is the
output without drafts, greedy or sampled, token for token.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import logging
import os
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp as llc
import numpy as np

from core.generation.params import GenerationParams
from core.infra.llamalog import quiet_llama_logs
from core.infra.tokenizers import LlamaVocab
from workers.engine import drafts
from workers.engine.base import PromptEvent, SeqSpec, TokenEvent, VocabEngine, check_spec
from workers.engine.logits import GrammarMask, log_softmax, top_logprobs

log = logging.getLogger(__name__)

Plan = list[tuple[str, tuple[Any, ...]]]


def sampler_plan(p: GenerationParams, seed: int, n_vocab: int, n_ctx: int) -> Plan:
    """GenerationParams -> llama.cpp sampler chain, in llama-server's order. Plain data so it is
    unit-tested without a model; `_build_chain` turns it into samplers."""
    plan: Plan = []
    if p.logit_bias:
        plan.append(("logit_bias", (tuple(sorted(p.logit_bias.items())),)))
    # repetition_penalty looks at the prompt and the output (llama.cpp, vLLM); presence and frequency
    # penalties at the output only (OpenAI, vLLM, Fireworks): two samplers, fed different tokens.
    # The window is a ring buffer llama.cpp allocates per sampler: never larger than the context
    # (a request's `repeat_last_n: 250000000` would otherwise cost gigabytes of worker memory).
    window = n_ctx if p.penalty_last_n is None or p.penalty_last_n < 0 else min(p.penalty_last_n, n_ctx)
    if p.repetition_penalty != 1.0 and window:
        plan.append(("penalties", (n_vocab, window, p.repetition_penalty, 0.0, 0.0)))
    if (p.frequency_penalty or p.presence_penalty) and window:
        plan.append(("output_penalties", (n_vocab, window, 1.0, p.frequency_penalty, p.presence_penalty)))
    if p.dry_multiplier > 0:
        plan.append(("dry", (p.dry_multiplier, p.dry_base, p.dry_allowed_length, n_ctx, p.dry_sequence_breakers)))
    seed32 = seed & 0xFFFFFFFF
    if seed32 == 0xFFFFFFFF:  # LLAMA_DEFAULT_SEED: llama.cpp would draw a random seed instead
        seed32 = 0xFFFFFFFE
    if p.greedy:
        plan.append(("greedy", ()))
        return plan
    if p.mirostat:
        plan.append(("temp", (p.temperature,)))
        if p.mirostat == 1:
            plan.append(("mirostat", (n_vocab, seed32, p.mirostat_tau, p.mirostat_eta, 100)))
        else:
            plan.append(("mirostat_v2", (seed32, p.mirostat_tau, p.mirostat_eta)))
        return plan
    if p.top_k > 0:
        plan.append(("top_k", (p.top_k,)))
    if p.typical_p < 1.0:
        plan.append(("typical", (p.typical_p, 1)))
    if p.top_p < 1.0:
        plan.append(("top_p", (p.top_p, 1)))
    if p.min_p > 0.0:
        plan.append(("min_p", (p.min_p, 1)))
    plan.append(("temp", (p.temperature,)))
    plan.append(("dist", (seed32,)))
    return plan


# Samplers that see the prompt's tokens; "output_penalties" sees only generated ones.
SEES_PROMPT = ("penalties", "dry")


def _build_chain(plan: Plan, vocab: Any, n_vocab: int) -> tuple[Any, dict[str, Any]]:
    """The chain, and its history-keeping samplers by name (to feed them the right tokens)."""
    chain = llc.llama_sampler_chain_init(llc.llama_sampler_chain_default_params())
    history: dict[str, Any] = {}
    for name, args in plan:
        if name == "logit_bias":
            items = args[0]
            arr = (llc.llama_logit_bias * len(items))(*[llc.llama_logit_bias(t, b) for t, b in items])
            smp = llc.llama_sampler_init_logit_bias(n_vocab, len(items), arr)
        elif name == "dry":
            mult, base, allowed, last_n, breakers = args
            enc = [b.encode() for b in breakers]
            arr = (ctypes.c_char_p * len(enc))(*enc)
            smp = llc.llama_sampler_init_dry(vocab, mult, base, allowed, last_n, arr, len(enc))
        elif name in ("penalties", "output_penalties"):
            smp = llc.llama_sampler_init_penalties(*args)
        else:
            smp = getattr(llc, f"llama_sampler_init_{name}")(*args)
        if name in (*SEES_PROMPT, "output_penalties"):
            history[name] = smp
        llc.llama_sampler_chain_add(chain, smp)  # the chain owns it from here
    return chain, history


@dataclass
class _Seq:
    spec: SeqSpec
    decoder: _Decoder
    slot: int
    chain: Any
    pending: list[int]  # prompt tokens not yet decoded
    pos: int = 0  # next position in the slot's KV cache
    cached: int = 0
    generated: int = 0  # by this attempt (spec.prior came before)
    last: int | None = None  # the token to feed next step
    grammar: GrammarMask | None = None
    want_logprobs: bool = False
    argmax: bool = False  # plain greedy (no bias or penalties): numpy's argmax instead of the chain
    top_k: int = 0
    prompt_lp: list[tuple[float | None, int | None, list | None]] | None = None
    fed: list[int] = field(default_factory=list)  # every token now in this slot's KV, in order
    # The last `replay` pending tokens were generated earlier (by a dead attempt, or before this
    # sequence was displaced): fed back one per step, as they were first decoded. Prefilled together
    # their KV came out slightly different (a batched matmul sums in another order), and a greedy
    # choice at a near-tie then went another way: at 3 of 26 resume points of two chat answers.
    replay: int = 0
    drafter: drafts.Lookup | drafts.Prediction | None = None  # where its drafts come from; None: no drafts
    backoff: drafts.Backoff | None = None  # None: drafts forced on (no back-off)
    draft: list[int] = field(default_factory=list)  # the draft tokens fed this step after `last`

    def unfed(self) -> list[int]:
        """Every token this sequence has, in order: what a new slot must decode to continue it. Its
        pending tokens while it has any (a sequence displaced again while re-decoding its earlier
        tokens has a `last` too, and it is the end of `pending`, not all of it); else its last."""
        if self.pending:
            return self.fed + self.pending
        return self.fed + ([self.last] if self.last is not None else [])


# The shortest cached prefix worth opening a new run of slots for (see `_Decoder.pick_slot`).
_FAR_PREFIX = 256
# The fewest prompt tokens worth copying from another slot's cache rather than prefilling (see
# `_Decoder.pick_slot`). A copy moves a whole KV stream (llama.cpp copies across streams only whole:
# ~23 MB for SmolLM2 at 1,024 tokens, milliseconds), while each prefilled token is a forward pass
# of the model: 32 tokens of SmolLM2 cost ~0.2 s of one core.
_COPY_MIN = 32

# Prompt tokens a step prefills while other sequences are generating in it (alone, a prompt takes the
# whole batch, `n_batch`). On this CPU a prompt token costs ~10-19 ms, so a 512-token chunk held every
# stream of the step for 5-10 s (ops/hostile.py, a 6 MiB Responses input truncated to the context);
# 64 tokens keep a step under a second. Chunks keep at least 64 rows (a shorter tail goes with the chunk
# before it), where llama.cpp's results stop depending on a chunk's size (see SCORE_CHUNK).
PREFILL_BESIDE_DECODE = 64

# The most rows a step may have for llama.cpp's CPU matrix products to compute each row alone (from 64
# rows up another kernel sums in another order: see SCORE_CHUNK): the bound on decode plus draft rows.
SMALL_KERNEL_ROWS = 63

# Prompt positions scored (echo with logprobs, prompt_logprobs) in one decode step: one chunk of one
# sequence. Each scored position is a row of output logits (the vocabulary projection, ~57 MFLOP for
# SmolLM2) plus a log-softmax and a top-k here: 8 sequences' prompts scored in batches of 512 rows held
# every other sequence's next token for ~2 s a step on 2 cores, and a new request's prompt waited
# behind several such steps. A chunk is 64 positions (the rest of a prompt, if under 128): llama.cpp's
# CPU matrix product takes another kernel below 64 rows, and its logprobs then differ from one pass's
# by up to 0.4 (SmolLM2 Q4_1); from 64 rows up they are the same, so chunking changes no score.
# While other sequences are generating, a scoring chunk goes in every other step only: their tokens
# then come at the plain step's pace half the time, not at the scoring step's pace every time (a
# victim's short request took up to 3.6 s beside 8 scored prompts; the scoring takes twice the steps).
SCORE_CHUNK = 64


class _Decoder:
    """The llama.cpp context (its KV cache and slots) that decodes every live sequence together.

    Each slot is its own KV stream (`kv_unified = false`), as in llama-server: a sequence's
    arithmetic is then independent of what else is cached or batched, so a seed replays bit for bit,
    and one `llama_decode` still covers every sequence as long as the batch lists them by slot and
    live slots stay packed (see `pick_slot`). A shared KV buffer measured slower at 16 sequences on
    2 cores and let sampled text drift between identical requests, so there is one context.
    """

    def __init__(
        self,
        model: Any,
        *,
        n_ctx: int,
        max_batch: int,
        reserved: int,
        n_batch: int,
        threads: int,
    ) -> None:
        # Batch sequences may hold `max_batch` slots; `reserved` more are for interactive ones only, so
        # an interactive request starts at once however much bulk work is running.
        slots = max_batch + reserved
        self.batch_cap = max_batch
        self.scored_last = False  # the last step held a prompt-scoring chunk (SCORE_CHUNK)
        cparams = llc.llama_context_default_params()
        cparams.n_seq_max = slots
        cparams.kv_unified = False
        cparams.n_ctx = n_ctx * slots
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = llc.llama_init_from_model(model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.mem = llc.llama_get_memory(self.ctx)
        self.batch = llc.llama_batch_init(n_batch, 0, 1)
        self.n_batch = n_batch
        self.free = list(range(slots))
        self.slot_tokens: dict[int, list[int]] = {s: [] for s in range(slots)}  # what each slot's KV holds
        self.slot_scope: dict[int, Hashable] = {}  # whose tokens those are: reused only within a scope
        self.waiting: collections.deque[SeqSpec] = collections.deque()
        self.live: dict[Hashable, _Seq] = {}
        # Batch sequences an interactive one displaced: they keep their sampler state and progress and
        # continue, before any new batch sequence starts, when a slot frees.
        self.paused: collections.deque[_Seq] = collections.deque()
        self.preemptions = 0
        self.copies = 0  # prompt prefixes copied from another slot's cache instead of prefilled

    def held(self, slot: int) -> list[int]:
        """The tokens whose KV `slot` holds: a live sequence's decoded ones, or what a free slot kept."""
        seq = next((q for q in self.live.values() if q.slot == slot), None)
        return seq.fed if seq is not None else self.slot_tokens[slot]

    def shared(self, slot: int, tokens: list[int], scope: Hashable) -> int:
        """How many of `tokens` lead what `slot` holds (0 for another scope's slot)."""
        if self.slot_scope.get(slot) != scope:
            return 0
        return _common(self.held(slot), tokens)

    def coming(self, tokens: list[int], scope: Hashable) -> bool:
        """A live sequence of this scope is still prefilling at least `_COPY_MIN` more of `tokens` than
        any slot holds now: a sequence of these tokens that waits for it copies its cache a step later
        (the `n` choices of one prompt, or requests sharing a long system prompt) instead of
        prefilling the same tokens beside it."""
        now = max((self.shared(slot, tokens, scope) for slot in self.slot_tokens), default=0)
        return any(
            q.pending
            and self.slot_scope.get(q.slot) == scope
            and _common(q.fed + q.pending[: len(q.pending) - q.replay], tokens) >= now + _COPY_MIN
            for q in self.live.values()
        )

    def batch_live(self) -> int:
        return sum(1 for s in self.live.values() if not s.spec.interactive)

    def pick_slot(self, tokens: list[int], reuse: bool, scope: Hashable = None) -> tuple[int, int]:
        """A free slot and how many of `tokens` its cache already holds (only a slot last used in the
        same scope counts: one tenant never reuses, nor learns the length of, another's prefix)."""
        # llama.cpp splits a step over per-sequence KV streams into one compute per run of consecutive
        # slot ids, so a slot next to a live one (no new run) comes first; among those, the one caching
        # least (a displaced sequence's or another prompt's prefix survives). A cached prefix in a slot
        # that would start a new run is taken only when it is long: the extra compute per step for
        # the sequence's whole life costs more than prefilling a short prefix again.
        live = {q.slot for q in self.live.values()}

        def joins(slot: int) -> bool:
            return not live or slot - 1 in live or slot + 1 in live

        matches = {slot: self.shared(slot, tokens, scope) if reuse else 0 for slot in self.free}
        best = min(self.free, key=lambda s: (not joins(s), -matches[s], len(self.slot_tokens[s]), s))
        far = max(self.free, key=lambda s: (matches[s], -s))
        if not joins(far) and matches[far] >= max(_FAR_PREFIX, 2 * matches[best]):
            best = far
        best_len = matches[best]
        # Another slot (live or free) of this scope may hold more of these tokens: its KV stream is
        # copied into this one (the copy happens in the next decode, before that decode's tokens are
        # written), and only what follows the shared prefix is prefilled here.
        donor = max(
            (d for d in self.slot_tokens if d != best), key=lambda d: self.shared(d, tokens, scope), default=None
        )
        if reuse and donor is not None and (got := self.shared(donor, tokens, scope)) >= best_len + _COPY_MIN:
            llc.llama_memory_seq_cp(self.mem, donor, best, -1, -1)
            best_len = got
            self.copies += 1
        self.free.remove(best)
        self.slot_scope[best] = scope
        # Always decode at least the last token: its logits start (or continue) generation.
        return best, min(best_len, len(tokens) - 1)

    def victim(self) -> _Seq | None:
        """The batch sequence cheapest to displace: fewest tokens to decode again when it continues.
        Sequences scoring their prompt are left alone (their scores are gathered during prefill)."""
        batch = [s for s in self.live.values() if not s.spec.interactive and s.prompt_lp is None]
        return min(batch, key=lambda s: len(s.fed), default=None)

    def preempt(self, seq: _Seq) -> None:
        """Take a batch sequence off its slot, keeping everything it has generated; its KV stays in
        the slot's prefix cache, so if the slot is still free when it continues nothing is redone."""
        self.slot_tokens[seq.slot] = seq.fed
        self.free.append(seq.slot)
        self.live.pop(seq.spec.key, None)
        self.paused.append(seq)
        self.preemptions += 1

    def release(self, seq: _Seq) -> None:
        if any(p is seq for p in self.paused):
            self.paused = collections.deque(p for p in self.paused if p is not seq)
            llc.llama_sampler_free(seq.chain)
            return
        llc.llama_sampler_free(seq.chain)
        self.slot_tokens[seq.slot] = seq.fed  # its KV stays: a later prompt may reuse the prefix
        self.free.append(seq.slot)
        self.live.pop(seq.spec.key, None)

    def forget_all(self) -> None:
        """After a failed decode the cache may hold part of the batch: trust none of it."""
        for seq in self.live.values():
            seq.fed = []
        for slot in self.slot_tokens:
            self.slot_tokens[slot] = []
            llc.llama_memory_seq_rm(self.mem, slot, -1, -1)


def _common(a: list[int], b: list[int]) -> int:
    """The length of the prefix `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class LlamaCppEngine(VocabEngine):
    def __init__(
        self,
        model_id: str,
        path: Path,
        *,
        n_ctx: int = 2048,
        max_batch: int = 16,
        n_batch: int = 512,
        n_threads: int | None = None,
        interactive_slots: int = 4,
        speculative: str | None = None,
    ) -> None:
        """`speculative`: every sequence's mode, whatever its params say (tests force drafts on with
        "force"); None: each sequence's own `params.speculative`."""
        self.model_id = model_id
        self.max_batch = max_batch
        self.speculative = speculative
        self.verify = drafts.verify  # the acceptance rule (a test plants a wrong one to see it caught)
        quiet_llama_logs()
        llc.llama_backend_init()
        self._model = llc.llama_model_load_from_file(str(path).encode(), llc.llama_model_default_params())
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_ctx = min(n_ctx, llc.llama_model_n_ctx_train(self._model))
        self.vocab = LlamaVocab(llc.llama_model_get_vocab(self._model), llc.llama_model_n_ctx_train(self._model))
        self.n_vocab = self.vocab.n_vocab
        self._eog = np.array(sorted(self.vocab.eog_tokens), dtype=np.int64)
        threads = n_threads or os.cpu_count() or 1
        opts = dict(n_ctx=self.n_ctx, max_batch=max_batch, reserved=interactive_slots, n_batch=n_batch, threads=threads)
        self._decoder = _Decoder(self._model, **opts)
        self._ll_tokenizer: Any = None
        log.info(
            "llama.cpp engine: %s, ctx %d/seq, batch %d seqs, %d threads", path.name, self.n_ctx, max_batch, threads
        )

    # -- tokenizer (tokenize, token_bytes, token_text: VocabEngine) ---------------------------
    def ll_tokenizer(self) -> Any:
        """llguidance's view of this vocabulary (built once: ~1 s)."""
        if self._ll_tokenizer is None:
            from llguidance.llamacpp import lltokenizer_from_vocab

            self._ll_tokenizer = lltokenizer_from_vocab(self.vocab.vocab)
        return self._ll_tokenizer

    # -- sequences --------------------------------------------------------------------------
    def add(self, spec: SeqSpec) -> None:
        check_spec(spec, self.n_ctx, self.n_vocab)
        self._decoder.waiting.append(spec)

    def cancel(self, key: Hashable) -> None:
        decoder = self._decoder
        seq = decoder.live.get(key) or next((p for p in decoder.paused if p.spec.key == key), None)
        if seq is not None:
            decoder.release(seq)
            return
        decoder.waiting = collections.deque(s for s in decoder.waiting if s.key != key)

    def has_work(self) -> bool:
        decoder = self._decoder
        return bool(decoder.live or decoder.waiting or decoder.paused)

    def waiting_count(self) -> int:
        """Sequences waiting for a slot (never started, or displaced by interactive work)."""
        return len(self._decoder.waiting) + len(self._decoder.paused)

    def waiting_keys(self) -> set[Hashable]:
        """The sequences `waiting_count` counts, and those whose prompt is still being prefilled: the
        loop's watchdog takes none of these waits for a stall. A prompt gets no event until its last
        chunk, and beside generating sequences a step prefills one chunk of one prompt at a time, in
        slot order: 20 sessions' 600-token prompts on two one-thread workers (ops/fleet.py) left a
        prompt waiting its turn for over SPOOL_SEQUENCE_STALL_S, and the watchdog failed its request."""
        decoder = self._decoder
        prefilling = {q.spec.key for q in decoder.live.values() if q.pending}
        return {s.key for s in decoder.waiting} | {p.spec.key for p in decoder.paused} | prefilling

    @property
    def preemptions(self) -> int:
        return self._decoder.preemptions

    def _admit(self, decoder: _Decoder) -> list[TokenEvent]:
        """Move waiting sequences into free slots, interactive first: an interactive sequence takes a
        free slot, or displaces a batch sequence when none is free. Then displaced batch sequences
        continue, then new ones start, while the batch share is not full. A sequence that cannot
        start fails alone."""
        failed: list[TokenEvent] = []
        later: set[Hashable] = set()  # waiting for a live sequence's prefill to copy (`_Decoder.coming`)
        while True:
            spec = next((w for w in decoder.waiting if w.interactive and w.key not in later), None)
            if spec is not None and self._copies_later(decoder, spec):
                later.add(spec.key)
                continue
            if spec is not None:
                if not decoder.free:
                    victim = decoder.victim()
                    if victim is None:
                        break  # every slot holds interactive work: wait for one to end
                    decoder.preempt(victim)
            elif decoder.free and decoder.batch_live() < decoder.batch_cap and decoder.paused:
                self._resume(decoder, decoder.paused.popleft())
                continue
            elif decoder.free and decoder.batch_live() < decoder.batch_cap and decoder.waiting:
                spec = next((w for w in decoder.waiting if w.key not in later), None)
                if spec is None:
                    break
                if self._copies_later(decoder, spec):
                    later.add(spec.key)
                    continue
            else:
                break
            decoder.waiting.remove(spec)
            try:
                self._start(decoder, spec)
            except Exception as exc:
                log.exception("could not start sequence %s", spec.key)
                failed.append(TokenEvent.failed(spec.key, str(exc), time.monotonic()))
        return failed

    @staticmethod
    def _copies_later(decoder: _Decoder, spec: SeqSpec) -> bool:
        reuse = spec.params.cache_prompt and not spec.prompt_logprobs
        return reuse and decoder.coming(spec.prompt_ids, spec.cache_scope)

    def _resume(self, decoder: _Decoder, seq: _Seq) -> None:
        """A displaced sequence back on a slot: decode what it had (reusing any cached prefix), then
        sample on as if it had never left: same sampler chain, same grammar state, same count."""
        tokens = seq.unfed()
        slot, keep = decoder.pick_slot(tokens, reuse=True, scope=seq.spec.cache_scope)
        llc.llama_memory_seq_rm(decoder.mem, slot, keep, -1)
        seq.slot, seq.pos, seq.fed, seq.pending = slot, keep, list(tokens[:keep]), list(tokens[keep:])
        seq.replay = min(len(seq.pending), seq.spec.prior + seq.generated)
        decoder.live[seq.spec.key] = seq

    def _start(self, decoder: _Decoder, spec: SeqSpec) -> None:
        p = spec.params
        plan = sampler_plan(p, spec.seed, self.n_vocab, self.n_ctx)
        chain, history = _build_chain(plan, self.vocab.vocab, self.n_vocab)  # first: it is what can fail
        generated_before = len(spec.prompt_ids) - spec.prior  # a resumed sequence's earlier output
        for name, smp in history.items():
            tokens = spec.prompt_ids if name in SEES_PROMPT else spec.prompt_ids[generated_before:]
            for t in tokens:
                llc.llama_sampler_accept(smp, t)
        slot, keep = decoder.pick_slot(
            spec.prompt_ids, reuse=p.cache_prompt and not spec.prompt_logprobs, scope=spec.cache_scope
        )
        llc.llama_memory_seq_rm(decoder.mem, slot, keep, -1)
        seq = _Seq(
            spec=spec,
            decoder=decoder,
            slot=slot,
            chain=chain,
            pending=list(spec.prompt_ids[keep:]),
            pos=keep,
            cached=keep,
            want_logprobs=p.needs_token_logprobs,
            argmax=plan == [("greedy", ())],
            top_k=p.logprobs or 0,
            fed=list(spec.prompt_ids[:keep]),
            replay=min(len(spec.prompt_ids) - keep, spec.prior),
        )
        if spec.matcher is not None:
            seq.grammar = GrammarMask(spec.matcher, self.n_vocab)
        if spec.prompt_logprobs is not None:
            seq.prompt_lp = [(None, None, None)]
        self._drafts_for(seq)
        decoder.live[spec.key] = seq

    def _drafts_for(self, seq: _Seq) -> None:
        """Its draft source: the prediction when there is one, else (auto) prompt lookup."""
        p, spec = seq.spec.params, seq.spec
        mode = self.speculative or p.speculative
        if mode == "off" or spec.max_new_tokens <= 1:
            return
        if p.prediction:
            seq.drafter = drafts.Prediction(p.prediction, len(spec.prompt_ids) - spec.prior)
        elif mode in ("auto", "force"):
            seq.drafter = drafts.Lookup()
        else:
            return
        if mode != "force":
            seq.backoff = drafts.Backoff(prior=0.9 if p.prediction else 0.5)

    # -- one decode step --------------------------------------------------------------------
    def step(self) -> list[TokenEvent | PromptEvent]:
        out: list[TokenEvent | PromptEvent] = list(self._admit(self._decoder))
        if self._decoder.live:
            out += self._step_decoder(self._decoder)
        return out

    def _step_decoder(self, decoder: _Decoder) -> list[TokenEvent | PromptEvent]:
        b = decoder.batch
        n = 0
        samplers: list[tuple[_Seq, int]] = []  # sequences sampling this step, and their logits row
        scorers: list[tuple[_Seq, int, int]] = []  # (seq, row, prompt index the row predicts)
        # In slot order: llama.cpp runs a batch over per-sequence KV streams as one compute per run of
        # consecutive sequence ids in batch order (llama_batch_allocr::split_equal); unsorted or
        # scattered ids cost one forward pass each, which made a step's cost flat in batch size.
        ordered = sorted(decoder.live.values(), key=lambda q: q.slot)
        generating = sum(1 for q in ordered if not q.pending)
        # Draft rows keep a step's decode rows under SMALL_KERNEL_ROWS: there llama.cpp's CPU matrix
        # products compute each row as in a step of one row per sequence, so a step with drafts gives
        # every row the logits the plain step would (at 16 sequences with 8 drafts each, 144 rows, the
        # larger kernel's sums moved greedy choices at near-ties). And no drafts in a step that prefills
        # a prompt: llama.cpp splits a step over per-sequence KV streams into micro-batches of as many
        # rows per sequence (split_equal), so other sequences' draft rows would cut the prompt's chunk
        # into other pieces, and its first token came out otherwise (2 of 16 rewrites, first token).
        prefilling = any(q.pending for q in ordered)
        draft_room = 0 if prefilling else max(0, SMALL_KERNEL_ROWS - generating)
        for s in ordered:
            if s.pending:
                continue
            self._put(b, n, s.last, s.pos, s.slot, True)
            s.fed.append(s.last)
            s.pos += 1
            samplers.append((s, n))
            n += 1
            s.draft = self._draft(s, generating, draft_room)
            for tok in s.draft:  # the draft's rows, logits on each; `_verify` drops the rejected ones
                self._put(b, n, tok, s.pos, s.slot, True)
                s.fed.append(tok)
                s.pos += 1
                n += 1
        # One sequence's scoring chunk per step, and beside generating sequences every other step only.
        scoring = bool(samplers) and decoder.scored_last
        scored_now = False
        # Beside generating sequences, a step prefills at most PREFILL_BESIDE_DECODE prompt tokens: a
        # step's time is its tokens', and a 512-token chunk held every other stream for seconds here.
        budget = decoder.n_batch - n if not samplers else min(decoder.n_batch - n, PREFILL_BESIDE_DECODE)
        for s in ordered:  # prompt chunks fill the rest of the batch
            if not s.pending or budget <= 0:
                continue
            prompt_left = len(s.pending) - s.replay
            # The prompt in chunks as large as the budget allows, up to its end; generated tokens
            # (replay) one per step, exactly as they were decoded the first time.
            take = min(prompt_left, budget) if prompt_left > 0 else 1
            if 0 < prompt_left - take < PREFILL_BESIDE_DECODE:  # no tail under 64 rows: it goes with this chunk
                take = min(prompt_left, decoder.n_batch - n)
            if s.prompt_lp is not None and (scored := max(0, s.spec.prompt_logprobs_len - 1 - s.pos)):
                # its positions still to score lead its chunk: a whole scoring chunk, or wait a step
                want = scored if scored < 2 * SCORE_CHUNK else SCORE_CHUNK
                # (a scoring chunk is bounded on its own, SCORE_CHUNK, and may pass the prefill budget:
                # held to it, one of up to 127 rows never went in beside generating sequences)
                if scoring or decoder.n_batch - n < want:
                    continue
                scoring = scored_now = True
                # the whole scoring chunk (scores must not come from a piece under 64 rows), and no more
                take = want if scored > want else max(take, min(prompt_left, want))
            chunk, s.pending = s.pending[:take], s.pending[take:]
            for i, tok in enumerate(chunk):
                last = not s.pending and i == take - 1
                score = s.prompt_lp is not None and s.pos + 1 < s.spec.prompt_logprobs_len
                self._put(b, n, tok, s.pos, s.slot, last or score)
                if score:
                    scorers.append((s, n, s.pos + 1))
                if last:
                    samplers.append((s, n))
                s.fed.append(tok)
                s.pos += 1
                n += 1
            budget -= take
        decoder.scored_last = scored_now
        if n == 0:
            return []
        b.n_tokens = n
        rc = llc.llama_decode(decoder.ctx, b)
        if rc != 0:
            decoder.forget_all()
            raise RuntimeError(f"llama_decode returned {rc}")
        now = time.monotonic()
        out: list[TokenEvent | PromptEvent] = []
        for s, row, target in scorers:
            logp = log_softmax(self._row(decoder, row))
            lp = float(logp[s.spec.prompt_ids[target]])
            rank = int((logp > lp).sum()) + 1
            s.prompt_lp.append((lp, rank, top_logprobs(logp, s.spec.prompt_logprobs or 0)))
        for s, row in samplers:
            if s.last is None:  # first token of this sequence: its prompt is done
                out.append(PromptEvent(s.spec.key, s.cached, s.prompt_lp))
                if s.spec.max_new_tokens == 0:
                    out.append(TokenEvent(s.spec.key, None, None, "length", t=now))
                    decoder.release(s)
                    continue
            try:
                out += self._verify(s, row, now) if s.draft else [self._sample(s, row, now)]
            except Exception as exc:  # this sequence's sampling (its grammar, its params) alone fails
                log.exception("sampling failed for sequence %s", s.spec.key)
                decoder.release(s)
                out.append(TokenEvent.failed(s.spec.key, f"sampling failed: {type(exc).__name__}", t=now))
        return out

    def _draft(self, s: _Seq, generating: int, room: int) -> list[int]:
        """The draft tokens `s` feeds this step after its last token (none: a plain step)."""
        if s.drafter is None or s.last is None:
            return []
        # Every emitted token counts against max_new_tokens: a step emits up to len(draft) + 1.
        cap = min(drafts.K_MAX, s.spec.max_new_tokens - s.generated - 1, max(0, room // max(1, generating)))
        k = cap if s.backoff is None else s.backoff.want(generating, cap)
        if k <= 0:
            return []
        s.drafter.see(s.fed)  # fed now ends with the last token: the whole sequence so far
        return s.drafter.draft(k)

    def _verify(self, s: _Seq, row: int, now: float) -> list[TokenEvent]:
        """Sample the rows of `s`'s last token and its draft in order, keeping draft tokens while the
        draw equals them (drafts.verify); then drop the KV of every rejected draft token."""
        draft, events = s.draft, []
        start = s.pos - len(draft) - 1  # the position of the token fed before the draft

        def sample(i: int) -> int | None:
            ev = self._sample(s, row + i, now)
            events.append(ev)
            return None if ev.ended else ev.token_id

        _, accepted = self.verify(draft, sample)
        keep = start + 1 + accepted  # the last token and the accepted draft tokens keep their KV
        del s.fed[len(s.fed) - (s.pos - keep) :]
        if keep < s.pos:
            llc.llama_memory_seq_rm(s.decoder.mem, s.slot, keep, -1)
        s.pos, s.draft = keep, []
        if s.backoff is not None:
            s.backoff.update(len(draft), accepted)
        for i in range(accepted):  # the emitted tokens that were draft tokens
            events[i] = dataclasses.replace(events[i], drafted=True)
        rejected = len(draft) - accepted
        if rejected:
            events[-1] = dataclasses.replace(events[-1], rejected=rejected)
        return events

    def _row(self, decoder: _Decoder, row: int) -> np.ndarray:
        return np.ctypeslib.as_array(llc.llama_get_logits_ith(decoder.ctx, row), shape=(self.n_vocab,))

    def _sample(self, s: _Seq, row: int, now: float) -> TokenEvent:
        logits = self._row(s.decoder, row)  # a view of llama.cpp's buffer: edits are seen by the sampler chain
        logp = log_softmax(logits) if s.want_logprobs else None
        p = s.spec.params
        grammar_ending = s.grammar is not None and s.grammar.accepting
        if (p.ignore_eos or s.spec.prior + s.generated < p.min_tokens) and not grammar_ending:
            logits[self._eog] = -np.inf
        if s.grammar is not None:
            s.grammar.apply(logits)
            if not np.isfinite(logits).any():  # nothing allowed: the grammar is complete
                self._finish(s)
                return TokenEvent(s.spec.key, None, None, "stop", t=now)
        # llama.cpp's greedy sampler copies the whole row into a candidate array first; argmax over
        # the row in place picks the same token (the first maximum) for a fraction of the time.
        tok = int(np.argmax(logits)) if s.argmax else int(llc.llama_sampler_sample(s.chain, s.decoder.ctx, row))
        lp = float(logp[tok]) if logp is not None else None
        top = top_logprobs(logp, s.top_k) if logp is not None and s.top_k else None
        if self.vocab.is_eog(tok):
            # The end-of-generation token carries no text, but its log-probability is part of the
            # answer (OpenAI and vLLM return it; evaluation harnesses score with it).
            self._finish(s)
            return TokenEvent(s.spec.key, None, lp, "stop", top, now, eos_id=tok)
        s.generated += 1
        s.last = tok
        finish = None
        if s.grammar is not None:
            s.grammar.consume(tok)
            if s.grammar.error:
                self._finish(s)
                return TokenEvent(s.spec.key, tok, lp, None, top, now, error=f"grammar: {s.grammar.error}")
            if s.grammar.done:
                finish = "stop"
        if finish is None and s.generated >= s.spec.max_new_tokens:
            finish = "length"
        if finish:
            self._finish(s)
        return TokenEvent(s.spec.key, tok, lp, finish, top, now)

    def _finish(self, s: _Seq) -> None:
        s.decoder.release(s)

    @staticmethod
    def _put(b: llc.llama_batch, i: int, tok: int | None, pos: int, slot: int, logits: bool) -> None:
        b.token[i] = tok
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = slot
        b.logits[i] = logits
