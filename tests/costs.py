"""A pytest plugin: what each test module costs, in wall seconds and in CPU seconds of this pytest
process and every process under it (the stacks it starts, their workers and engines). With
SPOOL_COSTS=FILE each module appends a line `module wall cpu shard start end` to FILE (shard: the
pytest process's SPOOL_COSTS_SHARD, else its SPOOL_TEST_SHARD; start, end: epoch seconds).
`python -m tests.costs FILE` prints them, most CPU first, then when each shard began and ended its
last module (a shard idle at the end is time the order in tests/conftest.COSTS could win back).
ops/test.sh prints that table after every run: the suite is CPU-bound on 2 cores, so CPU seconds
(not wall, which the other shards stretch) say where its time goes.

A process that leaves the tree (a daemon that double-forks, as `pg_ctl start` does) is not counted."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _tree_cpu(root: int) -> float:
    """CPU seconds of `root` and its live descendants, with the children each has reaped."""
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "(comm)": state, ppid, ...
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        used[pid] = sum(int(f) for f in fields[11:15]) / _TICK  # utime stime cutime cstime
    total = 0.0
    for pid, cpu in used.items():
        p = pid
        while p not in (0, 1) and p != root:
            p = parents.get(p, 0)
        if p == root:
            total += cpu
    return total


class _Costs:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.module: str | None = None
        self.wall = self.cpu = self.start = 0.0
        self.shard = os.environ.get("SPOOL_COSTS_SHARD") or os.environ.get("SPOOL_TEST_SHARD") or "0"

    def _close(self) -> None:
        if self.module is not None:
            wall, cpu = time.monotonic() - self.wall, _tree_cpu(os.getpid()) - self.cpu
            with self.out.open("a") as f:
                f.write(f"{self.module} {wall:.1f} {cpu:.1f} {self.shard} {self.start:.1f} {time.time():.1f}\n")
        self.module = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        module = item.nodeid.split("::", 1)[0]
        if module != self.module:
            self._close()
            self.module, self.wall, self.cpu = module, time.monotonic(), _tree_cpu(os.getpid())
            self.start = time.time()

    def pytest_sessionfinish(self) -> None:
        self._close()  # the session's own teardown (its stack's) is not any module's


def pytest_configure(config: pytest.Config) -> None:
    out = os.environ.get("SPOOL_COSTS")
    if out:
        config.pluginmanager.register(_Costs(Path(out)), "spool-costs")


def main(path: str, most: int = 25) -> None:
    rows: dict[str, list[float]] = {}
    shards: dict[str, list[float]] = {}  # shard -> [first start, last end, modules]
    for line in Path(path).read_text().splitlines():
        module, wall, cpu, *when = line.split()
        acc = rows.setdefault(module, [0.0, 0.0])
        acc[0] += float(wall)
        acc[1] += float(cpu)
        if when:
            shard, start, end = when[0], float(when[1]), float(when[2])
            span = shards.setdefault(shard, [start, end, 0])
            span[0], span[1], span[2] = min(span[0], start), max(span[1], end), span[2] + 1
    total_wall, total_cpu = (sum(r[i] for r in rows.values()) for i in (0, 1))
    print(f"{'module':60} {'wall s':>8} {'cpu s':>8}")
    for module, (wall, cpu) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:most]:
        print(f"{module:60} {wall:8.1f} {cpu:8.1f}")
    print(f"{f'all {len(rows)} modules':60} {total_wall:8.1f} {total_cpu:8.1f}")
    if shards:
        t0 = min(span[0] for span in shards.values())
        print("shard                   modules  first began  last ended  (seconds after the first module began)")
        for shard, (start, end, n) in sorted(shards.items()):
            print(f"{shard:23} {n:8d} {start - t0:12.1f} {end - t0:11.1f}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
