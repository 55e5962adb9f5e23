"""The fleet scenarios (issue 53) on the cluster harness's hosts (ops/cluster.py), that is two worker
hosts of one CPU thread each, two API hosts behind HAProxy, Postgres and Redis on hosts of their own:

    python -m ops.fleet                      # 20 sessions x 5 turns (docs/scaling.md has its figures)
    python -m ops.fleet --short              # CI's form (tests/e2e/test_fleet.py)
    python -m ops.fleet --json out.json

- `affinity`: multi-turn chat sessions (each with a long system prompt of its own, every turn streamed
  through the `openai` SDK), once with SPOOL_AFFINITY off and once on, each on freshly started workers
  (empty caches). Reported per run: cached prompt tokens per prompt token over the turns that can hit
  a cache (every turn after a session's first), and TTFT p50 of those turns. The text of every turn
  must be the same in both runs (greedy): the run with affinity off is the reference.
- `worker-kill`: the sessions again (fresh workers, affinity on), and the worker host holding the most
  sessions SIGKILLed mid-run: every turn ends once, with the reference text, every stream's events
  checked connection by connection (ops/history.py), and the killed host's sessions served by the
  other host afterwards.
- `hot-key`: a burst of requests sharing one `prompt_cache_key`, past SPOOL_AFFINITY_KEY_RATE: the key
  spills, so both workers serve it.
- `from-zero`: the model declared with no minimum of workers (SPOOL_MIN_WORKERS 0), both workers
  stopped, streams sent: none refused; the harness reads the dispatcher's `spool_wanted_workers` and
  starts a worker, as an autoscaler (KEDA) would; the first TTFT is the worker's start plus a TTFT.

The report is JSON; the run exits non-zero when any check fails. Needs what ops/cluster.py needs.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from ops import history
from ops.cluster import Cluster, addr, running
from ops.faults import MODEL, wait_for
from ops.harness import SPOOL

WORDS = (
    "invoice shipment warehouse refund courier parcel ledger account balance order customer ticket "
    "priority region supplier contract delivery schedule returns inventory pallet carrier tracking"
).split()


@dataclass
class Shape:
    sessions: int = 20
    turns: int = 5
    system_words: int = 220  # about 300 tokens of SmolLM2's vocabulary
    max_tokens: int = 12
    hot_burst: int = 12


SHORT = Shape(sessions=6, turns=3, system_words=220, max_tokens=8, hot_burst=9)


@dataclass
class Turn:
    session: int
    turn: int
    messages: list[dict[str, str]] = field(default_factory=list)  # what it sent
    text: str = ""
    job_id: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    events: list[history.Seen] = field(default_factory=list)
    error: str | None = None


@dataclass
class FleetReport:
    shape: dict[str, Any] = field(default_factory=dict)
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not self.problems


def system_prompt(session: int, words: int) -> str:
    rng = random.Random(session)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are agent {session} of the ACME operations desk. Case notes: {body}. Answer in one short sentence."


TOPICS = ("the invoice", "the courier", "the refund", "the pallet", "the contract", "the carrier", "the supplier")


def question(session: int, turn: int) -> str:
    return f"What should I check about {TOPICS[turn % len(TOPICS)]} in case {session}?"


def _client(base_url: str, key: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=8, timeout=180)


def session_turns(
    base_url: str,
    key: str,
    session: int,
    shape: Shape,
    tag: str,
    between: Callable[[int, int], None],
    cache: bool = True,
) -> list[Turn]:
    """One session's turns, each streamed with the whole history so far; `between(session, turn)` runs
    after each. `cache` false: no prefix reuse (`cache_prompt`), so each turn's text is the same in
    every run whatever the caches held (see `scenario_worker_kill`)."""
    client = _client(base_url, key)
    messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt(session, shape.system_words)}]
    out = []
    for t in range(shape.turns):
        messages.append({"role": "user", "content": question(session, t)})
        turn = Turn(session, t, list(messages))
        started = time.perf_counter()
        try:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=shape.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"Idempotency-Key": f"{tag}-{session}-{t}"},
                extra_body={"ignore_eos": True, "cache_prompt": cache},
            )
            for chunk in stream:
                turn.job_id = turn.job_id or chunk.id
                if chunk.choices and chunk.choices[0].delta.content:
                    if turn.ttft_s is None:
                        turn.ttft_s = time.perf_counter() - started
                    turn.text += chunk.choices[0].delta.content
                    turn.events.append(history.Seen(0, None, chunk.choices[0].delta.content))
                if chunk.usage is not None:
                    turn.prompt_tokens = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    turn.cached_tokens = (details.cached_tokens or 0) if details else 0
        except Exception as exc:  # reported, never raised: the audit counts it
            turn.error = f"{type(exc).__name__}: {exc}"
        out.append(turn)
        messages.append({"role": "assistant", "content": turn.text})
        between(session, t)
    return out


def run_sessions(
    base_url: str,
    key: str,
    shape: Shape,
    tag: str,
    between: Callable[[int, int], None] = lambda s, t: None,
    cache: bool = True,
) -> list[Turn]:
    with ThreadPoolExecutor(shape.sessions) as pool:
        per = pool.map(lambda s: session_turns(base_url, key, s, shape, tag, between, cache), range(shape.sessions))
        return [t for turns in per for t in turns]


def spread(f: Fleet, turns: list[Turn]) -> dict[str, int]:
    """Sessions per worker host, by the host that served each session's first turn."""
    pids = _pids(f.c)
    workers = f.workers_of([t.job_id for t in turns if t.turn == 0 and t.job_id])
    hosts = [f.host_of(w, pids) or "?" for w in workers.values()]
    return {h: hosts.count(h) for h in sorted(set(hosts))}


def summary(turns: list[Turn]) -> dict[str, Any]:
    """Cached prompt tokens per prompt token and TTFT p50 over the turns that can hit a cache (each
    session's later turns), and over all turns."""
    later = [t for t in turns if t.turn > 0 and t.error is None]
    prompt = sum(t.prompt_tokens for t in later)
    ttfts = [t.ttft_s for t in later if t.ttft_s is not None]
    return {
        "turns": len(turns),
        "failed": sum(t.error is not None for t in turns),
        "cached_ratio_later_turns": round(sum(t.cached_tokens for t in later) / prompt, 3) if prompt else None,
        "cached_ratio_all_turns": round(
            sum(t.cached_tokens for t in turns) / max(1, sum(t.prompt_tokens for t in turns)), 3
        ),
        "ttft_p50_later_turns_s": round(statistics.median(ttfts), 3) if ttfts else None,
    }


class Fleet:
    """The cluster, with its API hosts and dispatcher restartable under other settings."""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.settings: dict[str, str] = {}
        self.dispatcher_metrics = 0

    def restart_control(self, **settings: str) -> None:
        """The dispatcher and both API hosts again, with `settings` (SPOOL_...)."""
        self.settings = settings
        from ops.harness import free_port

        for name in ("dispatcher", "api1", "api2"):
            _, proc = self.c.procs.pop(name)
            proc.kill()
            proc.wait(10)
        self.dispatcher_metrics = free_port()
        env = self.c.env(**settings, SPOOL_METRICS_PORT=str(self.dispatcher_metrics))
        self.c.start("dispatcher", "data", [*SPOOL, "dispatcher"], env)
        for host in ("api1", "api2"):
            self.c.start(host, host, [*SPOOL, "api"], self.c.env(**settings))
        wait_for(lambda: _up(self.c.base_url), 60, "both API hosts again")

    def restart_workers(self) -> None:
        """Both workers stopped and started again: their caches empty."""
        self.c.stop_host("work1")
        self.c.stop_host("work2")
        wait_for(lambda: self.live() == 0, 30, "no live worker")
        self.c.start_worker("work1")
        self.c.start_worker("work2")
        wait_for(lambda: self.live() == 2, 60, "two live workers")
        # Each API host sees a model's live workers anew at most once a second (core/jobs/service.py
        # LIVE_CACHE_S): sessions begun sooner found work1 alone, their first turns went to the shared
        # queue, and a second turn that then went home found nothing cached (a CI run read 0.84).
        time.sleep(2.5)

    def live(self) -> int:
        try:
            r = httpx.get(self.c.base_url + "/ready", timeout=3)
            return int(r.json().get("live_workers", {}).get(MODEL, 0))
        except (httpx.HTTPError, ValueError):
            return 0

    def gauge(self, name: str) -> float | None:
        try:
            body = httpx.get(f"http://{addr('data')}:{self.dispatcher_metrics}/metrics", timeout=3).text
        except httpx.HTTPError:
            return None
        m = re.search(rf'^{name}{{model="{MODEL}"}} ([0-9.e+-]+)$', body, re.M)
        return float(m.group(1)) if m else None

    def workers_of(self, job_ids: list[str]) -> dict[str, str]:
        """job id -> the worker (host:pid) that ended it."""
        return {job_id: worker for job_id, (worker, _) in self.jobs(job_ids).items()}

    def jobs(self, job_ids: list[str]) -> dict[str, tuple[str, float]]:
        """job id -> (the worker that ended it, when it was created: unix time)."""
        db = create_engine(self.c.db_url)
        try:
            with db.connect() as conn:
                q = text("SELECT id, worker, extract(epoch from created_at) AS made FROM jobs WHERE id = ANY(:ids)")
                return {r.id: (r.worker, float(r.made)) for r in conn.execute(q, {"ids": job_ids})}
        finally:
            db.dispose()

    def host_of(self, worker: str | None, pids: dict[int, str]) -> str | None:
        if not worker:
            return None
        pid = int(worker.rsplit(":", 1)[1])
        return pids.get(pid)


def _up(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def _pids(c: Cluster) -> dict[int, str]:
    return {proc.pid: host for host, (_, proc) in c.procs.items() if host.startswith("work")}


# How far below the model's own top choice (nats) a generated token may be and still be that greedy
# choice: a near-tie that other arithmetic decided the other way. The scoring prefills the whole text
# (llama.cpp's kernel for 64 rows and more), the generation decoded a row at a time; SmolLM2 Q4_1's
# log-probabilities differ between those kernels by up to 0.4 (workers/engine/llamacpp.py, SCORE_CHUNK;
# a full run's largest near-tie: 0.16). A token repeated, skipped or taken from another conversation
# is nats away.
NEAR_TIE = 0.5


def greedy_gap(base_url: str, key: str, messages: list[dict[str, str]], answer: str) -> float | None:
    """How far the answer strays from greedy decoding: the largest gap, over its tokens, between the
    model's top log-probability and the chosen token's, scored by the model itself. The conversation
    with the answer as the assistant's message to continue is templated and tokenized as the API does
    (core/jobs/service.py `translate`), and its tokens sent back as a completion prompt to echo with
    log-probabilities. None: it could not be scored (its last tokens did not spell the answer)."""
    from core.config import get_settings
    from core.infra.tokenizers import tokenizer_for
    from core.jobs.service import translate
    from core.protocol.schemas import ChatCompletionRequest
    from core.registry import settings_for

    req = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [*messages, {"role": "assistant", "content": answer}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
    )
    _, prompts, _ = translate(req, settings_for(MODEL, get_settings()), tokenizer_for(MODEL), compile=False)
    # Two alternatives a position: the turns were generated with `ignore_eos`, so where the model's top
    # choice is to end, the greedy token is the best of the rest.
    body = {"model": MODEL, "prompt": prompts[0].ids, "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    r.raise_for_status()
    lp = r.json()["choices"][0]["logprobs"]
    n = len(prompts[0].ids)  # the echoed prompt's tokens come first; the one generated token after them
    tokens, chosen, tops = lp["tokens"][:n], lp["token_logprobs"][:n], lp["top_logprobs"][:n]
    gaps, text = [], ""
    for i in range(n - 1, 0, -1):  # the answer's tokens are the prompt's last ones
        if text == answer:
            break
        best = max(
            (lp for tok, lp in tops[i].items() if not (tok.startswith("<|") and tok.endswith("|>"))), default=chosen[i]
        )
        gaps.append(best - chosen[i])
        text = tokens[i] + text
    return max(gaps, default=0.0) if text == answer else None


def _say(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True)


def _check_texts(
    name: str, turns: list[Turn], reference: dict[tuple[int, int], str], report: FleetReport, base_url: str, key: str
) -> dict:
    """Every turn ended, once, with the reference text, or with a text the model itself scores as its
    greedy answer to that turn's messages up to a near-tie (`greedy_gap`): two undisturbed runs of
    these sessions on this engine differ at near-ties (the arithmetic of a prompt prefilled beside other
    prompts differs in the last bits). Every stream's events are checked against the text it ended with."""
    verdict = history.Verdict()
    wrong = near_ties = 0
    for t in turns:
        want = reference.get((t.session, t.turn))
        if t.error is not None:
            report.problems.append(f"{name}: session {t.session} turn {t.turn} failed: {t.error}")
            continue
        if want is not None and t.text != want:
            gap = greedy_gap(base_url, key, t.messages, t.text)
            if gap is not None and gap <= NEAR_TIE:
                near_ties += 1
            else:
                wrong += 1
                report.problems.append(
                    f"{name}: session {t.session} turn {t.turn}: {t.text!r} != {want!r}, and {gap} nats from greedy"
                )
        history.check("chat-sdk", f"{name} s{t.session} t{t.turn}", t.events, t.text, verdict)
    report.problems += verdict.problems
    jobs = [t.job_id for t in turns if t.job_id]
    if len(set(jobs)) != len(jobs):
        report.problems.append(f"{name}: {len(jobs) - len(set(jobs))} turns share a job")
    return {
        "wrong": wrong,
        "near_ties": near_ties,
        "streams_checked": verdict.histories,
        "repeated": verdict.repeated,
        "skipped": verdict.skipped,
    }


def scenario_affinity(f: Fleet, key: str, shape: Shape, report: FleetReport) -> None:
    """The sessions with affinity off, then on, each on freshly started workers (empty caches)."""
    runs: dict[str, list[Turn]] = {}
    for mode in ("off", "on"):
        f.restart_control(SPOOL_AFFINITY="true" if mode == "on" else "false")
        f.restart_workers()
        _say(f"affinity {mode}: {shape.sessions} sessions x {shape.turns} turns")
        started = time.monotonic()
        runs[mode] = run_sessions(f.c.base_url, key, shape, f"aff-{mode}")
        report.runs[f"affinity_{mode}"] = summary(runs[mode]) | {
            "seconds": round(time.monotonic() - started, 1),
            "sessions_by_host": spread(f, runs[mode]),
        }
        for t in runs[mode]:
            if t.error is not None:
                report.problems.append(f"affinity {mode}: session {t.session} turn {t.turn} failed: {t.error}")
    # Not a check, a finding: a prompt whose prefix came from the cache is computed by smaller matrix
    # products than the same prompt prefilled whole (llama.cpp picks another kernel under 64 rows, and the
    # cached history's generated tokens were decoded one at a time), so at a near-tie a greedy choice
    # may go the other way. Every turn's history is the session's own either way.
    off = {(t.session, t.turn): t.text for t in runs["off"]}
    report.runs["affinity_on"]["texts_unlike_off"] = sum(t.text != off.get((t.session, t.turn)) for t in runs["on"])
    on, off_row = report.runs["affinity_on"], report.runs["affinity_off"]
    if (on["cached_ratio_later_turns"] or 0) < 0.9:
        report.problems.append(f"affinity on: cached ratio {on['cached_ratio_later_turns']} < 0.9")
    if on["ttft_p50_later_turns_s"] is None or off_row["ttft_p50_later_turns_s"] is None:
        report.problems.append("affinity: no TTFT measured")
    elif on["ttft_p50_later_turns_s"] >= off_row["ttft_p50_later_turns_s"]:
        report.problems.append("affinity on: TTFT p50 not lower than off")


def scenario_worker_kill(f: Fleet, key: str, shape: Shape, report: FleetReport) -> None:
    """The sessions undisturbed, then again with the worker host holding the most of them SIGKILLed once
    every session has had its first turn answered. Both runs without prefix reuse (`cache_prompt`
    false): each turn's text is then the same in every run, so the disturbed run's must equal the
    undisturbed one's exactly (a resumed stream included: the next attempt continues from the streamed
    tokens, decoded as they were). Affinity still routes each session (its key is its first messages)."""
    f.restart_control(SPOOL_AFFINITY="true")
    f.restart_workers()
    _say(f"worker-kill: the reference run, {shape.sessions} sessions x {shape.turns} turns")
    undisturbed = run_sessions(f.c.base_url, key, shape, "kill-ref", cache=False)
    report.runs["worker_kill_reference"] = summary(undisturbed) | {"sessions_by_host": spread(f, undisturbed)}
    reference = {(t.session, t.turn): t.text for t in undisturbed if t.error is None}
    pids = _pids(f.c)
    first_turns = threading.Semaphore(0)
    killed: dict[str, Any] = {}
    began = time.time()

    def killer() -> None:
        for _ in range(shape.sessions):
            first_turns.acquire()
        db = create_engine(f.c.db_url)
        q = text(
            "SELECT worker, count(*) AS n FROM jobs WHERE worker IS NOT NULL AND created_at >= to_timestamp(:t)"
            " GROUP BY worker"
        )
        with db.connect() as conn:
            counts = {f.host_of(r.worker, pids): r.n for r in conn.execute(q, {"t": began})}
        db.dispose()
        victim = "work1" if counts.get("work1", 0) >= counts.get("work2", 0) else "work2"
        killed["host"], killed["at"] = victim, time.time()
        f.c.kill_host(victim)
        _say(f"worker-kill: {victim} SIGKILLed (it had served {counts.get(victim, 0)} of this run's jobs)")

    def between(session: int, turn: int) -> None:
        if turn == 0:
            first_turns.release()

    threading.Thread(target=killer, daemon=True).start()
    _say(f"worker-kill: {shape.sessions} sessions x {shape.turns} turns, a worker killed after the first turns")
    disturbed = run_sessions(f.c.base_url, key, shape, "kill", between, cache=False)
    row = summary(disturbed) | _check_texts("worker-kill", disturbed, reference, report, f.c.base_url, key)
    victim = killed.get("host")
    row["killed"] = victim
    rows = f.jobs([t.job_id for t in disturbed if t.job_id])
    hosts = {job_id: f.host_of(worker, pids) for job_id, (worker, _) in rows.items()}
    # The killed host's sessions: those whose first turn it served. Each of their turns sent after the
    # kill must have been served by the other host.
    theirs = {t.session for t in disturbed if t.turn == 0 and hosts.get(t.job_id or "") == victim}
    at = killed.get("at", float("inf"))
    later = [t for t in disturbed if t.session in theirs and rows.get(t.job_id or "", ("", 0.0))[1] > at]
    moved = [t for t in later if hosts.get(t.job_id or "") not in (None, victim)]
    row |= {"sessions_of_killed_host": len(theirs), "their_later_turns": len(later), "served_by_the_other": len(moved)}
    if victim is None:
        report.problems.append("worker-kill: no worker was killed")
    elif not theirs or len(moved) != len(later):
        report.problems.append(f"worker-kill: the killed host's sessions were not all served by the other: {row}")
    report.runs["worker_kill"] = row
    f.c.start_worker(victim or "work1")


def scenario_hot_key(f: Fleet, key: str, shape: Shape, report: FleetReport) -> None:
    """A burst sharing one `prompt_cache_key` past SPOOL_AFFINITY_KEY_RATE (1 a second here: the burst's
    requests reach the API hosts over a few seconds of a busy 2-core machine)."""
    f.restart_control(SPOOL_AFFINITY="true", SPOOL_AFFINITY_KEY_RATE="1")
    wait_for(lambda: f.live() == 2, 60, "two live workers")
    client = _client(f.c.base_url, key)

    def ask(i: int) -> str:
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Hot key request {i}: name a colour."}],
            max_tokens=4,
            temperature=0,
            prompt_cache_key="the-whole-tenant-uses-this",
        )
        return r.id

    with ThreadPoolExecutor(shape.hot_burst) as pool:
        ids = list(pool.map(ask, range(shape.hot_burst)))
    pids = _pids(f.c)
    hosts = [f.host_of(w, pids) for w in f.workers_of(ids).values()]
    row = {"requests": len(ids), "by_host": {h: hosts.count(h) for h in set(hosts)}}
    if len(set(hosts)) < 2:
        report.problems.append(f"hot-key: one worker served the whole burst: {row}")
    report.runs["hot_key"] = row


def scenario_from_zero(f: Fleet, key: str, shape: Shape, report: FleetReport) -> None:
    f.restart_control(SPOOL_AFFINITY="true", SPOOL_MIN_WORKERS="0", SPOOL_COLD_WAIT_S="300")
    for host in ("work1", "work2"):
        before = f.c.log(host).count("draining:")
        f.c.stop_host(host)  # a scale-down to zero: each worker leaves the live set on its way out
        if f.c.log(host).count("draining:") <= before:  # its SIGTERM handler: nothing new, its queue handed over
            report.problems.append(f"from-zero: {host} did not say it was draining on SIGTERM")
    wait_for(lambda: f.live() == 0, 60, "no live worker")
    out: dict[int, Any] = {}

    def ask(i: int) -> None:
        started = time.perf_counter()
        try:
            stream = _client(f.c.base_url, key).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Cold request {i}"}],
                max_tokens=4,
                temperature=0,
                stream=True,
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    out.setdefault(i, time.perf_counter() - started)
        except Exception as exc:
            out[i] = f"{type(exc).__name__}: {exc}"

    askers = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for a in askers:
        a.start()
    # The autoscaler's part: start a worker once the dispatcher wants one more than are live.
    wait_for(lambda: (f.gauge("spool_wanted_workers") or 0) > f.live(), 60, "the dispatcher wanting a worker")
    started = time.perf_counter()
    f.c.start_worker("work1")
    up = time.perf_counter() - started
    for a in askers:
        a.join(300)
    refused = [v for v in out.values() if isinstance(v, str)]
    ttfts = [v for v in out.values() if isinstance(v, float)]
    row = {
        "worker_start_s": round(up, 2),
        "first_ttft_s": round(min(ttfts), 2) if ttfts else None,
        "refused": len(refused),
    }
    if refused or len(ttfts) != len(askers):
        report.problems.append(f"from-zero: requests refused or unanswered: {refused}")
    report.runs["from_zero"] = row
    f.c.start_worker("work2")


SCENARIOS = ("affinity", "worker-kill", "hot-key", "from-zero")


def run(shape: Shape, workdir: Path | None = None, scenarios: tuple[str, ...] = SCENARIOS) -> FleetReport:
    workdir = workdir or Path(tempfile.mkdtemp(prefix="spool-fleet-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {workdir}", flush=True)
    report = FleetReport(shape=asdict(shape))
    started = time.monotonic()
    with running(workdir) as c:
        f = Fleet(c)
        if "affinity" in scenarios:
            scenario_affinity(f, c.key, shape, report)
        if "worker-kill" in scenarios:
            scenario_worker_kill(f, c.key, shape, report)
        if "hot-key" in scenarios:
            scenario_hot_key(f, c.key, shape, report)
        if "from-zero" in scenarios:
            scenario_from_zero(f, c.key, shape, report)
    report.seconds = round(time.monotonic() - started, 1)
    report.runs["host"] = {"name": socket.gethostname()}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="CI's form: 6 sessions x 3 turns")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(SCENARIOS)}")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    chosen = tuple(args.only.split(",")) if args.only else SCENARIOS
    report = run(SHORT if args.short else Shape(), args.workdir, chosen)
    body = json.dumps(asdict(report) | {"clean": report.clean}, indent=2)
    print(body)
    if args.json:
        args.json.write_text(body)
    raise SystemExit(0 if report.clean else 1)


if __name__ == "__main__":
    main()
