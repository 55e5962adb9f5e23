"""The GPU half of the proof kit: `bash ops/gpu_proof.sh gpu` (python -m ops.gpu_proof.run).

Runs the plan's steps in order, each in a process group of its own killed at its time box, so that
the whole ends before the budget (`BUDGET_S`) with whatever it reached. A step whose prerequisite did
not pass is recorded as skipped with the reason; independent steps still run. After every step the
report is written again ($OUT/gpu_proof_report.json and .md), so a run cut short still leaves one;
every step's output goes to $OUT/gpu_proof.log. Exits 1 unless every step passed.

exllamav3's build starts beside exllamav2's at the lowest CPU priority: exllamav2's gets the cores
first, and exllamav3's goes on compiling while exllamav2 is tested and measured on the GPU.

Environment: OUT (default out/gpu_proof), SPOOL_GPU_KIT (default gpu_kit), SPOOL_GPU_PROOF_WORK
(default /tmp/gpu_proof), SPOOL_GPU_PROOF_DRY=1 (steps stub what needs CUDA: steps.py),
SPOOL_GPU_PROOF_BUDGET_S, SPOOL_GPU_PROOF_BOXES ("step=seconds,..."), and for the dry run's tests
SPOOL_GPU_PROOF_FAIL ("step" fails, "step:hang" outlives its box). Stdlib only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ops.gpu_proof import BUDGET_S, KIT

ROOT = Path(__file__).resolve().parents[2]
RESERVE_S = 8.0  # kept back from every box for the last report and log
MIN_START_S = 5.0  # a step is not started with less than this left
TAIL_CHARS = 3000
LOG_CHARS = 1_000_000  # of each step's output in the log: 13 steps stay under the 16 MiB a returned file may take
CONCURRENCY = (1, 16, 64)


@dataclass
class Step:
    name: str
    argv: list[str]
    box_s: float
    needs: tuple[str, ...] = ()
    background: bool = False  # started, then joined by the first step that needs it
    ends_before_s: float = 0.0  # must end this long before the deadline (room for what follows)
    nice: bool = False


@dataclass
class Record:
    name: str
    outcome: str = "pending"  # passed | failed | timeout | skipped | running
    needs: list[str] = field(default_factory=list)
    box_s: float = 0.0
    started_s: float | None = None  # since the run's start
    wall_s: float | None = None
    rc: int | None = None
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    log_tail: str = ""


def plan(py: str) -> list[Step]:
    def s(*args: str) -> list[str]:
        return [py, "-m", "ops.gpu_proof.steps", *args]

    steps = [
        Step("probe", s("probe"), 45),
        Step("install", s("install"), 90),
        Step("model", s("model"), 60, needs=("install",)),
        Step(
            "exl3_build",
            s("build", "exllamav3"),
            480,
            ("probe", "install"),
            background=True,
            ends_before_s=120,
            nice=True,
        ),
        Step("exl2_build", s("build", "exllamav2"), 270, ("probe", "install")),
        Step("exl2_tests", s("tests", "exllamav2"), 100, ("exl2_build", "model")),
    ]
    steps += [
        Step(f"exl2_bench_c{c}", s("bench", "exllamav2", str(c)), 40, ("exl2_build", "model")) for c in CONCURRENCY
    ]
    steps.append(Step("exl3_tests", s("tests", "exllamav3"), 70, ("exl3_build", "model")))
    steps += [
        Step(f"exl3_bench_c{c}", s("bench", "exllamav3", str(c)), 30, ("exl3_build", "model")) for c in CONCURRENCY
    ]
    return steps


def _overrides(steps: list[Step], py: str) -> None:
    """The dry run's knobs: boxes, and a step made to fail or to hang (its command replaced; the
    runner's handling of it is the real one)."""
    boxes = dict(kv.split("=", 1) for kv in os.environ.get("SPOOL_GPU_PROOF_BOXES", "").split(",") if "=" in kv)
    faults = {
        f.partition(":")[0]: f.partition(":")[2] or "fail"
        for f in os.environ.get("SPOOL_GPU_PROOF_FAIL", "").split(",")
        if f
    }
    for st in steps:
        if st.name in boxes:
            st.box_s = float(boxes[st.name])
        if faults.get(st.name) == "fail":
            st.argv = [py, "-c", "import sys; print('injected failure (SPOOL_GPU_PROOF_FAIL)'); sys.exit(3)"]
        elif faults.get(st.name) == "hang":
            st.argv = [
                py,
                "-c",
                "import time; print('injected hang (SPOOL_GPU_PROOF_FAIL)', flush=True); time.sleep(3600)",
            ]


class Runner:
    def __init__(self, out: Path, work: Path, kit: Path, budget_s: float, dry: bool) -> None:
        self.out, self.work, self.kit, self.dry = out, work, kit, dry
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.budget_s = budget_s
        self.started = datetime.now(UTC).isoformat(timespec="seconds")
        self.records: dict[str, Record] = {}
        self.procs: dict[str, tuple[subprocess.Popen[bytes], float, Path]] = {}  # background: proc, end, log
        self.env = {"TORCH_EXTENSIONS_DIR": str(work / "torch_extensions")}  # the builds' cache, shared by all
        for d in (out, work / "logs", work / "results"):
            d.mkdir(parents=True, exist_ok=True)
        self.log = out / "gpu_proof.log"
        self.log.write_text(f"gpu proof kit, started {self.started}, budget {budget_s:.0f}s, dry={dry}\n")

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- one step ------------------------------------------------------------------------------
    def _environ(self, st: Step) -> dict[str, str]:
        env = {**os.environ, **self.env}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        env["GPU_PROOF_KIT"], env["GPU_PROOF_WORK"] = str(self.kit), str(self.work)
        env["GPU_PROOF_RESULT"] = str(self.work / "results" / f"{st.name}.json")
        env["SPOOL_GPU_PROOF_DRY"] = "1" if self.dry else "0"
        return env

    def _start(self, st: Step) -> tuple[subprocess.Popen[bytes], Path]:
        logf = self.work / "logs" / f"{st.name}.log"
        (self.work / "results" / f"{st.name}.json").unlink(missing_ok=True)
        argv = (["nice", "-n", "19"] if st.nice else []) + st.argv
        with logf.open("wb") as fh:
            proc = subprocess.Popen(
                argv, cwd=ROOT, env=self._environ(st), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
        return proc, logf

    def _wait(self, st: Step, proc: subprocess.Popen[bytes], end: float, logf: Path) -> None:
        rec = self.records[st.name]
        try:
            rc: int | None = proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = None
        rec.wall_s = round(self.now() - (rec.started_s or 0.0), 2)
        rec.rc = rc
        text = logf.read_text(errors="replace") if logf.exists() else ""
        rec.log_tail = text[-TAIL_CHARS:]
        result_file = self.work / "results" / f"{st.name}.json"
        if result_file.exists():
            try:
                rec.result = json.loads(result_file.read_text())
            except ValueError as exc:
                rec.result = {"ok": False, "why": f"unreadable result: {exc}"}
        if rc is None:
            rec.outcome, rec.reason = "timeout", f"killed at its time box ({rec.box_s:.0f}s)"
        elif rc != 0:
            rec.outcome, rec.reason = "failed", rec.result.get("why") or f"exit status {rc}"
        elif rec.result.get("ok") is False:
            rec.outcome, rec.reason = "failed", rec.result.get("why", "the step said it failed")
        else:
            rec.outcome = "passed"
        if st.name == "probe" and rec.result.get("arch"):
            # Every later process builds or loads the extensions with the same flags: torch rebuilds
            # on any change, and the libraries would otherwise pick their own (with +PTX).
            self.env["TORCH_CUDA_ARCH_LIST"] = str(rec.result["arch"])
        with self.log.open("a") as out:
            out.write(f"\n===== {st.name}: {rec.outcome} after {rec.wall_s}s (rc {rc}) {rec.reason}\n")
            out.write(text[-LOG_CHARS:])

    def run_step(self, st: Step) -> None:
        rec = self.records.setdefault(st.name, Record(st.name, needs=list(st.needs)))
        for dep in st.needs:
            if dep in self.procs:
                self.join(dep)
        missing = [d for d in st.needs if self.records.get(d, Record(d)).outcome != "passed"]
        if missing:
            why = ", ".join(f"{d} {self.records[d].outcome if d in self.records else 'absent'}" for d in missing)
            rec.outcome, rec.reason = "skipped", f"needs {why}"
            return
        left = self.deadline - RESERVE_S - st.ends_before_s - time.monotonic()
        if left < MIN_START_S:
            rec.outcome, rec.reason = "skipped", f"no time left ({left:.0f}s of the budget)"
            return
        rec.box_s = round(min(st.box_s, left), 1)
        rec.started_s = round(self.now(), 2)
        rec.outcome = "running"
        end = time.monotonic() + rec.box_s
        proc, logf = self._start(st)
        if st.background:
            self.procs[st.name] = (proc, end, logf)
            return
        self._wait(st, proc, end, logf)

    def join(self, name: str) -> None:
        proc, end, logf = self.procs.pop(name)
        st = Step(name, [], self.records[name].box_s)
        self._wait(st, proc, end, logf)

    # -- the whole -----------------------------------------------------------------------------
    def run(self, steps: list[Step]) -> int:
        for st in steps:
            self.records[st.name] = Record(st.name, needs=list(st.needs), box_s=st.box_s)
        try:
            for st in steps:
                self.run_step(st)
                self.write()
        finally:
            for name in list(self.procs):
                self.join(name)
            self.write()
        return 0 if self.summary()["ok"] else 1

    def summary(self) -> dict[str, Any]:
        counts = {k: 0 for k in ("passed", "failed", "timeout", "skipped", "pending", "running")}
        for r in self.records.values():
            counts[r.outcome] += 1
        return {**counts, "steps": len(self.records), "ok": counts["passed"] == len(self.records)}

    def report(self) -> dict[str, Any]:
        recs = list(self.records.values())
        bench = [
            {"step": r.name, **{k: r.result.get(k) for k in BENCH_FIELDS}}
            for r in recs
            if r.name.split("_")[1:2] == ["bench"] and r.result.get("concurrency") is not None
        ]
        tests = {r.name: r.result.get("counts", {}) for r in recs if r.name.endswith("_tests")}
        probe = self.records.get("probe")
        return {
            "kit": "spool gpu proof (ops/gpu_proof.sh)",
            "schema": 1,
            "dry": self.dry,
            "started": self.started,
            "wall_s": round(self.now(), 2),
            "budget_s": self.budget_s,
            "summary": self.summary(),
            "machine": probe.result if probe else {},
            "tests": tests,
            "bench": bench,
            "steps": [asdict(r) for r in recs],
        }

    def write(self) -> None:
        rep = self.report()
        for name, text in (
            ("gpu_proof_report.json", json.dumps(rep, indent=2)),
            ("gpu_proof_report.md", markdown(rep)),
        ):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(text)
            tmp.replace(self.out / name)


BENCH_FIELDS = ("engine", "concurrency", "requests", "failed", "output_tok_s", "ttft_ms_p50", "ms_per_step_p50")


def markdown(rep: dict[str, Any]) -> str:
    s = rep["summary"]
    verdict = "every step passed" if s["ok"] else "NOT every step passed"
    lines = [
        f"# GPU proof report ({'dry run, CUDA stubbed' if rep['dry'] else 'GPU'})",
        "",
        f"Started {rep['started']}, {rep['wall_s']}s of {rep['budget_s']:.0f}s: **{verdict}** "
        f"({s['passed']} passed, {s['failed']} failed, {s['timeout']} timed out, {s['skipped']} skipped "
        f"of {s['steps']}).",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in rep["machine"].items() if k not in ("ok", "why")),
        "",
        "| step | outcome | wall s | box s | why |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rep["steps"]:
        lines.append(f"| {r['name']} | {r['outcome']} | {r['wall_s'] or ''} | {r['box_s']} | {r['reason']} |")
    if rep["bench"]:
        lines += ["", "| engine | concurrency | requests | failed | tok/s | TTFT p50 ms | ms/step p50 |"]
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        for b in rep["bench"]:
            cells = [b.get(k) for k in BENCH_FIELDS]
            lines.append(
                "| "
                + " | ".join("" if c is None else f"{c:.1f}" if isinstance(c, float) else str(c) for c in cells)
                + " |"
            )
    if rep["tests"]:
        lines += [""] + [f"- {k}: {v}" for k, v in rep["tests"].items()]
    for r in rep["steps"]:
        if r["outcome"] in ("failed", "timeout"):
            lines += ["", f"## {r['name']}: {r['outcome']}", "", "```", r["log_tail"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """The step and everything it started (ninja, nvcc, pytest's children): TERM, then KILL."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def main() -> int:
    out = Path(os.environ.get("OUT") or ROOT / "out" / "gpu_proof")
    work = Path(os.environ.get("SPOOL_GPU_PROOF_WORK") or "/tmp/gpu_proof")
    kit = Path(os.environ.get("SPOOL_GPU_KIT") or ROOT / KIT)
    budget = float(os.environ.get("SPOOL_GPU_PROOF_BUDGET_S") or BUDGET_S)
    dry = os.environ.get("SPOOL_GPU_PROOF_DRY", "") not in ("", "0")
    steps = plan(sys.executable)
    _overrides(steps, sys.executable)
    runner = Runner(out, work, kit, budget, dry)
    rc = runner.run(steps)
    s = runner.summary()
    print(
        f"gpu proof: {s['passed']}/{s['steps']} steps passed ({s['failed']} failed, {s['timeout']} timed out, "
        f"{s['skipped']} skipped) in {runner.now():.0f}s; report: {out}/gpu_proof_report.md"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
