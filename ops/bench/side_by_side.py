"""Spool's whole path vs its engine alone vs another server (llama.cpp's `llama-server`), on the real
model: `python -m ops.bench.side_by_side --compare-url http://127.0.0.1:8080 --out DIR`.

Starts its own stack as the tests do (API, dispatcher, CPU worker; database `spool_cmp`, a private
redis-server) with the deployed timings and defaults (`SPOOL_N_CTX=2048`, `SPOOL_MAX_BATCH=16`), then
runs `spool bench --mode http,engine --compare-url ...` once per temperature (greedy, then 0.8), 32
requests of 128 tokens per concurrency with `ignore_eos`; every server gets the same explicit
sampling parameters. The JSON of each run goes to DIR/side-by-side-<temperature>.json.
The other server is started by hand, e.g. `llama-server -m $GGUF -np 16 -c 32768 -t 2 --port 8080`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from ops.bench.paced import DEPLOYED_ENV, ROOT, private_redis


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare-url", required=True)
    ap.add_argument("--compare-label", default="llama-server")
    ap.add_argument("--out", default=".")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--temperatures", default="0,0.8")
    a = ap.parse_args(argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)  # before the runs: a missing folder lost a whole run's JSON
    from ops import harness

    db = harness.TEST_DB.rsplit("/", 1)[0] + "/spool_cmp"
    env = {**DEPLOYED_ENV, "SPOOL_N_CTX": "2048", "SPOOL_LOG_FORMAT": "text"}
    logs = Path(tempfile.mkdtemp(prefix="spool-cmp-"))
    with private_redis() as (redis_url, _), harness.running_stack(logs, db, redis_url, (), ROOT, **env) as st:
        for temp in a.temperatures.split(","):
            cmd = [
                *[sys.executable, "-m", "core.cli", "bench", "--url", st.base_url, "--mode", "http,engine"],
                *["--compare-url", a.compare_url, "--compare-label", a.compare_label],
                *["--concurrency", a.concurrency, "--requests", "32", "--max-tokens", "128"],
                *["--temperature", temp, "--json", str(Path(a.out) / f"side-by-side-{temp}.json")],
            ]
            subprocess.run(cmd, env={**st.env, "SPOOL_API_KEY": st.keys["alpha"]}, cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
