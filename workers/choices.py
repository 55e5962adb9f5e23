"""A choice's state while its sequence runs, and what is made of it, pure: engine events in
(tokens, scores, finish), neutral deltas, results and usage out (core/generation/events.py).

No Redis, Postgres or engine here: the attempt (workers/attempt.py) feeds events in and publishes
what comes out. Token names come from a `name(token_id) -> str` function (the engine's vocabulary).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from core.generation.events import ChoiceResult, Delta, TokenScore, TopToken, Usage
from core.generation.params import choice_index
from workers.engine.base import PromptEvent, TokenEvent, TopList
from workers.engine.text import ChoiceText
from workers.resume import Prior

Name = Callable[[int], str]


@dataclass(eq=False)  # identity-hashed: used as a dict key while coalescing
class Choice:
    index: int  # in candidate space: prompt * candidates + j (== the OpenAI index unless best_of > n)
    prompt: int
    text: ChoiceText
    key: tuple[str, int, int]
    sent_ids: int = 0  # how many of text.ids earlier events already carried
    done: bool = False  # finished: no more tokens accepted
    closed: bool = False  # its final delta (with finish_reason) has been published
    prefix_text: str = ""  # echoed prompt, returned before the completion
    prefix_ready: bool = False
    prefix_sent: bool = False
    prompt_scores: list[TokenScore | None] | None = None  # the prompt's tokens, scored, when asked
    lp: list[TokenScore] | None = None  # every generated token's logprobs; None when not asked for
    lp_sent: int = 0  # how many of them earlier deltas carried
    sum_lp: float = 0.0
    eos: bool = False  # ended by an end-of-sequence token it generated: counted as a completion token
    cached: int = 0
    drafted: int = 0  # its tokens that were accepted draft tokens (speculative decoding)
    rejected: int = 0  # draft tokens verified for it and rejected
    last_token_at: float | None = None  # monotonic arrival of its last token (inter-token latency)

    @property
    def offset(self) -> int:
        """Where the next token starts in the choice's text (echoed prompt included)."""
        return len(self.prefix_text) + len(self.text.text)

    def resume(self, prior: Prior, echo: bool, prompt_scores_wanted: bool) -> None:
        """Continue from what earlier attempts streamed: their tokens and sent text, and whether the
        prompt part already went out. Echo without prompt scores can go out at once; with them, when
        the prompt is scored."""
        if prior.ids or prior.text:
            self.text.restore(prior.ids, prior.text)
            self.sent_ids = len(prior.ids)
        self.prefix_sent = prior.prefix_sent
        self.prefix_ready = not prior.prefix_sent and echo and not prompt_scores_wanted
        if prior.finish:
            self.done = self.closed = True
            self.eos = prior.eos


def score(token_id: int, logprob: float | None, top: TopList | None, offset: int, name: Name) -> TokenScore:
    """One generated token's log-probability and its best alternatives."""
    alts = [TopToken(id=t, text=name(t), logprob=lp) for t, lp in (top or [])]
    return TokenScore(id=token_id, text=name(token_id), logprob=logprob, offset=offset, top=alts)


def prompt_scores(prompt_ids: Sequence[int], entries: Iterable, name: Name) -> list[TokenScore | None]:
    """The engine's scores of a prompt's tokens (the first has none): protocol/render makes echo
    logprobs and vLLM's prompt_logprobs of them."""
    out: list[TokenScore | None] = []
    offset = 0
    for tok, (logprob, rank, top) in zip(prompt_ids, entries, strict=False):
        alts = [TopToken(id=t, text=name(t), logprob=v) for t, v in (top or [])] if logprob is not None else []
        out.append(TokenScore(id=tok, text=name(tok), logprob=logprob, rank=rank, offset=offset, top=alts))
        offset += len(name(tok))
    return out


def take_prompt(ch: Choice, ev: PromptEvent, prompt_ids: Sequence[int], name: Name) -> None:
    ch.cached = ev.cached
    if ev.entries is not None and not ch.prefix_sent:
        ch.prompt_scores = prompt_scores(prompt_ids, ev.entries, name)
        ch.prefix_ready = True


def take_token(ch: Choice, ev: TokenEvent, name: Name) -> bool:
    """Apply one token event of a live choice (not done, no error). True when a stop string ended
    it: the engine does not know yet, and must be told to stop the sequence."""
    if ev.token_id is None and ev.eos_id is not None:
        ch.eos = True
        if ch.lp is not None and ev.logprob is not None:
            ch.lp.append(score(ev.eos_id, ev.logprob, ev.top, ch.offset, name))
    ch.drafted += ev.drafted
    ch.rejected += ev.rejected
    if ev.token_id is not None:
        offset = ch.offset
        ch.text.feed(ev.token_id)
        if ev.logprob is not None:
            ch.sum_lp += ev.logprob
        if ch.lp is not None:
            ch.lp.append(score(ev.token_id, ev.logprob, ev.top, offset, name))
    stopped = ch.text.finish_reason == "stop"
    if not stopped and ev.finish_reason:
        ch.text.finish(ev.finish_reason)
    if ch.text.finish_reason:
        ch.done = True
    return stopped


def deltas(
    touched: Iterable[Choice], attempt: int, echo: bool, index_of: dict[Choice, int] | None = None
) -> list[Delta]:
    """What the touched choices have new to say since their last delta, each once, in arrival order;
    marks it as said. `index_of` renumbers the choices (best_of's winners)."""
    out: list[Delta] = []
    for ch in dict.fromkeys(touched):
        if ch.closed:
            continue
        prefix = ch.prefix_ready and not ch.prefix_sent
        piece = ch.text.take()
        ids = ch.text.ids[ch.sent_ids :]
        # Prompt scores alone (no echo) ride on the first real delta: never an empty chunk first.
        if not piece and not ids and not ch.done and not (prefix and echo):
            continue
        scores = None
        if ch.lp is not None:
            scores = ch.lp[ch.lp_sent :]
            ch.lp_sent = len(ch.lp)
        out.append(
            Delta(
                attempt=attempt,
                choice=index_of[ch] if index_of else ch.index,
                text=(ch.prefix_text if prefix else "") + piece,
                token_ids=ids,
                finish_reason=ch.text.finish_reason if ch.done else None,
                eos=True if ch.done and ch.eos else None,
                prefix_len=len(ch.prefix_text) if prefix else None,
                prompt_scores=ch.prompt_scores if prefix else None,
                scores=scores,
            )
        )
        if prefix:
            ch.prefix_sent = True
        ch.sent_ids = len(ch.text.ids)
        ch.closed = ch.done
    return out


def best_of(choices: dict[int, Choice], prompts: int, n: int, candidates: int) -> dict[int, Choice]:
    """The returned choices by OpenAI index: all, or (best_of > n) the n of each prompt with the
    highest mean logprob."""
    if candidates <= n:
        return choices
    out: dict[int, Choice] = {}
    for pi in range(prompts):
        ranked = sorted(
            (ch for ch in choices.values() if ch.prompt == pi),
            key=lambda ch: ch.sum_lp / max(1, len(ch.text.ids)),
            reverse=True,
        )
        for j, ch in enumerate(ranked[:n]):
            out[choice_index(pi, j, n)] = ch
    return out


def result(index: int, ch: Choice) -> ChoiceResult:
    return ChoiceResult(
        index=index,
        text=ch.prefix_text + ch.text.text,
        finish_reason=ch.text.finish_reason,
        prefix_len=len(ch.prefix_text),
        scores=ch.lp,
        prompt_scores=ch.prompt_scores,
    )


def usage(choices: Iterable[Choice], prompt_lens: Sequence[int], predicted: bool = False) -> Usage:
    """Every prompt's tokens, every candidate's generated ones (a generated end-of-sequence token is
    a completion token, as vLLM counts it and as logprobs list it: docs/parameters.md), and per prompt
    the longest prefix a choice found cached. `predicted`: the request sent a `prediction`, whose
    accepted and rejected draft tokens are counted (only events applied before a choice ended: a draft
    token after a stop string is not in the completion). Only the current attempt's are known."""
    every = list(choices)
    cached = sum(max((ch.cached for ch in every if ch.prompt == pi), default=0) for pi in range(len(prompt_lens)))
    return Usage(
        prompt_tokens=sum(prompt_lens),
        completion_tokens=sum(len(ch.text.ids) + ch.eos for ch in every),
        cached_tokens=cached,
        accepted_prediction_tokens=sum(ch.drafted for ch in every) if predicted else None,
        rejected_prediction_tokens=sum(ch.rejected for ch in every) if predicted else None,
    )
