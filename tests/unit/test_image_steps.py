"""The GPU image's install steps are written once (ops/docker/cuda-install.sh), one per image target,
and agree with the project's pins; the EXL2 target compiles nothing and never touches exllamav3. Their
registry part is replayed against the registry in tests/e2e/test_image_replay.py; the GitHub
artifacts are checked here by shape (GitHub cannot be reached from CI)."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ops/docker/cuda-install.sh"
DOCKERFILE = (ROOT / "ops/docker/Dockerfile.cuda").read_text()
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _pins() -> dict[str, str]:
    return dict(re.findall(r"^([A-Z0-9_]+(?:_VERSION|_TAG)|PY)=(\S+)$", SCRIPT.read_text(), re.M))


def _stages() -> dict[str, tuple[str, str]]:
    """Each stage's name -> (its FROM image, its instructions without comments), in file order."""
    out: dict[str, tuple[str, str]] = {}
    for part in re.split(r"^(?=FROM )", DOCKERFILE, flags=re.M)[1:]:
        m = re.match(r"FROM (\S+)(?: AS (\S+))?", part)
        assert m and m.group(2), f"every stage is named: {part[:80]}"
        body = "\n".join(ln for ln in part.splitlines() if not ln.lstrip().startswith("#"))
        out[m.group(2)] = (m.group(1), body)
    return out


def _runs(stage: str) -> list[str]:
    return [r.replace("\\\n", " ") for r in re.findall(r"^RUN ((?:[^\n]*\\\n)*[^\n]*)", _stages()[stage][1], re.M)]


def _steps(command: str, **env: str) -> list[str]:
    """The commands `cuda-install.sh COMMAND` runs, as it prints them under SPOOL_CUDA_DRY_RUN."""
    out = subprocess.run(
        ["bash", str(SCRIPT), command],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "SPOOL_CUDA_DRY_RUN": "1", **env},
    )
    return out.stdout.splitlines()


def _urls(target: str) -> list[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), "urls", target], capture_output=True, text=True, check=True
    ).stdout.split()


def test_the_targets_and_what_each_builds_from():
    stages = _stages()
    assert list(stages) == ["exl2", "exl3-build", "exl3", "default"]
    assert "ARG CUDA_VERSION=12.8" in DOCKERFILE
    assert stages["exl2"][0] == "nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu22.04"
    assert stages["exl3-build"][0] == "nvidia/cuda:${CUDA_VERSION}-devel-ubuntu22.04"
    assert stages["exl3"][0] == "nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu22.04"
    # Without --target: the EXL2 image (the last stage is it, and needs nothing else).
    assert stages["default"] == ("exl2", "FROM exl2 AS default")


def test_the_dockerfile_installs_through_the_script_only():
    assert DOCKERFILE.count("COPY ops/docker/cuda-install.sh /usr/local/bin/spool-cuda-install") == 2
    want = {"exl2": ["exl2"], "exl3-build": ["exl3-build", "exl3"], "exl3": [], "default": []}
    for stage, commands in want.items():
        runs = _runs(stage)
        assert [c for r in runs for c in re.findall(r"spool-cuda-install (\S+)", r)] == commands, stage
        # No pip line of its own that could drift from the script, except installing Spool's own code
        # without dependencies once it is copied in.
        pip_lines = [r for r in runs if "pip " in r]
        extra = {"exl2": "exl2", "exl3-build": "exl3"}.get(stage)
        assert pip_lines == ([f'pip install --no-cache-dir --no-deps ".[{extra}]"'] if extra else []), pip_lines


def test_the_exl2_target_compiles_nothing_and_never_touches_exllamav3():
    stages = _stages()
    image, body = stages["exl2"]
    assert "--from=" not in body and "devel" not in image  # it reads no other stage
    for word in ("exllamav3", "exl3", "nvcc", "devel", "build-essential", "gcc", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS"):
        assert word not in body, f"the exl2 stage mentions {word}"
    steps = _steps("exl2")
    text = "\n".join(steps)
    for word in ("exllamav3", "nvcc", "pip wheel", "--no-build-isolation", "TORCH_CUDA_ARCH_LIST", "setup.py"):
        assert word not in text, f"the exl2 install step mentions {word}"
    installs = [s for s in steps if " pip install " in f" {s}" and "--upgrade pip" not in s]
    assert installs and all("--only-binary=:all:" in s for s in installs), installs  # never an sdist
    urls = [w for s in installs for w in s.split() if w.startswith("https://")]
    assert all(u.endswith(".whl") for u in urls), urls  # release wheels, no source archive
    assert [u.split("/")[3] for u in urls] == ["turboderp-org", "Dao-AILab"]


def test_the_exl3_target_compiles_in_its_own_stages():
    stages = _stages()
    build = stages["exl3-build"][1]
    assert 'ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0;10.0;12.0"' in build
    assert re.search(r"^ARG MAX_JOBS=\d+$", build, re.M)
    assert "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}" in build and "MAX_JOBS=${MAX_JOBS}" in build
    assert "COPY --from=exl3-build /opt/venv /opt/venv" in stages["exl3"][1]
    steps = "\n".join(_steps("exl3-build", TORCH_CUDA_ARCH_LIST="9.0", MAX_JOBS="2"))
    assert "--no-build-isolation" in steps  # setup.py must see torch, or it skips the extension
    assert "exllamav2" not in steps and "flash" not in steps
    # The compile needs both: the script refuses to start without them (an unbounded nvcc fan-out
    # runs a build machine out of memory).
    for missing in ("TORCH_CUDA_ARCH_LIST", "MAX_JOBS"):
        env = {**os.environ, "SPOOL_CUDA_DRY_RUN": "1", "TORCH_CUDA_ARCH_LIST": "9.0", "MAX_JOBS": "2"}
        del env[missing]
        out = subprocess.run(["bash", str(SCRIPT), "exl3-build"], capture_output=True, text=True, env=env, cwd=ROOT)
        assert out.returncode != 0 and missing in out.stderr


def test_each_install_checks_its_torch_and_its_compiled_extensions():
    pins = _pins()
    for command, exts in (("exl2", "exllamav2_ext flash_attn_2_cuda"), ("exl3", "exllamav3_ext")):
        steps = _steps(command)
        assert any("find_spec" in s and s.endswith(exts) for s in steps), steps
        assert any("torch.version.cuda" in s and s.endswith(f"{pins['TORCH_VERSION']} 12.8") for s in steps), steps
        assert any(f"torch=={pins['TORCH_VERSION']}" in s and f".[{command}]" in s for s in steps), steps


def test_the_script_pins_what_pyproject_pins():
    pins = _pins()
    torch = f"torch=={pins['TORCH_VERSION']}"
    v2, v3 = f"exllamav2=={pins['EXLLAMAV2_VERSION']}", f"exllamav3=={pins['EXLLAMAV3_VERSION']}"
    assert set(EXTRAS["exl2"]) == {v2, torch}
    assert set(EXTRAS["exl3"]) == {v3, torch}
    # `gpu`: both engines' pins (tests/unit/test_gpu_contract.py reads them from it).
    assert {r for r in EXTRAS["gpu"] if r.startswith("exllamav")} == {v2, v3}


def test_the_non_registry_sources_match_the_pins():
    """GitHub cannot be reached from CI: the addresses' shape is checked here against the pins (version,
    CUDA, torch, Python, platform), their download only on a machine that builds the image."""
    pins = _pins()
    torch, cuda, py = pins["TORCH_VERSION"], pins["CUDA_TAG"], pins["PY"]
    assert cuda == "cu128" and torch == "2.8.0"
    assert py == "cp" + pins["PYTHON_VERSION"].replace(".", "") == "cp311"
    v2, fa_true, fa_false = _urls("exl2")
    ev2 = pins["EXLLAMAV2_VERSION"]
    assert v2 == f"https://github.com/turboderp-org/exllamav2/releases/download/v{ev2}/" + (
        f"exllamav2-{ev2}+{cuda}.torch{torch}-{py}-{py}-linux_x86_64.whl"
    )
    # The file TabbyAPI pinned for Linux x86_64, Python 3.11 (its pyproject.toml before 5627f4d).
    assert v2.endswith("/v0.3.2/exllamav2-0.3.2+cu128.torch2.8.0-cp311-cp311-linux_x86_64.whl")
    fa, torch_mm = pins["FLASH_ATTN_VERSION"], ".".join(torch.split(".")[:2])
    for url, abi in ((fa_true, "TRUE"), (fa_false, "FALSE")):
        assert url == (
            f"https://github.com/Dao-AILab/flash-attention/releases/download/v{fa}/"
            f"flash_attn-{fa}+cu{cuda[2:4]}torch{torch_mm}cxx11abi{abi}-{py}-{py}-linux_x86_64.whl"
        )
    (v3,) = _urls("exl3")
    assert v3 == f"https://github.com/turboderp-org/exllamav3/archive/refs/tags/v{pins['EXLLAMAV3_VERSION']}.tar.gz"
    assert _urls("all") == [v2, fa_true, fa_false, v3]


def _stage_packages(stage: str) -> tuple[str, set[str]]:
    """A stage's Python (its `pythonX.Y` package) and every package its apt-get installs."""
    installs = [m for r in _runs(stage) for m in re.findall(r"apt-get install ([^&]*)", r)]
    words = {w for line in installs for w in line.split() if not w.startswith("-")}
    (python,) = [w for w in words if re.fullmatch(r"python3\.\d+", w)]
    return python, words


def test_the_runtime_stage_can_build_tritons_launchers():
    """exllamav3 compiles its Triton kernels at first use, and Triton builds each launcher with a C
    compiler and the image's Python headers: without them the first generation fails on the GPU."""
    python, packages = _stage_packages("exl3")
    assert python == "python3.11"
    assert packages & {"gcc", "build-essential", "clang"}, f"no C compiler in the runtime stage: {sorted(packages)}"
    assert f"{python}-dev" in packages, f"no Python headers ({python}-dev) in the runtime stage: {sorted(packages)}"
    if "gcc" in packages and "build-essential" not in packages:
        assert "libc6-dev" in packages  # gcc links against libc's headers and crt files


def test_the_exl2_image_carries_no_compiler():
    """Nothing in the EXL2 image compiles, at build or at run time (no Triton kernels in exllamav2)."""
    python, packages = _stage_packages("exl2")
    assert python == "python3.11" and f"{python}-venv" in packages
    assert not packages & {"gcc", "build-essential", "clang", f"{python}-dev"}, sorted(packages)


def test_the_bare_host_steps_in_the_docs_use_the_pins():
    pins = _pins()
    doc = (ROOT / "docs/gpu.md").read_text()
    bare = doc.split("## Without Docker", 1)[1].split("\n## ", 1)[0]
    # torch from PyTorch's index for the image's CUDA, at the pinned version.
    index = f"https://download.pytorch.org/whl/{pins['CUDA_TAG']} torch=={pins['TORCH_VERSION']}"
    assert f"pip install --index-url {index}" in bare
    assert "bash ops/docker/cuda-install.sh exl2" in bare
    build = [ln for ln in bare.splitlines() if "cuda-install.sh exl3-build" in ln]
    assert build and all("TORCH_CUDA_ARCH_LIST=" in ln and re.search(r"MAX_JOBS=\d", ln) for ln in build), build
    assert "cuda-install.sh exl3\n" in bare and "CUDA 12.8 toolkit" in bare
    assert "spool up --registry ops/models.host.example.toml" in bare
    # Every script command the docs name exists.
    for command in set(re.findall(r"cuda-install\.sh ([a-z0-9-]+)", doc)):
        assert re.search(rf"^  {re.escape(command)}\)", SCRIPT.read_text(), re.M), command
