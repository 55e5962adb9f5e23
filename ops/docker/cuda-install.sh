#!/usr/bin/env bash
# The GPU worker's Python install steps, written once, for both image targets of
# ops/docker/Dockerfile.cuda and for a bare host (docs/gpu.md). Every artifact a target installs is
# named and pinned below with its source; nothing else installs anything.
#
#   exl2        released artifacts only, nothing compiled (no nvcc, no compiler): torch from PyPI,
#               exllamav2's and flash-attn's release wheels for that torch, then Spool with its
#               `exl2` extra. The `exl2` image target (compose's default), and a bare EXL2 host.
#   exl3-build  torch, then exllamav3 built from its source release with its CUDA extension compiled
#               for TORCH_CUDA_ARCH_LIST by MAX_JOBS parallel nvcc jobs; the wheel is left in $WHEELS.
#               Needs nvcc (the CUDA 12.8 toolkit). The `exl3` image target's devel stage only.
#   exl3        the wheel built above, then Spool with its `exl3` extra (nothing compiles at import).
#   replay T F  the registry part of target T (exl2 | exl3) as pip dry runs for the image's Python and
#               platform, with the install's own requirement lists and flags; F gets pip's JSON report
#               (exl3 also F.build: the build step's tools and torch). CI: tests/e2e/test_image_replay.py
#   urls [T]    the non-registry artifacts (GitHub) of T (default: both), one per line. Their shape is
#               checked against the pins in CI (tests/unit/test_image_steps.py); their download only on
#               a machine that builds the image (GitHub is not reachable from CI)
# SPOOL_CUDA_DRY_RUN=1 prints each install command instead of running it (CI reads the steps).
#
# The pins travel together; change them together (CI checks pyproject's `exl2`/`exl3`/`gpu` extras agree):
#   Python 3.11 (cp311), Linux x86_64, CUDA 12.8 (Blackwell needs 12.8), torch 2.8.0.
#
#   torch 2.8.0        PyPI. Its Linux x86_64 wheel is the CUDA 12.8 build (it depends on
#                      nvidia-cuda-runtime-cu12 12.8.*: the replay checks it). A bare host may take the
#                      same release from PyTorch's cu128 index (torch 2.8.0+cu128); pip keeps it.
#   exllamav2 0.3.2    GitHub release wheel exllamav2-0.3.2+cu128.torch2.8.0-cp311-cp311-linux_x86_64.whl
#     (exl2 only)      (turboderp-org/exllamav2, release v0.3.2). Verified against its release workflow's
#                      matrix (.github/workflows/build-wheels-release.yml: py3.11, CUDA 12.8.1, torch
#                      2.8.0, archs 6.0 ... 9.0 10.0 12.0+PTX, tag +cu128-torch2.8.0) and against the file
#                      TabbyAPI pinned; its declared dependencies are those of PyPI's 0.3.2 wheel
#                      (setup.py at v0.3.2), which the replay resolves in its place. Not downloaded here.
#   flash-attn 2.8.3   GitHub release wheel of Dao-AILab/flash-attention v2.8.3 for torch 2.8, CUDA 12
#     (exl2 only)      and the C++ ABI of the installed torch (read at install time). exllamav2's paged
#                      attention (continuous batching, prefix reuse) needs >= 2.5.7. Its dependencies
#                      (setup.py: torch, einops) are replayed. Not downloaded here.
#   exllamav3 1.6.5    GitHub source release (tag v1.6.5), compiled here: PyPI's 1.6.5 is a pure-Python
#     (exl3 only)      wheel that compiles at first import, which a runtime image cannot do. UNVERIFIED:
#                      no one has built 1.6.5 against torch 2.8.0; no release wheel of 1.6.5 for torch
#                      2.8 is known here (the release matrix, .github/workflows/build.yml, is known up to
#                      1.4.1, where it lists torch 2.8.0 for py3.11 / CUDA 12.8.1 / archs 8.0 ... 12.0+PTX).
#                      Its declared dependencies are those of PyPI's 1.6.5 wheel, which the replay resolves.
#   Spool's own dependencies and its `exl2` / `exl3` extra: PyPI, as pyproject.toml states them.
set -euo pipefail

TORCH_VERSION=2.8.0
EXLLAMAV2_VERSION=0.3.2
EXLLAMAV3_VERSION=1.6.5
FLASH_ATTN_VERSION=2.8.3
PYTHON_VERSION=3.11
CUDA_TAG=cu128
PY=cp311
WHEELS=${WHEELS:-/wheels}
BUILD_TOOLS=(pip "setuptools>=77" wheel ninja packaging)
FLASH_ATTN_REQUIRES=(einops)  # flash-attn's own dependencies besides torch (its setup.py)
# What the image's platform accepts (Ubuntu 22.04: glibc 2.35, x86_64): manylinux_2_17 ... 2_35.
PLATFORM=(--python-version "$PYTHON_VERSION" --implementation cp --platform manylinux2014_x86_64)
for minor in $(seq 17 35); do PLATFORM+=(--platform "manylinux_2_${minor}_x86_64"); done

run() { # an install step: run it, or print it under SPOOL_CUDA_DRY_RUN
  if [ -n "${SPOOL_CUDA_DRY_RUN:-}" ]; then echo "$*"; else "$@"; fi
}

exllamav2_wheel() { # exllamav2's release wheel for this torch, CUDA and Python
  echo "https://github.com/turboderp-org/exllamav2/releases/download/v${EXLLAMAV2_VERSION}/exllamav2-${EXLLAMAV2_VERSION}+${CUDA_TAG}.torch${TORCH_VERSION}-${PY}-${PY}-linux_x86_64.whl"
}

flash_attn_wheel() { # C++ ABI of the installed torch (TRUE/FALSE) -> the matching release wheel
  echo "https://github.com/Dao-AILab/flash-attention/releases/download/v${FLASH_ATTN_VERSION}/flash_attn-${FLASH_ATTN_VERSION}+cu12torch${TORCH_VERSION%.*}cxx11abi$1-${PY}-${PY}-linux_x86_64.whl"
}

exllamav3_source() { # exllamav3's source release at the pinned tag
  echo "https://github.com/turboderp-org/exllamav3/archive/refs/tags/v${EXLLAMAV3_VERSION}.tar.gz"
}

torch_abi() { # TRUE/FALSE: the C++ ABI the installed torch was built with
  if [ -n "${SPOOL_CUDA_DRY_RUN:-}" ]; then echo ABI; return; fi
  python -c 'import torch; print(str(torch._C._GLIBCXX_USE_CXX11_ABI).upper())'
}

spool_requirements() { # Spool's own dependencies and its extra $1, as pyproject.toml states them
  python - "$1" <<'EOF'
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"][sys.argv[1]]))
EOF
}

check_torch() { # the pinned torch, built for CUDA 12.8 (not another release pip may have kept or chosen)
  run python -c "import sys, torch; v = (torch.__version__.split('+')[0], torch.version.cuda); assert v == tuple(sys.argv[1:]), v" \
    "$TORCH_VERSION" "12.8"
}

check_extensions() { # fail the build, not the first request, if a compiled extension is missing
  run python -c "import importlib.util as u, sys; missing = [m for m in sys.argv[1:] if not u.find_spec(m)]; assert not missing, missing" "$@"
}

case "${1:-}" in
  exl2)
    run python -m pip install --no-cache-dir --upgrade pip
    run python -m pip install --no-cache-dir --only-binary=:all: "torch==${TORCH_VERSION}"
    # The release wheels and Spool's dependencies in one resolve: the wheels satisfy the extra's
    # exllamav2==0.3.2 (a local version +cu128.torch2.8.0 matches it), so pip keeps them.
    run python -m pip install --no-cache-dir --only-binary=:all: "torch==${TORCH_VERSION}" \
      "exllamav2 @ $(exllamav2_wheel)" "flash-attn @ $(flash_attn_wheel "$(torch_abi)")" ".[exl2]"
    check_torch
    check_extensions exllamav2_ext flash_attn_2_cuda
    ;;
  exl3-build)
    : "${TORCH_CUDA_ARCH_LIST:?set TORCH_CUDA_ARCH_LIST (e.g. 9.0 for an H100 only)}"
    : "${MAX_JOBS:?set MAX_JOBS (parallel nvcc jobs; each takes several GiB of memory)}"
    run python -m pip install --no-cache-dir --upgrade "${BUILD_TOOLS[@]}"
    run python -m pip install --no-cache-dir --only-binary=:all: "torch==${TORCH_VERSION}"
    run mkdir -p "$WHEELS"
    # No build isolation: setup.py must see this torch to compile the extension (EXLLAMA_NOCOMPILE unset).
    run python -m pip wheel --no-cache-dir --no-build-isolation --no-deps -w "$WHEELS" \
      "exllamav3 @ $(exllamav3_source)"
    ;;
  exl3)
    # The built wheel (same version as the extra's pin, so pip keeps it), then Spool.
    run python -m pip install --no-cache-dir --only-binary=:all: "torch==${TORCH_VERSION}" \
      "$WHEELS"/exllamav3-"${EXLLAMAV3_VERSION}"-*.whl ".[exl3]"
    check_torch
    check_extensions exllamav3_ext
    ;;
  replay)
    target_name=${2:?usage: cuda-install.sh replay exl2|exl3 REPORT.json}
    report=${3:?usage: cuda-install.sh replay exl2|exl3 REPORT.json}
    target=$(mktemp -d)
    # fast-deps: each candidate's metadata read from its wheel by HTTP range requests. An index that
    # serves no PEP 658 metadata (as this machine's registry proxy) otherwise makes a dry run download
    # every wheel whole: torch's 888 MB, ~4 GB a target, 62 CPU s of CI's shards for both (2026-11-28).
    # Where the server refuses ranges, pip downloads the wheel as before. What is resolved is the same.
    dry() {
      python -m pip install --use-feature=fast-deps --dry-run --ignore-installed --target "$target" \
        --only-binary=:all: "${PLATFORM[@]}" "$@"
    }
    mapfile -t reqs < <(spool_requirements "$target_name")
    case "$target_name" in
      exl2)
        # PyPI's exllamav2 0.3.2 (in the extra) stands in for the release wheel: same declared dependencies.
        dry --report "$report" "torch==${TORCH_VERSION}" "${FLASH_ATTN_REQUIRES[@]}" "${reqs[@]}"
        ;;
      exl3)
        dry --report "$report.build" "${BUILD_TOOLS[@]}" "torch==${TORCH_VERSION}"
        # PyPI's exllamav3 1.6.5 (in the extra) stands in for the wheel built from source.
        dry --report "$report" "torch==${TORCH_VERSION}" "${reqs[@]}"
        ;;
      *) echo "replay: exl2 or exl3" >&2; exit 2 ;;
    esac
    rm -rf "$target"
    ;;
  urls)
    case "${2:-all}" in
      exl2) exllamav2_wheel; flash_attn_wheel TRUE; flash_attn_wheel FALSE ;;
      exl3) exllamav3_source ;;
      all) exllamav2_wheel; flash_attn_wheel TRUE; flash_attn_wheel FALSE; exllamav3_source ;;
      *) echo "urls: exl2, exl3 or nothing" >&2; exit 2 ;;
    esac
    ;;
  *)
    echo "usage: $0 exl2|exl3-build|exl3|replay exl2|exl3 REPORT|urls [exl2|exl3]" >&2
    exit 2
    ;;
esac
