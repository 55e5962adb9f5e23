"""Resume arithmetic, pure: what earlier attempts of a job already streamed, and what the next
attempt of each choice still has to generate (docs/architecture.md: resuming instead of restarting)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from core.generation.events import Delta, Event
from workers.outcome import JobError


@dataclass(frozen=True)
class Prior:
    """One choice as earlier attempts left it in the stream."""

    ids: list[int] = field(default_factory=list)  # the token ids they generated
    text: str = ""  # the completion text they sent, without the echoed prompt
    finish: str | None = None  # the finish reason of its last delta: set when it had ended
    prefix_sent: bool = False  # the prompt part (echo, prompt scores) went out
    eos: bool = False  # it ended with an end-of-sequence token it generated


def prior_progress(events: Iterable[Event]) -> dict[int, Prior]:
    """Per choice, what a job's stream so far holds."""
    out: dict[int, Prior] = {}
    for ev in events:
        if not isinstance(ev, Delta):
            continue
        p = out.get(ev.choice, Prior())
        out[ev.choice] = Prior(
            ids=p.ids + ev.token_ids,
            text=p.text + ev.text[ev.prefix_len or 0 :],
            finish=ev.finish_reason,
            prefix_sent=p.prefix_sent or ev.prefix_len is not None,
            eos=p.eos or bool(ev.eos),
        )
    return out


def budget(n_ctx: int, prompt_len: int, max_tokens: int | None, prompt_index: int) -> int:
    """New tokens a prompt's choices may generate in all: `max_tokens`, clamped to the context (no
    `max_tokens`: up to the context's end). A prompt that leaves no room is the request's fault."""
    room = n_ctx - prompt_len
    if room < 0 or (room == 0 and max_tokens != 0):
        raise JobError(
            f"This model's maximum context length is {n_ctx} tokens; prompt {prompt_index} has {prompt_len}.",
            code="context_length_exceeded",
            param="prompt",
        )
    return room if max_tokens is None else min(max_tokens, room)


def remaining(total: int, done: int) -> int:
    """What a resumed choice still may generate."""
    return max(total - done, 0)


def seed_for(seed: int, choice: int, done: int) -> int:
    """A choice's sampling seed. A resumed choice cannot replay the dead attempt's RNG; the offset
    by the tokens already generated keeps it seeded, and different from the first attempt's."""
    return (seed + choice + 1_000_003 * done) % 2**63
