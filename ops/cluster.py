"""The cluster harness (issue 39): Spool on six "hosts" of one machine, behind HAProxy, with
partitions and host deaths under the fault harness's load, audited by its checker.

    python -m ops.cluster                                  # every scenario
    python -m ops.cluster --only worker-redis,api-death    # some (CI's short run: tests/e2e/test_cluster.py)
    python -m ops.cluster --json out.json                  # the report as JSON too

Each host is a Linux network namespace made here, joined to a bridge of its own on 10.213.8.0/24
(root; nothing is routed beyond it). The root namespace (.1) runs HAProxy and the clients, which talk
only to HAProxy on 127.0.0.1:

    data   .10  Postgres and the dispatcher         api1, api2    .21, .22  `spool api`
    cache  .11  Redis (tcp-keepalive 10, as compose) work1, work2 .31, .32  `spool worker` (one thread each)

Faults, one after another while the load runs (`ops/faults.load_and_audit`: streamed, non-streamed,
async, keyless, chat, Responses and batch requests, the `openai` SDK among them):

- `worker-redis`, `worker-postgres`, `worker-isolated`: a worker host cut from Redis, from Postgres,
  or from everything, for PARTITION_S (longer than the lease and the dispatcher's re-send window),
  its processes running all along; then healed. A cut is a blackhole route on both hosts (no FIN,
  no RST, no ICMP: the peer simply stops answering).
- `api-death`: an API host's link cut while streams pass through it, then its processes SIGKILLed;
  clients resume through the balancer on the other host with `Last-Event-ID`. Brought back later.
- `worker-death`: every process of a worker host SIGKILLed while it generates; restarted later.

Not here, and why: `tc netem` (delay and loss) needs the kernel's netem qdisc, which this machine's
kernel lacks (the harness says so when asked for `lossy-link`); a clock 30 s off on one host needs a
clock of that host's own, and a network namespace has none (a time namespace offsets only the
monotonic clocks; LD_PRELOAD fakes would test the fake).

The report adds to the fault harness's: `stale_attempts_refused` (attempts that found themselves
superseded and stopped, from the workers' logs) and, per scenario, how long the streams were silent.
Namespaces, links and processes are removed at exit and on SIGINT/SIGTERM; a run that was killed
outright leaves names starting `spc-`, which the next run (or `--clean`) removes first. Needs root,
iproute2, HAProxy, redis-server and PostgreSQL's server binaries.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

from ops.faults import MODEL, TIMINGS, OwnPostgres, Report, finish, load_and_audit, wait_for
from ops.harness import ROOT, SPOOL, free_port

NET = "10.213.8"
PREFIX = "spc"  # every namespace, link and bridge made here starts with it (leftovers are found by it)
BRIDGE = f"{PREFIX}-br"
HOSTS = {"data": 10, "cache": 11, "api1": 21, "api2": 22, "work1": 31, "work2": 32}
API_PORT, REDIS_PORT = 8000, 6379
# Longer than SPOOL_LEASE_S (3), the dispatcher's re-send (SPOOL_DISPATCH_TIMEOUT_S, 8) and the time
# after which the dispatcher gives a worker Redis no longer hears away (SPOOL_WORKER_UNHEARD_S, 15).
PARTITION_S = 30.0
UNHEARD_S = 15.0
DOWN_S = 8.0  # how long a dead host stays dead before it is started again
GAP_S = 4.0  # the load alone, before the first fault and after each
SCENARIOS = ("worker-redis", "worker-postgres", "worker-isolated", "api-death", "worker-death")
SHORT = ("worker-redis", "api-death")  # CI's run


def addr(host: str) -> str:
    return f"{NET}.{HOSTS[host]}"


def ns(host: str) -> str:
    return f"{PREFIX}-{host}"


def _ip(*args: str, check: bool = True) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def clean() -> None:
    """Everything a run made, even one killed outright: its namespaces' processes, namespaces, links."""
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(f"{PREFIX}-"):
            continue
        for pid in _ip("netns", "pids", name, check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", check=False).splitlines():
        parts = line.split(": ")
        if len(parts) > 1 and parts[1].split("@")[0].startswith(f"{PREFIX}-"):
            _ip("link", "del", parts[1].split("@")[0], check=False)


class Net:
    """The hosts and their links."""

    def up(self) -> None:
        clean()
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{NET}.1/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for host in HOSTS:
            outer, inner = f"{PREFIX}-{host}", f"{PREFIX}-{host}-i"
            _ip("netns", "add", ns(host))
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns(host))
            _ip("-n", ns(host), "link", "set", inner, "name", "eth0")
            _ip("link", "set", outer, "master", BRIDGE)
            _ip("link", "set", outer, "up")
            _ip("-n", ns(host), "addr", "add", f"{addr(host)}/24", "dev", "eth0")
            _ip("-n", ns(host), "link", "set", "eth0", "up")
            _ip("-n", ns(host), "link", "set", "lo", "up")

    def cut(self, a: str, b: str) -> None:
        """No packet between hosts a and b, either way, until `heal`."""
        _ip("-n", ns(a), "route", "add", "blackhole", f"{addr(b)}/32")
        _ip("-n", ns(b), "route", "add", "blackhole", f"{addr(a)}/32")

    def heal(self, a: str, b: str) -> None:
        _ip("-n", ns(a), "route", "del", "blackhole", f"{addr(b)}/32", check=False)
        _ip("-n", ns(b), "route", "del", "blackhole", f"{addr(a)}/32", check=False)

    def link(self, host: str, up: bool) -> None:
        _ip("-n", ns(host), "link", "set", "eth0", "up" if up else "down")


@dataclass
class Cluster:
    workdir: Path
    net: Net = field(default_factory=Net)
    procs: dict[str, tuple[str, subprocess.Popen]] = field(default_factory=dict)  # name -> (host, process)
    pg: OwnPostgres | None = None
    lb_port: int = 0
    key: str = ""
    unheard_s: float = UNHEARD_S

    @property
    def db_url(self) -> str:
        assert self.pg is not None
        return f"postgresql+psycopg://postgres@{addr('data')}:{self.pg.port}/spool"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.lb_port}"

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "SPOOL_DATABASE_URL": self.db_url,
            "SPOOL_REDIS_URL": f"redis://{addr('cache')}:{REDIS_PORT}/0",
            "SPOOL_API_HOST": "0.0.0.0",
            "SPOOL_API_PORT": str(API_PORT),
            **TIMINGS,
            "SPOOL_WORKER_UNHEARD_S": str(self.unheard_s),
            **extra,
        }

    def start(self, name: str, host: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # the process owns it
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns(host), *argv],
            env=env or self.env(),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs[name] = (host, proc)
        return proc

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def kill_host(self, host: str) -> list[str]:
        """SIGKILL every process this harness started on `host` (a host that loses power)."""
        names = [n for n, (h, _) in self.procs.items() if h == host]
        for n in names:
            _, proc = self.procs.pop(n)
            proc.kill()
            proc.wait(10)
        return names

    def start_api(self, host: str) -> None:
        self.start(host, host, [*SPOOL, "api"])

    def start_worker(self, host: str, **settings: str) -> None:
        before = self.log(host).count("ready.") if (self.workdir / f"{host}.log").exists() else 0
        self.start(host, host, [*SPOOL, "worker"], self.env(SPOOL_N_THREADS="1", **settings))
        wait_for(lambda: self.log(host).count("ready.") > before, 180, f"{host}'s worker")

    def stop_host(self, host: str) -> list[str]:
        """SIGTERM every process this harness started on `host` (a scale-down, a rolling update): each
        ends as its supervisor would have it end (a worker finishes its jobs and leaves the live set)."""
        names = [n for n, (h, _) in self.procs.items() if h == host]
        for n in names:
            _, proc = self.procs.pop(n)
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return names

    def up(self) -> None:
        self.net.up()
        self.pg = OwnPostgres(self.workdir)
        self.pg.listen = f"127.0.0.1,{addr('data')}"
        self.pg.wrap = ["ip", "netns", "exec", ns("data")]
        self.pg.trusted = [f"{NET}.0/24"]
        self.pg.init()
        self.start(
            "redis",
            "cache",
            [
                *("redis-server", "--port", str(REDIS_PORT), "--bind", addr("cache"), "--save", ""),
                *("--appendonly", "no", "--tcp-keepalive", "10", "--protected-mode", "no", "--dir", str(self.workdir)),
            ],
        )
        env = self.env()
        for argv in (["migrate"], ["tenant", "create", "cluster"], ["key", "create", "--tenant", "cluster"]):
            made = subprocess.run([*SPOOL, *argv], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
            if made.returncode != 0:
                raise RuntimeError(f"spool {' '.join(argv)}: {made.stderr[-2000:]}")
        self.key = made.stdout.strip().splitlines()[-1]
        self.start("dispatcher", "data", [*SPOOL, "dispatcher"])
        for host in ("api1", "api2"):
            self.start_api(host)
        for host in ("work1", "work2"):
            self.start_worker(host)
        self.lb_port = free_port()
        cfg = self.workdir / "haproxy.cfg"
        apis = {h: f"{addr(h)}:{API_PORT}" for h in ("api1", "api2")}
        cfg.write_text(haproxy_config(f"127.0.0.1:{self.lb_port}", apis))
        log = open(self.workdir / "haproxy.log", "ab")
        self.procs["haproxy"] = ("root", subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=log, stderr=log))
        wait_for(self._ready, 60, "the cluster ready through the balancer")

    def _ready(self) -> bool:
        r = httpx.get(self.base_url + "/ready", timeout=3)
        return r.status_code == 200 and r.json()["live_workers"].get(MODEL) == 2

    def down(self) -> None:
        for _, (_, proc) in list(self.procs.items()):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        self.procs.clear()
        if self.pg is not None:
            self.pg.stop("immediate")
            self.pg.remove()
        clean()


@contextmanager
def running(workdir: Path, **kw: float) -> Iterator[Cluster]:
    """A cluster up in `workdir` for the block, taken down after it however it ends (SIGTERM included:
    raised as KeyboardInterrupt, so namespaces, links and processes still go)."""

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, stop)
    c = Cluster(workdir, **kw)  # type: ignore[arg-type]
    try:
        c.up()
        yield c
    finally:
        c.down()
        signal.signal(signal.SIGTERM, old)


def missing_tools() -> str | None:
    """Why the harness cannot run here (the tests skip with it), or None."""
    import shutil

    if (
        os.geteuid() != 0
        or shutil.which("ip") is None
        or shutil.which("haproxy") is None
        or shutil.which("redis-server") is None
        or not list(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    ):
        return "needs root, iproute2, HAProxy (ops/test-tools.sh), redis-server and PostgreSQL's server binaries"
    return None


def haproxy_config(bind: str, servers: dict[str, str]) -> str:
    """HAProxy in front of Spool's API hosts (the harness's, and ops/haproxy.example.cfg, which a unit
    test holds to this). Round robin, each host checked every second on /health; two misses and it is
    out, its open streams cut so their clients resume on another host at once (`Last-Event-ID`).
    /ready is not the check: its "no live worker" holds for every API host at once, and taking them
    all out would refuse the async jobs and batches Spool queues meanwhile. A POST that got no answer
    is retried on another host only when it carries an Idempotency-Key: a keyless one could run twice."""
    lines = "\n".join(f"  server {name} {where} check" for name, where in servers.items())
    return f"""global
  maxconn 4000

defaults
  mode http
  timeout connect 2s
  # streams stay open as long as a completion runs
  timeout client 600s
  timeout server 600s
  timeout http-request 30s
  retries 3
  option redispatch
  retry-on conn-failure empty-response response-timeout

frontend spool
  bind {bind}
  http-request disable-l7-retry if METH_POST !{{ req.hdr(idempotency-key) -m found }}
  default_backend apis

backend apis
  balance roundrobin
  option httpchk GET /health
  http-check expect status 200
  default-server inter 1s fall 2 rise 2 on-marked-down shutdown-sessions
{lines}
"""


# -- the scenarios -------------------------------------------------------------------------------------
@dataclass
class ClusterReport(Report):
    stale_attempts_refused: int = 0
    scenarios: dict[str, dict] = field(default_factory=dict)


def _on_host(c: Cluster, host: str) -> Callable[[], list[tuple[str, int]]]:
    """The jobs (id, attempt) `host`'s worker is running right now (a job's `worker` is `hostname:pid`)."""
    db = create_engine(c.db_url, pool_pre_ping=True)

    def held() -> list[tuple[str, int]]:
        pid = c.procs[host][1].pid
        try:
            with db.connect() as conn:
                q = text("SELECT id, attempt FROM jobs WHERE state = 'running' AND worker = :w")
                return [(r.id, r.attempt) for r in conn.execute(q, {"w": f"{socket.gethostname()}:{pid}"})]
        finally:
            db.dispose()

    return held


def _fate(c: Cluster, held: list[tuple[str, int]], since: float) -> dict:
    """What became of the jobs a cut or dead worker held: how many another attempt took over, and how
    long after the fault the last of them ended (seconds, from the jobs' own rows)."""
    if not held:
        return {"held": 0}
    db = create_engine(c.db_url, pool_pre_ping=True)
    deadline = time.monotonic() + 120
    q = text(
        "SELECT id, attempt, extract(epoch from started_at) AS s, extract(epoch from finished_at) AS f"
        " FROM jobs WHERE id = ANY(:ids)"
    )
    while True:
        with db.connect() as conn:
            rows = conn.execute(q, {"ids": [i for i, _ in held]}).all()
        if all(r.f is not None for r in rows) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    db.dispose()
    # A job that ended in the instant between the look and the fault was not held by the fault.
    rows = [r for r in rows if r.f is None or float(r.f) > since]
    first = dict(held)
    ended = [float(r.f) for r in rows if r.f is not None]
    moved = [r for r in rows if r.attempt > first[r.id]]
    return {
        "held": len(rows),
        "taken_over": len(moved),
        # when the last of them was claimed again (its new attempt started) and when the last ended
        "last_resumed_s_after_fault": round(max(float(r.s) for r in moved) - since, 1) if moved else None,
        "last_ended_s_after_fault": round(max(ended) - since, 1) if ended else None,
    }


@contextmanager
def _timed(report: ClusterReport, name: str) -> Iterator[dict]:
    row: dict = {"began_s": round(time.monotonic() - _T0, 1)}
    report.scenarios[name] = row
    print(f"[{time.strftime('%H:%M:%S')}] scenario: {name}", flush=True)
    yield row
    row["lasted_s"] = round(time.monotonic() - _T0 - row["began_s"], 1)


_T0 = time.monotonic()


def _scenario(c: Cluster, name: str, report: ClusterReport, partition_s: float, down_s: float, gap_s: float) -> None:
    running = _on_host(c, "work1")
    with _timed(report, name) as row:
        if name in ("worker-redis", "worker-postgres", "worker-isolated"):
            try:
                held = wait_for(running, 30, "a job running")
            except TimeoutError:
                held, row["problem"] = [], "no job was running when the partition began"
            peers = {"worker-redis": ["cache"], "worker-postgres": ["data"], "worker-isolated": ["cache", "data"]}[name]
            since = time.time()
            for p in peers:
                c.net.cut("work1", p)
            row["cut_from"] = peers
            time.sleep(partition_s)
            for p in peers:
                c.net.heal("work1", p)
            row |= _fate(c, held, since)
        elif name == "api-death":
            time.sleep(2)  # streams under way through both API hosts
            c.net.link("api1", False)
            time.sleep(1)
            row["killed"] = c.kill_host("api1")
            time.sleep(down_s)
            c.net.link("api1", True)
            c.start_api("api1")
        elif name == "worker-death":
            try:
                held = wait_for(running, 30, "a job running")
            except TimeoutError:
                held, row["problem"] = [], "no job was running when the host died"
            since = time.time()
            row["killed"] = c.kill_host("work1")
            time.sleep(down_s)
            c.start_worker("work1")
            row |= _fate(c, held, since)
        else:
            raise ValueError(name)
    time.sleep(gap_s)  # the load goes on between faults


def run(
    scenarios: tuple[str, ...],
    workdir: Path | None = None,
    seed: int = 7,
    partition_s: float = PARTITION_S,
    down_s: float = DOWN_S,
    gap_s: float = GAP_S,
    unheard_s: float = UNHEARD_S,
) -> ClusterReport:
    """`scenarios` one after another under the load, then the audit. CI's short run passes shorter
    `partition_s`, `down_s` and `gap_s` (and a dispatcher that judges a silent worker sooner,
    `unheard_s`): the load keeps both worker cores busy the whole time."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="spool-cluster-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {workdir}", flush=True)
    report = ClusterReport()
    started = time.monotonic()
    with running(workdir, unheard_s=unheard_s) as c:

        def inject() -> None:
            time.sleep(gap_s)
            for name in scenarios:
                _scenario(c, name, report, partition_s, down_s, gap_s)
                report.faults.append(name)

        history = workdir / "history.jsonl"
        load_and_audit(c.base_url, c.key, c.db_url, random.Random(seed), True, report, inject, history)
        logs = "".join(c.log(n) for n in ("work1", "work2") if (workdir / f"{n}.log").exists())
        # An attempt told it no longer owns its job: by the lease's compare-and-set, or the stream's fence.
        report.stale_attempts_refused = logs.count("lost its lease") + logs.count("was superseded")
    report.seconds = round(time.monotonic() - started, 1)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(SCENARIOS)}")
    ap.add_argument("--short", action="store_true", help=f"CI's run: {', '.join(SHORT)}")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    ap.add_argument("--clean", action="store_true", help="only remove what an interrupted run left")
    ap.add_argument("--partition-s", type=float, default=PARTITION_S, help="how long a worker host stays cut")
    args = ap.parse_args()
    if args.clean:
        clean()
        return
    chosen = tuple(args.only.split(",")) if args.only else SHORT if args.short else SCENARIOS
    if "lossy-link" in chosen:
        raise SystemExit("lossy-link: this kernel has no netem qdisc (`tc qdisc add ... netem` is refused)")
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios: {sorted(unknown)}")
    finish(run(chosen, args.workdir, partition_s=args.partition_s), args.json)


if __name__ == "__main__":
    main()
