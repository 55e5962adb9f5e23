"""The GPU image's install steps are written once (ops/docker/cuda-install.sh) and agree with the
project's pins; their registry part is replayed against the registry in tests/e2e/test_image_replay.py."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ops/docker/cuda-install.sh"
DOCKERFILE = (ROOT / "ops/docker/Dockerfile.cuda").read_text()


def _pins() -> dict[str, str]:
    return dict(re.findall(r"^([A-Z0-9_]+_VERSION)=(\S+)$", SCRIPT.read_text(), re.M))


def test_the_dockerfile_installs_through_the_script_only():
    runs = re.findall(r"^RUN ((?:[^\n]*\\\n)*[^\n]*)", DOCKERFILE, re.M)
    assert "COPY ops/docker/cuda-install.sh /usr/local/bin/spool-cuda-install" in DOCKERFILE
    assert any("spool-cuda-install build" in r for r in runs) and any("spool-cuda-install runtime" in r for r in runs)
    # No pip line of its own that could drift from the script, except installing Spool's own code
    # without dependencies once it is copied in.
    pip_lines = [r for r in runs if "pip " in r]
    assert pip_lines == ['pip install --no-cache-dir --no-deps ".[gpu]"'], pip_lines
    # Built in the devel stage, for Ampere through Blackwell (CUDA 12.8), run in the runtime stage.
    assert re.search(r"FROM nvidia/cuda:\$\{CUDA_VERSION\}-devel-ubuntu22.04 AS build", DOCKERFILE)
    assert re.search(r"FROM nvidia/cuda:\$\{CUDA_VERSION\}-runtime-ubuntu22.04", DOCKERFILE)
    assert "ARG CUDA_VERSION=12.8" in DOCKERFILE
    assert 'TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0;10.0;12.0"' in DOCKERFILE


def test_the_script_pins_what_pyproject_pins():
    pins = _pins()
    gpu = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert f"exllamav2=={pins['EXLLAMAV2_VERSION']}" in gpu
    assert f"exllamav3=={pins['EXLLAMAV3_VERSION']}" in gpu
    assert set(gpu) == {f"exllamav2=={pins['EXLLAMAV2_VERSION']}", f"exllamav3=={pins['EXLLAMAV3_VERSION']}"}


def test_the_non_registry_sources_match_the_pins():
    """GitHub cannot be reached from CI: the addresses' shape is checked here, their download only on a
    machine that builds the image."""
    pins = _pins()
    urls = subprocess.run(["bash", str(SCRIPT), "urls"], capture_output=True, text=True, check=True).stdout.split()
    v2, v3, fa_true, fa_false = urls
    assert v2 == f"https://github.com/turboderp-org/exllamav2/archive/refs/tags/v{pins['EXLLAMAV2_VERSION']}.tar.gz"
    assert v3 == f"https://github.com/turboderp-org/exllamav3/archive/refs/tags/v{pins['EXLLAMAV3_VERSION']}.tar.gz"
    torch_mm = ".".join(pins["TORCH_VERSION"].split(".")[:2])
    fa = pins["FLASH_ATTN_VERSION"]
    for url, abi in ((fa_true, "TRUE"), (fa_false, "FALSE")):
        assert url == (
            f"https://github.com/Dao-AILab/flash-attention/releases/download/v{fa}/"
            f"flash_attn-{fa}+cu12torch{torch_mm}cxx11abi{abi}-cp311-cp311-linux_x86_64.whl"
        )


def test_the_runtime_stage_checks_the_extensions_were_compiled():
    text = SCRIPT.read_text()
    assert 'find_spec("exllamav2_ext") and u.find_spec("exllamav3_ext")' in text
    assert "--no-build-isolation" in text  # setup.py must see torch, or it skips the extension


def _runtime_stage_packages() -> tuple[str, set[str]]:
    """The runtime stage's Python (its `pythonX.Y` package) and every package its apt-get installs."""
    stage = DOCKERFILE.split("-runtime-ubuntu22.04", 1)[1].split("\nFROM ", 1)[0]
    installs = re.findall(r"apt-get install ((?:[^\n]*\\\n)*[^\n&]*)", stage)
    words = {w for line in installs for w in line.replace("\\\n", " ").split() if not w.startswith("-")}
    (python,) = [w for w in words if re.fullmatch(r"python3\.\d+", w)]
    return python, words


def test_the_runtime_stage_can_build_tritons_launchers():
    """exllamav3 compiles its Triton kernels at first use, and Triton builds each launcher with a C
    compiler and the image's Python headers: without them the first generation fails on the GPU."""
    python, packages = _runtime_stage_packages()
    assert python == "python3.11"
    assert packages & {"gcc", "build-essential", "clang"}, f"no C compiler in the runtime stage: {sorted(packages)}"
    assert f"{python}-dev" in packages, f"no Python headers ({python}-dev) in the runtime stage: {sorted(packages)}"
    if "gcc" in packages and "build-essential" not in packages:
        assert "libc6-dev" in packages  # gcc links against libc's headers and crt files
