"""What an idle Spool costs: a test stack (api, dispatcher, worker, as ops/harness.py starts them) with
nothing to do, and each process's CPU seconds a minute over a window, with Postgres's for its database.

    python -m ops.bench.idle [--seconds 30] [--interval 0.5]

`--interval` is SPOOL_DISPATCHER_INTERVAL_S (the tests run 0.5, deployments 1 by default). Uses the
test shard's database and Redis db (SPOOL_TEST_SHARD, ops/harness.py): run it with no suite running."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from ops.bench.paced import postgres_meter, tree_cpu
from ops.harness import TEST_DB, TEST_REDIS, running_stack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0, help="the measured window")
    ap.add_argument("--interval", default="0.5", help="SPOOL_DISPATCHER_INTERVAL_S")
    args = ap.parse_args()
    with running_stack(Path(tempfile.mkdtemp(prefix="spool-idle-")), TEST_DB, TEST_REDIS,
                       SPOOL_DISPATCHER_INTERVAL_S=args.interval) as st:  # fmt: skip
        time.sleep(5)  # past the start: the first passes, the worker's warm-up
        roots = {name: p.pid for name, p in st.procs.items() if name in ("api", "dispatcher", "worker")}
        pg = postgres_meter(TEST_DB.rsplit("/", 1)[-1])
        before, pg0, t0 = tree_cpu(roots), pg(), time.monotonic()
        time.sleep(args.seconds)
        after, pg1, dt = tree_cpu(roots), pg(), time.monotonic() - t0
    per_min = {name: round((after[name] - before[name]) / dt * 60, 2) for name in roots}
    per_min["postgres"] = round((pg1 - pg0) / dt * 60, 2)
    print(f"idle CPU seconds a minute (dispatcher interval {args.interval} s, {dt:.0f} s window): {per_min}")


if __name__ == "__main__":
    main()
