"""Speculative decoding on the CPU engine, drafts off and on in one sitting (in-process, the engine
alone: drafts change the engine's steps, not the queue path). Two loads: rewrites, whose `prediction`
is the input with the asked edits made (OpenAI's Predicted Outputs use), and extractions, which copy
quoted fields out of a document (prompt lookup's); greedy and sampled (temperature 0.8), at
concurrency 1 and 16. Drafts never change the text (the same seed gives the same tokens), so each
pair of runs makes the same tokens and their tokens/s compare directly.

    python -m ops.bench.speculative                   # prints a table
    python -m ops.bench.speculative --json spec.json  # and writes the rows
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from core.generation.params import GenerationParams
from workers.engine.base import SeqSpec, TokenEvent

_TEXTS = [
    "The library opens at nine in the morning and closes at six in the evening. Visitors may borrow up to "
    "five books at a time, and each loan lasts three weeks. Late returns cost ten cents a day.",
    "Our team meets every Monday to review the week's goals. Anna leads the meeting, Ben takes notes, and "
    "everyone shares one success and one problem. The meeting never lasts more than thirty minutes.",
    "The river starts in the northern hills and flows south for two hundred miles. It passes three small "
    "towns and one large city before it reaches the sea. Fishermen say the water is cleanest in spring.",
    "To make the soup, boil four cups of water, add two chopped carrots and one onion, and cook for twenty "
    "minutes. Then add salt, pepper and a handful of fresh herbs, and serve it hot with bread.",
]
_EDITS = [
    [("nine", "eight"), ("three weeks", "two weeks")],
    [("Monday", "Tuesday"), ("thirty", "forty")],
    [("two hundred", "three hundred"), ("spring", "autumn")],
    [("four cups", "five cups"), ("twenty", "thirty")],
]


def _edited(text: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        text = text.replace(old, new)
    return text


# (the request, its prediction: the text with the edits made)
REWRITE: list[tuple[str, str]] = [
    (
        "Repeat the text below exactly, word for word, but "
        + " and ".join(f'replace "{a}" with "{b}"' for a, b in edits)
        + ". Write only the new text.\n\n"
        + text,
        _edited(text, edits),
    )
    for text, edits in zip(_TEXTS, _EDITS, strict=True)
]

_DOCS = [
    'Order record. Customer: "Maria Lopez". Address: "12 Harbour Street, Leith". Item: "blue wool scarf". '
    'Quantity: "3". Price: "24.50 EUR". Shipping: "express". Note: "leave the parcel with the neighbour".',
    'Incident report. Reporter: "James Okafor". Location: "Building C, second floor". System: "payroll '
    'database". Severity: "high". Started: "2026-03-14 09:12". Summary: "the nightly export failed twice".',
    'Book entry. Title: "The Silent Orchard". Author: "Helen Marsh". Publisher: "Greyfield Press". Year: '
    '"1998". Pages: "312". Shelf: "fiction, row 4". Condition: "good, slight wear on the cover".',
    'Lease summary. Tenant: "Oskar Berg". Property: "Flat 7, 40 Mill Lane". Rent: "950 GBP a month". '
    'Start: "1 June 2026". Term: "twelve months". Deposit: "1,400 GBP". Pets: "one small dog allowed".',
]
EXTRACT: list[str] = [
    "List every field of the record below as `Field: value`, one per line, copying each quoted value exactly.\n\n" + doc
    for doc in _DOCS
]


def chat_ids(engine: Any, ask: str) -> list[int]:
    """A one-turn chat prompt in SmolLM2's template."""
    return engine.tokenize(f"<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n")


def prediction_ids(engine: Any, text: str) -> tuple[int, ...]:
    return tuple(engine.vocab.encode(text, add_special=False))


@dataclass
class Row:
    load: str
    temperature: float
    concurrency: int
    drafts: str
    tokens: int
    seconds: float
    accepted: int
    rejected: int
    # From the first generated token to the last: what a stream delivers once it has begun (the prompt's
    # prefill, the same with drafts or without, is left out).
    stream_seconds: float = 0.0
    output: list[list[int]] = field(default_factory=list, repr=False)  # each sequence's tokens

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def stream_tokens_per_s(self) -> float:
        return self.tokens / self.stream_seconds if self.stream_seconds else 0.0

    @property
    def acceptance(self) -> float:
        verified = self.accepted + self.rejected
        return self.accepted / verified if verified else 0.0


def specs(engine: Any, load: str, temperature: float, concurrency: int, max_tokens: int) -> list[SeqSpec]:
    """`concurrency` sequences cycling over the load's prompts (each its own seed)."""
    out = []
    for i in range(concurrency):
        if load == "rewrite":
            ask, pred = REWRITE[i % len(REWRITE)]
            prediction = prediction_ids(engine, pred)
        else:
            ask, prediction = EXTRACT[i % len(EXTRACT)], ()
        p = GenerationParams(max_tokens=max_tokens, temperature=temperature, seed=i, prediction=prediction)
        out.append(SeqSpec((load, i), chat_ids(engine, ask), max_tokens, p, i, cache_scope=i))
    return out


def measure(engine: Any, load: str, temperature: float, concurrency: int, mode: str, max_tokens: int) -> Row:
    """All `concurrency` sequences at once, to the end; the prompt cache emptied first."""
    decoder = engine._decoder
    for slot in decoder.slot_tokens:
        decoder.slot_tokens[slot] = []
    engine.speculative = "off" if mode.startswith("off") else mode
    tokens = accepted = rejected = 0
    out: dict[Any, list[int]] = {}
    first = last = None
    start = time.perf_counter()
    try:
        for s in specs(engine, load, temperature, concurrency, max_tokens):
            engine.add(s)
            out[s.key] = []
        while engine.has_work():
            for ev in engine.step():
                if isinstance(ev, TokenEvent) and ev.token_id is not None:
                    now = time.perf_counter()
                    first, last = first or now, now
                    tokens += 1
                    out[ev.key].append(ev.token_id)
                if isinstance(ev, TokenEvent):
                    accepted += ev.drafted
                    rejected += ev.rejected
    finally:
        engine.speculative = None
    streamed = (last - first) if first is not None and last is not None else 0.0
    row = Row(load, temperature, concurrency, mode, tokens, time.perf_counter() - start, accepted, rejected, streamed)
    row.output = list(out.values())
    return row


def ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """Drafts on over off, per load, temperature and concurrency."""
    off = {(r.load, r.temperature, r.concurrency): r for r in rows if r.drafts == "off"}
    out = []
    for r in rows:
        base = off.get((r.load, r.temperature, r.concurrency))
        if r.drafts != "off" and base is not None and base.tokens_per_s:
            out.append(
                {
                    "load": r.load,
                    "temperature": r.temperature,
                    "concurrency": r.concurrency,
                    "drafts": r.drafts,
                    "speedup": round(r.tokens_per_s / base.tokens_per_s, 3),
                    "stream_speedup": round(r.stream_tokens_per_s / base.stream_tokens_per_s, 3)
                    if base.stream_tokens_per_s
                    else None,
                    "acceptance": round(r.acceptance, 3),
                    "same_tokens": r.output == base.output,
                }
            )
    return out


def table(rows: list[Row]) -> str:
    lines = ["load     temp  conc drafts     tokens  tok/s  streamed tok/s  accepted rejected acceptance"]
    for r in rows:
        lines.append(
            f"{r.load:8} {r.temperature:4.1f} {r.concurrency:5d} {r.drafts:9} {r.tokens:7d} {r.tokens_per_s:6.1f} "
            f"{r.stream_tokens_per_s:15.1f} {r.accepted:8d} {r.rejected:8d} {r.acceptance:9.2f}"
        )
    lines.append("")
    lines += [
        f"{x['load']:8} {x['temperature']:4.1f} {x['concurrency']:5d} {x['drafts']}: {x['speedup']:.2f}x, "
        f"streamed {x['stream_speedup'] or 0:.2f}x (acceptance {x['acceptance']:.2f}, same tokens: {x['same_tokens']})"
        for x in ratios(rows)
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    from core.registry import smollm2_gguf
    from ops.harness import ENGINE_THREADS
    from workers.engine.llamacpp import LlamaCppEngine

    engine = LlamaCppEngine("smollm2", smollm2_gguf(), n_ctx=1024, max_batch=16, n_threads=ENGINE_THREADS)
    rows: list[Row] = []
    for load in ("rewrite", "extract"):
        for temperature in (0.0, 0.8):
            for c in (int(x) for x in args.concurrency.split(",")):
                # "off again": a second run without drafts, to tell drafts' effect on the tokens from the
                # run-to-run spread of a step's arithmetic (which sequences share it, and how many rows)
                for mode in ("off", "auto", "off again"):
                    rows.append(measure(engine, load, temperature, c, mode, args.max_tokens))
                    print(table(rows[-1:]).splitlines()[1], flush=True)
    print(table(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "rows": [
                        {k: v for k, v in asdict(r).items() if k != "output"}
                        | {"tokens_per_s": r.tokens_per_s, "stream_tokens_per_s": r.stream_tokens_per_s}
                        for r in rows
                    ],
                    "ratios": ratios(rows),
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
