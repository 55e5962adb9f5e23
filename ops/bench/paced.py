"""The GPU-front table in one command: Spool in front of the paced engine vs the paced engine alone.

    python -m ops.bench.paced --url URL --api-key KEY --pids api=P,worker=P,dispatcher=P,postgres=P,redis=P

For each concurrency (streamed, `ignore_eos`), interleaved: the paced engine alone (in-process,
`ops.bench.engine`, same settings as the worker: run this with the stack's SPOOL_PACED_* and
SPOOL_MAX_BATCH), then the same prompts through Spool, with the CPU of every named process tree
(`/proc/PID/stat` utime+stime of the process and its descendants: uvicorn's and Postgres's
children count) and of this client read before and after the Spool run. Then short jobs
(`max_tokens` 1, plain JSON) at the last concurrency. Prints one table; `--json` keeps it.
The machine should be otherwise idle: other processes' CPU is not separated from Postgres's.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ops.bench.client import BenchConfig, Summary, bench_engine, bench_http

ROOT = Path(__file__).resolve().parents[2]
TICK = os.sysconf("SC_CLK_TCK")


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


def client_cpu() -> float:
    t = os.times()
    return t.user + t.system


def engine_alone(cfg: BenchConfig) -> Summary:
    return bench_engine(cfg)[0]


def measured(cfg: BenchConfig, pids: dict[str, int]) -> tuple[Summary, dict[str, float]]:
    before, c0 = tree_cpu(pids), client_cpu()
    s = bench_http(cfg)[0]
    after, c1 = tree_cpu(pids), client_cpu()
    cpu = {k: after[k] - before[k] for k in pids}
    cpu["client"] = c1 - c0
    return s, cpu


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=os.environ.get("SPOOL_API_KEY"))
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--pids", required=True, help="name=pid,... (api, worker, dispatcher, postgres, redis)")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--requests-per-stream", type=int, default=2, help="requests per level = this x concurrency")
    ap.add_argument("--short-jobs", type=int, default=800, help="max_tokens 1 JSON jobs at the last concurrency")
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args(argv)
    pids = {k: int(v) for k, v in (x.split("=") for x in a.pids.split(","))}
    rows: list[dict] = []
    for conc in [int(c) for c in a.concurrency.split(",")]:
        base = BenchConfig(
            url=a.url,
            api_key=a.api_key,
            model=a.model,
            concurrency=[conc],
            requests=conc * a.requests_per_stream,
            max_tokens=a.max_tokens,
            ignore_eos=True,
            stream=True,
        )
        eng = engine_alone(base)
        spool, cpu = measured(base, pids)
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
                "ttft_ms": {"engine": eng.ttft_ms, "spool": spool.ttft_ms},
                "itl_ms": {"engine": eng.itl_ms, "spool": spool.itl_ms},
                "cpu_ms_per_token": {k: 1000 * v / toks for k, v in cpu.items()},
                "spool_cpu_ms_per_token": 1000 * sum(v for k, v in cpu.items() if k != "client") / toks,
            }
        )
    short = BenchConfig(
        url=a.url,
        api_key=a.api_key,
        model=a.model,
        concurrency=[conc],
        requests=a.short_jobs,
        max_tokens=1,
        stream=False,
    )
    s, cpu = measured(short, pids)
    jobs = max(s.requests - s.failed, 1)
    rows.append(
        {
            "kind": "short_json",
            "concurrency": conc,
            "jobs_s": s.requests_s,
            "failed": s.failed,
            "cpu_ms_per_job": {k: 1000 * v / jobs for k, v in cpu.items()},
            "spool_cpu_ms_per_job": 1000 * sum(v for k, v in cpu.items() if k != "client") / jobs,
        }
    )
    for r in rows:
        if r["kind"] == "stream":
            t, i = r["ttft_ms"], r["itl_ms"]
            print(
                f"c={r['concurrency']:>4} spool {r['spool_tok_s']:8.0f} tok/s  engine {r['engine_tok_s']:8.0f}"
                f" ({r['engine']})  ratio {r['ratio'] or 0:.3f}  failed {r['failed']}\n"
                f"       TTFT p50/p99 spool {t['spool'].get('p50', 0):.1f}/{t['spool'].get('p99', 0):.1f}"
                f" engine {t['engine'].get('p50', 0):.1f}/{t['engine'].get('p99', 0):.1f} ms;"
                f" ITL p50/p99 spool {i['spool'].get('p50', 0):.2f}/{i['spool'].get('p99', 0):.2f}"
                f" engine {i['engine'].get('p50', 0):.2f}/{i['engine'].get('p99', 0):.2f} ms\n"
                f"       CPU ms/token: "
                + "  ".join(f"{k} {v:.3f}" for k, v in r["cpu_ms_per_token"].items())
                + f"  | Spool total {r['spool_cpu_ms_per_token']:.3f}"
            )
        else:
            print(
                f"short JSON jobs c={r['concurrency']}: {r['jobs_s']:.0f} jobs/s, failed {r['failed']}\n"
                "       CPU ms/job: "
                + "  ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_job"].items())
                + f"  | Spool total {r['spool_cpu_ms_per_job']:.2f}"
            )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
