"""What each step of the GPU half does (run.py runs them, one process each, time-boxed):

    python -m ops.gpu_proof.steps probe | install | model | build ENGINE | tests ENGINE | bench ENGINE N

Each writes its findings as JSON to $GPU_PROOF_RESULT ({"ok": false, "why": ...} where it failed) and
its output to the step's log. Under SPOOL_GPU_PROOF_DRY=1 (the CI dry run: no CUDA here) the parts
that need a GPU are stubbed and say so in their result: the probe reports a stub device of
capability 9.0, the install resolves the kit's wheels for CPython 3.12 with pip's --dry-run instead
of installing, the build checks the source wheel holds the extension's sources instead of compiling,
the tests are collected (--collect-only) instead of run, and the bench drives the null engine
(workers/engine/null.py, the kit's tokenizer) instead of the ExLlama one. The model is written as on
the GPU. Everything else (the commands, the parsing, the results) is the GPU run's own code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[2]
DRY = os.environ.get("SPOOL_GPU_PROOF_DRY", "") not in ("", "0")
KIT = Path(os.environ.get("GPU_PROOF_KIT") or ROOT / "gpu_kit")
WORK = Path(os.environ.get("GPU_PROOF_WORK") or "/tmp/gpu_proof")
MODEL = WORK / "model"
EXT_MODULE = {"exllamav2": "exllamav2.ext", "exllamav3": "exllamav3.ext"}
CP312 = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64", "linux_x86_64"]


def _sh(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    print("$", " ".join(argv), flush=True)
    return subprocess.run(argv, text=True, capture_output=True, **kw)


def _echo(proc: subprocess.CompletedProcess[str]) -> str:
    out = (proc.stdout or "") + (proc.stderr or "")
    print(out, flush=True)
    return out


def manifest() -> dict[str, Any]:
    path = KIT / "manifest.json"
    if not path.is_file():
        raise SystemExit(f"no kit at {KIT} (manifest.json missing): run `bash ops/gpu_proof.sh bundle` and carry it")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


# -- probe ------------------------------------------------------------------------------------------
def probe() -> dict[str, Any]:
    facts: dict[str, Any] = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = "name,driver_version,memory.total,compute_cap"
        p = _sh([smi, f"--query-gpu={q}", "--format=csv,noheader"], timeout=20)
        facts["nvidia_smi"] = (p.stdout or p.stderr).strip()
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc:
        facts["nvcc"] = _sh([nvcc, "--version"], timeout=20).stdout.strip().splitlines()[-1:]
    try:
        import torch
    except ImportError as exc:
        return {**facts, "ok": False, "why": f"torch does not import: {exc}"}
    facts["torch"], facts["torch_cuda"] = torch.__version__, torch.version.cuda
    if DRY:
        # No CUDA here: the device the GPU run would read, as the contract tests stub it.
        return {**facts, "ok": True, "device": "stub (SPOOL_GPU_PROOF_DRY)", "capability": [9, 0], "arch": "9.0"}
    if not torch.cuda.is_available():
        return {**facts, "ok": False, "why": "torch sees no CUDA device (driver too old for its CUDA?)"}
    major, minor = torch.cuda.get_device_capability(0)
    free, total = torch.cuda.mem_get_info(0)
    return {
        **facts,
        "ok": True,
        "device": torch.cuda.get_device_name(0),
        "capability": [major, minor],
        "arch": f"{major}.{minor}",  # this GPU only: TORCH_CUDA_ARCH_LIST for both builds
        "gpu_memory_gib": round(total / 2**30, 1),
        "gpu_free_gib": round(free / 2**30, 1),
    }


# -- install ----------------------------------------------------------------------------------------
def _present(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def install() -> dict[str, Any]:
    """The kit's wheels that this Python lacks, from the kit only (no index); what it has is kept, so
    the image's own builds (torch and what it brought) are never replaced."""
    m = manifest()
    wheels = KIT / "wheels"
    have = {w["dist"]: _present(w["dist"]) for w in m["wheels"]}
    todo = [w for w in m["wheels"] if DRY or have[w["dist"]] is None]
    pins = [f"{w['dist']}=={w['version']}" for w in todo]
    base = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), "--no-deps"]
    if DRY:  # resolve every wheel for the GPU machine's CPython 3.12, install nothing
        target = WORK / "dry-site"
        argv = [*base, "--dry-run", "--ignore-installed", "--target", str(target), *CP312]
        argv += [a for p in PLATFORMS for a in ("--platform", p)]
    else:
        argv = [*base, "--no-compile", "--disable-pip-version-check"]
    result: dict[str, Any] = {"resolved" if DRY else "installed": pins, "kept": {d: v for d, v in have.items() if v}}
    if not pins:
        return {**result, "ok": True}
    p = _sh([*argv, *pins], timeout=600)
    out = _echo(p)
    if p.returncode != 0:
        return {**result, "ok": False, "why": f"pip install from the kit failed: {out.strip().splitlines()[-1:]}"}
    return {**result, "ok": True}


# -- model ------------------------------------------------------------------------------------------
def model() -> dict[str, Any]:
    from ops.gpu_proof import model as m

    src = KIT / "model"
    MODEL.mkdir(parents=True, exist_ok=True)
    for f in src.glob("*.json"):
        shutil.copy2(f, MODEL / f.name)
    started = time.monotonic()
    weights = m.write(MODEL)
    return {
        "ok": True,
        "folder": str(MODEL),
        "dims": m.DIMS,
        "weights_mb": round(weights.stat().st_size / 1e6, 1),
        "seconds": round(time.monotonic() - started, 2),
    }


# -- build ------------------------------------------------------------------------------------------
def _source_wheel(engine: str) -> Path:
    m = manifest()
    name = next(s["file"] for s in m["sources"] if s["dist"] == engine)
    return KIT / "src" / name


def build(engine: str) -> dict[str, Any]:
    """The library from its source wheel (no dependencies: the kit's wheels are those it imports),
    then its CUDA extension compiled for this GPU only (torch's JIT build, as the library itself
    does at first import, into TORCH_EXTENSIONS_DIR, where the tests and the bench load it)."""
    whl = _source_wheel(engine)
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    jobs = str(os.cpu_count() or 4)
    if DRY:
        with zipfile.ZipFile(whl) as z:
            cu = [n for n in z.namelist() if n.endswith((".cu", ".cpp"))]
        ok = bool(cu) and bool(arch)
        why = "" if ok else f"no C++/CUDA sources in {whl.name}" if not cu else "no TORCH_CUDA_ARCH_LIST from the probe"
        return {"ok": ok, "why": why, "wheel": whl.name, "sources": len(cu), "arch": arch, "compiled": False}
    p = _sh([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", str(whl)], timeout=300)
    if p.returncode != 0:
        return {"ok": False, "why": f"pip install {whl.name}: {_echo(p).strip().splitlines()[-1:]}"}
    env = {**os.environ, "MAX_JOBS": jobs, "TORCH_CUDA_ARCH_LIST": arch}
    code = (
        "import time; t = time.monotonic(); import importlib; "
        f"m = importlib.import_module({EXT_MODULE[engine]!r}); "
        f"e = getattr(m, {engine + '_ext'!r}); print('EXT', e.__file__, round(time.monotonic() - t, 1))"
    )
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=env, text=True, capture_output=True)
    out = _echo(proc)
    found = re.search(r"^EXT (\S+) ([\d.]+)$", out, re.M)
    res = {"wheel": whl.name, "arch": arch, "max_jobs": jobs, "seconds": round(time.monotonic() - started, 1)}
    if proc.returncode != 0 or not found:
        last = [ln for ln in out.strip().splitlines() if ln.strip()][-3:]
        return {**res, "ok": False, "why": f"{engine}'s extension did not build or load: {last}"}
    return {**res, "ok": True, "extension": found[1], "compiled": True}


# -- tests ------------------------------------------------------------------------------------------
def tests(engine: str) -> dict[str, Any]:
    """tests/gpu for one engine, on the kit's model. Only tests/gpu's conftest is loaded (the suite's
    own starts Postgres and Redis, which the GPU machine lacks). On the GPU a skip is a failure: it
    means a library or the model was not found, not that the machine has no GPU."""
    junit = WORK / f"junit-{engine}.xml"
    junit.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pytest", "tests/gpu", "-k", engine, "--confcutdir", "tests/gpu"]
    argv += ["-p", "no:cacheprovider", "-q", "-rs", f"--junitxml={junit}"]
    if DRY:
        argv.append("--collect-only")
    env = {**os.environ, "SPOOL_TEST_EXL2_MODEL": str(MODEL), "SPOOL_TEST_EXL3_MODEL": str(MODEL)}
    p = _sh(argv, env=env, cwd=ROOT)
    out = _echo(p)
    if DRY:
        found = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", out)
        n = int(found[1]) if found else 0
        return {"ok": p.returncode == 0 and n > 0, "why": "" if n else "no test collected", "counts": {"collected": n}}
    counts = _junit(junit)
    skips = re.findall(r"^SKIPPED \[\d+\] (.+)$", out, re.M)
    ok = p.returncode == 0 and counts.get("skipped", 0) == 0 and counts.get("passed", 0) > 0
    why = "" if ok else f"pytest rc {p.returncode}, {counts}" + (f"; skipped: {skips[:3]}" if skips else "")
    return {"ok": ok, "why": why, "counts": counts, "skips": skips[:10]}


def _junit(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return n


# -- bench ------------------------------------------------------------------------------------------
def _engine(engine: str) -> Any:
    """The engine as a worker serving the kit's model would hold it (registry n_ctx 1024, max_batch 64),
    built directly: the worker's wiring needs Postgres and Redis clients the GPU machine lacks."""
    if DRY:  # no GPU: the null engine, on the kit's tokenizer through a registry entry
        registry = WORK / f"registry-{engine}.toml"
        registry.write_text(f'[[models]]\nid = "proof-{engine}"\nengine = "null"\npath = "{MODEL}"\n')
        os.environ["SPOOL_MODELS_FILE"] = str(registry)
        from workers.engine.null import NullEngine

        return NullEngine(f"proof-{engine}", n_ctx=1024, max_batch=64)
    if engine == "exllamav2":
        from workers.engine.exllamav2 import ExLlamaV2Engine

        return ExLlamaV2Engine("proof-exllamav2", MODEL, n_ctx=1024, max_batch=64, chunk=1024)
    from workers.engine.exllamav3 import ExLlamaV3Engine

    return ExLlamaV3Engine("proof-exllamav3", MODEL, n_ctx=1024, max_batch=64, chunk=1024)


def bench(engine: str, concurrency: int) -> dict[str, Any]:
    """ops/bench/engine.py's measurement (the engine loop in-process, no API, queue or Redis) at one
    concurrency: output tokens/s, time to first token, and the inter-token latency, which with every
    live sequence advanced once per batched decode step is the milliseconds a step takes."""
    from ops.bench.client import BenchConfig
    from ops.bench.engine import measure
    from workers.engine.loop import EngineLoop

    cfg = BenchConfig(
        model=f"proof-{engine}",
        concurrency=[concurrency],
        requests=concurrency if DRY else max(8, concurrency),  # exllamav2 without flash-attn: one at a time
        max_tokens=8 if DRY else 128,
        ignore_eos=True,
        temperature=0.0,
        label=engine,
    )
    started = time.monotonic()
    loop = EngineLoop(make=lambda: _engine(engine))
    load_s = time.monotonic() - started
    (summary,) = measure(loop, cfg)
    res = {
        "engine": f"{engine} (null engine: dry run)" if DRY else engine,
        "concurrency": concurrency,
        "max_batch": getattr(loop.engine, "max_batch", None),  # exllamav2 without flash-attn: 1
        "requests": summary.requests,
        "failed": summary.failed,
        "output_tok_s": round(summary.output_tok_s, 1),
        "ttft_ms_p50": summary.ttft_ms.get("p50"),
        "ms_per_step_p50": summary.itl_ms.get("p50"),
        "e2e_ms_p50": summary.e2e_ms.get("p50"),
        "duration_s": round(summary.duration_s, 2),
        "load_s": round(load_s, 2),
        "errors": summary.errors,
    }
    ok = summary.failed == 0 and summary.output_tokens > 0
    return {**res, "ok": ok, "why": "" if ok else f"{summary.failed} requests failed: {summary.errors[:2]}"}


def main(argv: list[str]) -> int:
    what, args = argv[0], argv[1:]
    steps: dict[str, Callable[..., dict[str, Any]]] = {
        "probe": probe,
        "install": install,
        "model": model,
        "build": build,
        "tests": tests,
        "bench": bench,
    }
    fn = steps[what]
    typed = [int(a) if a.isdigit() else a for a in args]
    try:
        result = fn(*typed)
    except SystemExit as exc:
        result = {"ok": False, "why": str(exc)}
    except Exception as exc:  # recorded as the step's failure, with its traceback in the log
        import traceback

        traceback.print_exc()
        result = {"ok": False, "why": f"{type(exc).__name__}: {exc}"}
    out = os.environ.get("GPU_PROOF_RESULT")
    if out:
        Path(out).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, default=str), flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: the engine loop's thread may still hold CUDA, and a crash while
    # exiting would turn a written result into a failed step.
    os._exit(code)
