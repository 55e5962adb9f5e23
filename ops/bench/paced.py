"""The GPU-front table in one command: Spool in front of the paced engine vs the paced engine alone.

    python -m ops.bench.paced --stack                     # starts its own stack (below), then measures
    python -m ops.bench.paced --stack --roots base=/tmp/spool-base,new=. --rounds 2   # side by side
    python -m ops.bench.paced --url URL --api-key KEY --pids api=P,worker=P,dispatcher=P,postgres=P,redis=P

`--stack` starts API, dispatcher and worker the way the tests do (ops/harness.running_stack) with
the paced engine's settings (PACED_ENV; concurrency + 8 worker threads), on a database of its own
(`spool_bench`, dropped and made fresh) and a private redis-server on a free port (no persistence),
so Redis's CPU is Spool's alone; Postgres's is the backends of that database plus the server's own
background processes. `--roots` names checkouts (a `git worktree` of an older commit, say): each
round starts a stack from each in turn, so before and after are measured in one sitting.

For each concurrency (streamed, `ignore_eos`), interleaved: the paced engine alone (in-process,
`ops.bench.engine`, same settings as the worker: run this with the stack's SPOOL_PACED_* and
SPOOL_MAX_BATCH), then the same prompts through Spool, with the CPU of every named process tree
(`/proc/PID/stat` utime+stime of the process and its descendants: uvicorn's and Postgres's
children count) and of this client read before and after the Spool run. Then short jobs
(`max_tokens` 1, plain JSON) at the last concurrency. Prints one table; `--json` keeps it. Each
checkout's run first times this sitting's yardstick (ops/bench/yardstick.py, a fixed CPU workload):
Spool's CPU costs are also given in its units (`yu`), which compare across sittings.
The machine should be otherwise idle: other processes' CPU is not separated from Postgres's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from ops.bench import yardstick
from ops.bench.client import BenchConfig, Summary, bench_engine, bench_http

ROOT = Path(__file__).resolve().parents[2]
TICK = os.sysconf("SC_CLK_TCK")

# The modelled GPU (issue 26): an 8B model at 4 bits on an H100-class card, batch up to 64.
PACED_ENV = {
    "SPOOL_ENGINE": "paced",
    "SPOOL_MAX_BATCH": "64",
    "SPOOL_PACED_STEP_MS": "8",
    "SPOOL_PACED_SEQ_MS": "0.25",
    "SPOOL_PACED_PREFILL_TPS": "10000",
}
# running_stack's short test timings (3 s leases, 0.5 s dispatcher ticks) put back to the defaults a
# deployment runs: a lease renewed every second per job is load a real stack does not have.
DEPLOYED_ENV = {"SPOOL_LEASE_S": "30", "SPOOL_DISPATCHER_INTERVAL_S": "1", "SPOOL_DISPATCH_TIMEOUT_S": "60"}

Meter = Callable[[], float]  # CPU seconds so far


def _stats() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds) for every process now."""
    out: dict[int, tuple[int, float]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        f = raw[raw.rindex(")") + 2 :].split()
        out[int(d)] = (int(f[1]), (int(f[11]) + int(f[12])) / TICK)
    return out


def tree_cpu(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds of each named process and all its live descendants."""
    st = _stats()
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in st.items():
        kids.setdefault(ppid, []).append(pid)
    res: dict[str, float] = {}
    for name, root in roots.items():
        todo, total = [root], 0.0
        while todo:
            p = todo.pop()
            total += st.get(p, (0, 0.0))[1]
            todo += kids.get(p, [])
        res[name] = total
    return res


def tree_meter(pid: int) -> Meter:
    return lambda: tree_cpu({"x": pid})["x"]


def postgres_meter(database: str) -> Meter:
    """Postgres's CPU for one database on a shared server: the backends connected to it and the
    server's background processes (WAL writer, checkpointer...), not other databases' backends."""

    def read() -> float:
        total = 0.0
        st = _stats()
        for pid in st:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if not cmd.startswith("postgres: "):
                continue
            words = cmd.split()
            backend = len(words) >= 4 and "(" in cmd  # "postgres: 15/main: USER DB HOST(PORT) STATE"
            if not backend or database in words:
                total += st[pid][1]
        return total

    return read


def client_cpu() -> float:
    t = os.times()
    return t.user + t.system


def engine_alone(cfg: BenchConfig) -> Summary:
    return bench_engine(cfg)[0]


@contextlib.contextmanager
def profiled(pids: dict[str, int], out: Path | None, tag: str) -> Iterator[None]:
    """py-spy (the bench extra) sampling each named process and its children while the block runs,
    only the thread holding the GIL (where a Python process's CPU goes): collapsed stacks in
    OUT/TAG-NAME.txt (`py-spy record --format raw`; sum the counts per frame)."""
    if out is None:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    spy = str(Path(sys.executable).with_name("py-spy"))
    procs = [
        subprocess.Popen(
            [
                spy,
                "record",
                "--format",
                "raw",
                "--rate",
                "250",
                "--subprocesses",
                "--nonblocking",
                "--gil",
                "-p",
                str(pid),
                "-o",
                str(out / f"{tag}-{name}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in pids.items()
    ]
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait(60)


Calls = Callable[[], dict[str, int]]


# Counters that are traffic, not Redis commands: reported apart (per token, per job) in docs/scaling.md.
TRAFFIC = ("redis_bytes_in", "redis_bytes_out", "pg_transactions", "pg_rows_written")


def redis_calls(url: str, database: str | None = None) -> Calls:
    """Commands Redis has served so far, by name (`INFO commandstats`): how many round trips a token
    or a job costs, which CPU seconds alone do not say. Also its network bytes in and out, and, given
    the bench's database, Postgres's committed transactions and rows written in it (pg_stat_database):
    what one Postgres and one Redis carry per token and per job, for sizing them (docs/scaling.md)."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(url)
    db = None
    if database is not None:
        from sqlalchemy import create_engine

        from ops import harness

        db = create_engine(harness.TEST_DB.rsplit("/", 1)[0] + "/postgres")

    def read() -> dict[str, int]:
        stats = client.info("commandstats")
        out = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
        net = client.info("stats")
        out["redis_bytes_in"], out["redis_bytes_out"] = net["total_net_input_bytes"], net["total_net_output_bytes"]
        if db is not None:
            from sqlalchemy import text

            with db.connect() as conn:
                row = conn.execute(
                    text(
                        "SELECT xact_commit + xact_rollback, tup_inserted + tup_updated + tup_deleted"
                        " FROM pg_stat_database WHERE datname = :d"
                    ),
                    {"d": database},
                ).one()
            out["pg_transactions"], out["pg_rows_written"] = int(row[0]), int(row[1])
        return out

    return read


def measured(
    cfg: BenchConfig,
    meters: dict[str, Meter],
    spy: tuple[dict[str, int], Path | None, str] = ({}, None, ""),
    calls: Calls | None = None,
) -> tuple[Summary, dict[str, float], dict[str, int]]:
    before, c0, n0 = {k: m() for k, m in meters.items()}, client_cpu(), calls() if calls else {}
    with profiled(*spy):
        s = bench_http(cfg)[0]
    after, c1, n1 = {k: m() for k, m in meters.items()}, client_cpu(), calls() if calls else {}
    cpu = {k: after[k] - before[k] for k in meters}
    cpu["client"] = c1 - c0
    served = {k: n1[k] - n0.get(k, 0) for k in n1 if k != "info" and n1[k] > n0.get(k, 0)}
    return s, cpu, served


def _per(served: dict[str, int], n: int, top: int = 6) -> dict[str, float]:
    commands = {k: v for k, v in served.items() if k not in TRAFFIC}
    return {k: v / n for k, v in sorted(commands.items(), key=lambda kv: -kv[1])[:top]}


def _traffic(served: dict[str, int], n: int) -> dict[str, float]:
    return {k: served[k] / n for k in TRAFFIC if k in served}


def _costs(cpu: dict[str, float], served: dict[str, int], n: int, ys: float, unit: str) -> dict:
    """What `n` tokens or jobs cost: each process's CPU ms, Spool's (all but the client's) in ms and in
    this sitting's yardstick units, Redis calls and traffic, each per `unit`."""
    spool_ms = 1000 * sum(v for k, v in cpu.items() if k != "client") / n
    return {
        f"cpu_ms_per_{unit}": {k: 1000 * v / n for k, v in cpu.items()},
        f"spool_cpu_ms_per_{unit}": spool_ms,
        "yardstick_ms": ys,
        f"spool_cpu_yu_per_{unit}": yardstick.in_units(spool_ms, ys),
        f"redis_calls_per_{unit}": _per(served, n),
        f"traffic_per_{unit}": _traffic(served, n),
    }


def run_levels(
    url: str,
    api_key: str | None,
    model: str,
    levels: list[int],
    a: argparse.Namespace,
    meters: dict[str, Meter],
    pids: dict[str, int] | None = None,
    label: str = "spool",
    calls: Calls | None = None,
) -> list[dict]:
    rows: list[dict] = []
    prof = Path(a.profile) if a.profile else None
    # This sitting's yardstick (ops/bench/yardstick.py), timed while the stack is idle: every CPU cost
    # below is also given in its units, which compare across sittings and machines.
    ys = yardstick.measure()
    for conc in levels:
        base = BenchConfig(
            url=url,
            api_key=api_key,
            model=model,
            concurrency=[conc],
            requests=conc * a.requests_per_stream,
            max_tokens=a.max_tokens,
            ignore_eos=True,
            stream=True,
        )
        eng = engine_alone(base)
        spool, cpu, served = measured(base, meters, (pids or {}, prof, f"{label}-c{conc}"), calls)
        toks = max(spool.output_tokens, 1)
        rows.append(
            {
                "kind": "stream",
                "concurrency": conc,
                "engine": eng.label,
                "engine_tok_s": eng.output_tok_s,
                "spool_tok_s": spool.output_tok_s,
                "ratio": spool.output_tok_s / eng.output_tok_s if eng.output_tok_s else None,
                "failed": spool.failed,
                "errors": spool.errors,
                "ttft_ms": {"engine": eng.ttft_ms, "spool": spool.ttft_ms},
                "itl_ms": {"engine": eng.itl_ms, "spool": spool.itl_ms},
                **_costs(cpu, served, toks, ys, "token"),
            }
        )
    if a.short_jobs:
        short = BenchConfig(
            url=url,
            api_key=api_key,
            model=model,
            concurrency=[levels[-1]],
            requests=a.short_jobs,
            max_tokens=1,
            stream=False,
        )
        s, cpu, served = measured(short, meters, (pids or {}, prof, f"{label}-short"), calls)
        jobs = max(s.requests - s.failed, 1)
        rows.append(
            {
                "kind": "short_json",
                "concurrency": levels[-1],
                "jobs_s": s.requests_s,
                "failed": s.failed,
                "errors": s.errors,
                **_costs(cpu, served, jobs, ys, "job"),
            }
        )
    return rows


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        tag = f"[{r['label']}] " if r.get("label") else ""
        if r["kind"] == "stream":
            t, i = r["ttft_ms"], r["itl_ms"]
            print(
                f"{tag}c={r['concurrency']:>4} spool {r['spool_tok_s']:8.0f} tok/s  engine {r['engine_tok_s']:8.0f}"
                f" ({r['engine']})  ratio {r['ratio'] or 0:.3f}  failed {r['failed']}\n"
                f"       TTFT p50/p99 spool {t['spool'].get('p50', 0):.1f}/{t['spool'].get('p99', 0):.1f}"
                f" engine {t['engine'].get('p50', 0):.1f}/{t['engine'].get('p99', 0):.1f} ms;"
                f" ITL p50/p99 spool {i['spool'].get('p50', 0):.2f}/{i['spool'].get('p99', 0):.2f}"
                f" engine {i['engine'].get('p50', 0):.2f}/{i['engine'].get('p99', 0):.2f} ms\n"
                f"       CPU ms/token: "
                + "  ".join(f"{k} {v:.3f}" for k, v in r["cpu_ms_per_token"].items())
                + f"  | Spool total {r['spool_cpu_ms_per_token']:.3f}"
                + f" = {r['spool_cpu_yu_per_token']:.2f} yu (yardstick {r['yardstick_ms']:.1f} ms)",
                flush=True,
            )
        else:
            print(
                f"{tag}short JSON jobs c={r['concurrency']}: {r['jobs_s']:.0f} jobs/s, failed {r['failed']}\n"
                "       CPU ms/job: "
                + "  ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_job"].items())
                + f"  | Spool total {r['spool_cpu_ms_per_job']:.2f}"
                + f" = {r['spool_cpu_yu_per_job']:.1f} yu (yardstick {r['yardstick_ms']:.1f} ms)",
                flush=True,
            )
        per = r.get("redis_calls_per_token") or r.get("redis_calls_per_job")
        if per:
            unit = "token" if "redis_calls_per_token" in r else "job"
            print(f"       Redis calls per {unit}: " + "  ".join(f"{k} {v:.3f}" for k, v in per.items()), flush=True)
        traffic = r.get("traffic_per_token") or r.get("traffic_per_job")
        if traffic:
            unit = "token" if "traffic_per_token" in r else "job"
            print(f"       traffic per {unit}: " + "  ".join(f"{k} {v:.2f}" for k, v in traffic.items()), flush=True)
        for e in r.get("errors") or []:
            print(f"       failure: {e}", flush=True)


def print_medians(rows: list[dict]) -> None:
    """Per checkout and level, the median over rounds of the figures the issue's targets name."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    print("\nmedians over rounds:")
    keys = sorted({(r["kind"], r["concurrency"]) for r in rows}, key=lambda k: (k[0] != "stream", k[1]))
    for kind, conc in keys:
        for label in labels:
            rs = [r for r in rows if r["label"] == label and r["kind"] == kind and r["concurrency"] == conc]
            if not rs:
                continue
            med = statistics.median
            if kind == "stream":
                print(
                    f"  c={conc:>4} {label:>8}: ratio {med(r['ratio'] or 0 for r in rs):.3f}"
                    f"  TTFT p50 {med(r['ttft_ms']['spool'].get('p50', 0) for r in rs):.0f}"
                    f" (engine {med(r['ttft_ms']['engine'].get('p50', 0) for r in rs):.0f}) ms"
                    f"  CPU ms/token {med(r['spool_cpu_ms_per_token'] for r in rs):.3f}"
                    f" = {med(r['spool_cpu_yu_per_token'] for r in rs):.2f} yu ("
                    + ", ".join(
                        f"{k} {med(r['cpu_ms_per_token'][k] for r in rs):.3f}" for k in rs[0]["cpu_ms_per_token"]
                    )
                    + ")"
                )
            else:
                print(
                    f"  short c={conc:>4} {label:>8}: {med(r['jobs_s'] for r in rs):.0f} jobs/s"
                    f"  CPU ms/job {med(r['spool_cpu_ms_per_job'] for r in rs):.2f}"
                    f" = {med(r['spool_cpu_yu_per_job'] for r in rs):.1f} yu ("
                    + ", ".join(f"{k} {med(r['cpu_ms_per_job'][k] for r in rs):.2f}" for k in rs[0]["cpu_ms_per_job"])
                    + ")"
                )


@contextlib.contextmanager
def private_redis() -> Iterator[tuple[str, int]]:
    """A redis-server of the bench's own (no persistence): its CPU is Spool's alone."""
    from ops.harness import free_port, wait_for

    port = free_port()
    work = tempfile.mkdtemp(prefix="spool-bench-redis-")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", work],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis as redis_lib

        wait_for(lambda: _pings(redis_lib, port), 20, "private redis-server")
        yield f"redis://127.0.0.1:{port}/10", proc.pid
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


def _pings(redis_lib, port: int) -> bool:
    try:
        return bool(redis_lib.Redis(port=port).ping())
    except redis_lib.RedisError:
        return False


@contextlib.contextmanager
def paced_stack(
    root: Path, levels: list[int], database: str, api_workers: int = 1
) -> Iterator[tuple[str, str, dict[str, Meter], dict[str, int], Calls]]:
    """API, dispatcher and a paced worker started from checkout `root` as the tests start them; yields
    (url, api key, CPU meters of every Spool process, pids of the Python ones, Redis's command counts).
    `api_workers` > 1: the API as that many processes (`spool api --workers N`)."""
    from ops import harness

    db_url = harness.TEST_DB.rsplit("/", 1)[0] + "/" + database
    env = {
        **PACED_ENV,
        **DEPLOYED_ENV,
        "SPOOL_WORKER_CONCURRENCY": str(max(levels) + 8),
        "SPOOL_LOG_FORMAT": "text",
        "PYTHONPATH": str(root),
    }
    logdir = Path(tempfile.mkdtemp(prefix="spool-bench-logs-"))
    with (
        private_redis() as (redis_url, redis_pid),
        harness.running_stack(logdir, db_url, redis_url, (), root, **env) as st,
    ):
        if api_workers > 1:
            st.procs["api"].terminate()
            st.procs["api"].wait(30)
            st.start("api", "api", "--workers", str(api_workers))
            harness.wait_for(st.ready, 60, "api health")
        meters = {
            "api": tree_meter(st.procs["api"].pid),
            "worker": tree_meter(st.procs["worker"].pid),
            "dispatcher": tree_meter(st.procs["dispatcher"].pid),
            "postgres": postgres_meter(database),
            "redis": tree_meter(redis_pid),
        }
        pids = {k: st.procs[k].pid for k in ("api", "worker", "dispatcher")}
        for name, pid in pids.items():  # `python -m` puts the cwd first on the path: that checkout's code runs
            cwd = os.readlink(f"/proc/{pid}/cwd")
            if Path(cwd) != root.resolve():
                raise RuntimeError(f"{name} runs from {cwd}, not {root}")
        yield st.base_url, st.keys["alpha"], meters, pids, redis_calls(redis_url, database)
    print(f"stack logs ({root}): {logdir}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stack", action="store_true", help="start a paced stack (or one per --roots) and measure it")
    ap.add_argument(
        "--roots", default=None, help="with --stack: label=checkout[@N API processes],... (default: this checkout, 1)"
    )
    ap.add_argument("--rounds", type=int, default=1, help="with --stack: rounds over the roots, interleaved")
    ap.add_argument("--database", default="spool_bench", help="with --stack: the database it drops and makes")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=os.environ.get("SPOOL_API_KEY"))
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--pids", help="without --stack: name=pid,... (api, worker, dispatcher, postgres, redis)")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--requests-per-stream", type=int, default=2, help="requests per level = this x concurrency")
    ap.add_argument("--short-jobs", type=int, default=800, help="max_tokens 1 JSON jobs at the last concurrency")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--profile", help="py-spy collapsed stacks of api, worker, dispatcher per run, in this folder")
    a = ap.parse_args(argv)
    levels = [int(c) for c in a.concurrency.split(",")]
    rows: list[dict] = []
    if a.stack:
        os.environ.update(PACED_ENV)  # the engine-alone runs (a subprocess) model the same GPU
        roots: dict[str, tuple[Path, int]] = {"spool": (ROOT, 1)}
        if a.roots:  # label=DIR or label=DIR@N (N API processes)
            roots = {}
            for label, spec in (x.split("=", 1) for x in a.roots.split(",")):
                where, _, n = spec.partition("@")
                roots[label] = (Path(where).resolve(), int(n or 1))
        for rnd in range(a.rounds):
            for label, (root, api_workers) in roots.items():
                print(f"-- round {rnd + 1}, {label} ({root}, {api_workers} API process(es))", flush=True)
                with paced_stack(root, levels, a.database, api_workers) as (url, key, meters, pids, calls):
                    got = run_levels(url, key, a.model, levels, a, meters, pids, f"{label}-r{rnd + 1}", calls)
                for r in got:
                    r |= {"label": label, "round": rnd + 1, "root": str(root)}
                print_rows(got)
                rows += got
        print_medians(rows)
    else:
        if not a.pids:
            ap.error("--pids is required without --stack")
        pids = {k: int(v) for k, v in (x.split("=") for x in a.pids.split(","))}
        meters = {k: tree_meter(v) for k, v in pids.items()}
        py = {k: v for k, v in pids.items() if k in ("api", "worker", "dispatcher")}
        rows = run_levels(a.url, a.api_key, a.model, levels, a, meters, py)
        print_rows(rows)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
