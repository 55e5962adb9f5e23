"""What each client of the fault and cluster harnesses saw, event by event, and the checker that reads
it back (issue 39). The harnesses' audit compares each request's final text with an undisturbed run;
this looks inside a stream: at every connection a streamed request made (the first, each re-attachment
with `Last-Event-ID`, each SDK re-ask), what it had received so far must be the start of the reference
text, so a token delivered twice or skipped at a resume point is named where it happened, even when a
later connection would have hidden it. Raw-SSE clients also check the events' ids: positional stream
entry ids must rise strictly across every connection of one request (a repeated entry is a repeat).

    python -m ops.history WORKDIR/history.jsonl     # check a run's recorded histories again

The file's first line holds the reference texts by kind and prompt; each further line is one client
request: its kind, prompt, job, final status and every event it received as `[connection, id, text]`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Clients that re-attach where they left off (Last-Event-ID) vs those whose every connection starts
# the job's stream again (the `openai` SDK has no Last-Event-ID: asked again under its key, it replays).
RESUMING = ("stream",)


@dataclass(frozen=True)
class Seen:
    """One event a streaming client received: on which of the request's connections (0 = the first),
    its SSE id (None where the client does not see ids) and the text it carried."""

    conn: int
    id: str | None
    text: str


@dataclass
class Verdict:
    histories: int = 0  # streamed requests whose events were checked
    events: int = 0
    connections: int = 0  # connections that received at least one event
    repeated: int = 0  # an entry or a stretch of text delivered twice
    skipped: int = 0  # text missing or different at a resume point
    problems: list[str] = field(default_factory=list)


def _position(entry_id: str) -> tuple[int, int] | None:
    ms, sep, seq = entry_id.partition("-")
    return (int(ms), int(seq)) if sep and ms.isdigit() and seq.isdigit() else None


def check(kind: str, label: str, events: Sequence[Seen], expected: str, verdict: Verdict) -> None:
    """Add one streamed request's history to `verdict`: repeats and skips, named with `label`."""
    if not events:
        return
    verdict.histories += 1
    verdict.events += len(events)
    verdict.connections += len({e.conn for e in events})
    resuming = kind in RESUMING
    last: tuple[int, int] | None = None
    text, conn, began = "", events[0].conn, 0  # began: how much text the client had when `conn` opened
    for i, e in enumerate(events):
        if e.conn != conn:
            conn = e.conn
            if not resuming:  # this client starts over on every connection
                text, last = "", None
            began = len(text)
        if e.id is not None:
            pos = _position(e.id)
            if pos is None:
                verdict.skipped += 1
                verdict.problems.append(f"{label}: event {i} has id {e.id!r}, not a stream entry id")
                return
            if last is not None and pos <= last:
                verdict.repeated += 1
                verdict.problems.append(f"{label}: connection {e.conn} delivered entry {e.id} again (after {last})")
                return
            last = pos
        text += e.text
        if not expected.startswith(text):
            at = next((j for j, (a, b) in enumerate(zip(text, expected, strict=False)) if a != b), len(expected))
            # A repeat: what this connection brought is text the client already had before it opened.
            head = text[began : began + 8]
            if head and 0 <= expected.find(head) < began:
                verdict.repeated += 1
            else:
                verdict.skipped += 1
            verdict.problems.append(
                f"{label}: on connection {e.conn} the text left the reference at char {at}: "
                f"got {text[at : at + 24]!r}, expected {expected[at : at + 24]!r}"
            )
            return


@dataclass
class Record:
    """One client request as the file holds it."""

    kind: str
    prompt: str
    job_id: str | None
    status: str | None
    events: list[Seen]


def write(path: Path, references: dict[str, dict[str, str]], records: Iterable[Record]) -> None:
    with path.open("w") as f:
        f.write(json.dumps({"references": references}) + "\n")
        for r in records:
            row = asdict(r)
            row["events"] = [[e.conn, e.id, e.text] for e in r.events]
            f.write(json.dumps(row) + "\n")


def read(path: Path) -> tuple[dict[str, dict[str, str]], Iterator[Record]]:
    lines = path.read_text().splitlines()
    references: dict[str, dict[str, str]] = json.loads(lines[0])["references"]

    def records() -> Iterator[Record]:
        for line in lines[1:]:
            row: dict[str, Any] = json.loads(line)
            row["events"] = [Seen(*e) for e in row["events"]]
            yield Record(**row)

    return references, records()


def reference_for(references: dict[str, dict[str, str]], kind: str) -> dict[str, str]:
    """The undisturbed answers a client of this kind must get: a completion's, a chat's, a response's."""
    if "response" in kind:
        return references["response"]
    return references["chat"] if "chat" in kind else references["completion"]


def check_file(path: Path) -> Verdict:
    """Every recorded history of `path` against its references."""
    references, records = read(path)
    verdict = Verdict()
    for r in records:
        expected = reference_for(references, r.kind).get(r.prompt)
        if expected is not None:
            check(r.kind, f"{r.kind} {r.job_id}", r.events, expected, verdict)
    return verdict


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        raise SystemExit(__doc__)
    verdict = check_file(Path(args[0]))
    print(json.dumps(asdict(verdict), indent=2))
    sys.exit(1 if verdict.repeated or verdict.skipped else 0)


if __name__ == "__main__":
    main()
