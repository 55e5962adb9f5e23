#!/usr/bin/env bash
# The GPU image's Python install steps, written once. ops/docker/Dockerfile.cuda runs `build` in its
# devel stage and `runtime` after it; CI runs `replay` (tests/e2e/test_image_replay.py), which asks
# the package registry for the same pinned requirements with the same flags, for the image's Python
# and platform, without installing anything, so a pin that no longer resolves fails CI, not a build.
#
#   build     torch, then exllamav2 and exllamav3 built from their source releases against it with
#             their CUDA extensions compiled now (TORCH_CUDA_ARCH_LIST), and flash-attn's prebuilt
#             wheel for this torch, CUDA and C++ ABI; every wheel left in $WHEELS
#   runtime   Spool with the `gpu` extra, over the wheels built above (nothing compiles at import)
#   replay F  the registry part of both, as pip dry runs; F gets pip's JSON report
#   urls      the non-registry sources (GitHub), one per line: their shape is checked in CI, their
#             download only on a machine that builds the image ("GPU host only")
#
# Versions travel together; change them together (a test checks pyproject's `gpu` extra agrees):
#   torch 2.8.0        PyPI's Linux wheel of 2.8.0 is the CUDA 12.8 build (Blackwell needs 12.8)
#   exllamav2 0.3.2    the last release (2025-07); the engine's sampler/job/filter names checked against it
#   exllamav3 1.6.5    the maintained successor; its PyPI wheel is pure Python and compiles at first
#                      import, which a runtime image cannot do: hence the source build here
#   flash-attn 2.8.3   exllamav2's paged attention (continuous batching, prefix reuse) needs >= 2.5.7;
#                      exllamav3 does not use it. Not on PyPI as a wheel: Dao-AILab's release wheel.
set -euo pipefail

TORCH_VERSION=2.8.0
EXLLAMAV2_VERSION=0.3.2
EXLLAMAV3_VERSION=1.6.5
FLASH_ATTN_VERSION=2.8.3
PYTHON_VERSION=3.11
PY=cp311
WHEELS=${WHEELS:-/wheels}
BUILD_TOOLS=(pip "setuptools>=77" wheel ninja packaging)
# What the image's platform accepts (Ubuntu 22.04: glibc 2.35, x86_64): manylinux_2_17 ... 2_35.
PLATFORM=(--python-version "$PYTHON_VERSION" --implementation cp --platform manylinux2014_x86_64)
for minor in $(seq 17 35); do PLATFORM+=(--platform "manylinux_2_${minor}_x86_64"); done

exllama_source() { # library version -> its source release at the pinned tag
  echo "https://github.com/turboderp-org/$1/archive/refs/tags/v$2.tar.gz"
}

flash_attn_wheel() { # C++ ABI of the installed torch (TRUE/FALSE) -> the matching release wheel
  echo "https://github.com/Dao-AILab/flash-attention/releases/download/v${FLASH_ATTN_VERSION}/flash_attn-${FLASH_ATTN_VERSION}+cu12torch${TORCH_VERSION%.*}cxx11abi$1-${PY}-${PY}-linux_x86_64.whl"
}

spool_requirements() { # Spool's own dependencies and its gpu extra, as pyproject.toml states them
  python - <<'EOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["gpu"]))
EOF
}

case "${1:-}" in
  build)
    python -m pip install --no-cache-dir --upgrade "${BUILD_TOOLS[@]}"
    python -m pip install --no-cache-dir --only-binary=:all: "torch==${TORCH_VERSION}"
    mkdir -p "$WHEELS"
    # No build isolation: setup.py must see this torch to compile the extension (EXLLAMA_NOCOMPILE unset).
    python -m pip wheel --no-cache-dir --no-build-isolation --no-deps -w "$WHEELS" \
      "exllamav2 @ $(exllama_source exllamav2 "$EXLLAMAV2_VERSION")" \
      "exllamav3 @ $(exllama_source exllamav3 "$EXLLAMAV3_VERSION")"
    abi=$(python -c 'import torch; print(str(torch._C._GLIBCXX_USE_CXX11_ABI).upper())')
    python -m pip download --no-cache-dir --no-deps -d "$WHEELS" "$(flash_attn_wheel "$abi")"
    ;;
  runtime)
    # The built wheels first (same versions as the gpu extra's pins, so pip keeps them), then Spool.
    python -m pip install --no-cache-dir "$WHEELS"/*.whl
    python -m pip install --no-cache-dir ".[gpu]"
    # Fail the build, not the first request, if an extension was not compiled in.
    python -c 'import importlib.util as u; assert u.find_spec("exllamav2_ext") and u.find_spec("exllamav3_ext")'
    ;;
  replay)
    report=${2:?usage: cuda-install.sh replay REPORT.json}
    target=$(mktemp -d)
    # build: the tools and torch, with the build's flags and torch's whole tree, for the image's platform.
    python -m pip install --dry-run --ignore-installed --target "$target" --only-binary=:all: \
      "${PLATFORM[@]}" --report "$report.build" "${BUILD_TOOLS[@]}" "torch==${TORCH_VERSION}"
    # runtime: Spool with its gpu extra; the registry's exllamav2/exllamav3 wheels stand in for the
    # ones built from source (same versions, same declared dependencies).
    mapfile -t reqs < <(spool_requirements)
    python -m pip install --dry-run --ignore-installed --target "$target" --only-binary=:all: \
      "${PLATFORM[@]}" --report "$report" "torch==${TORCH_VERSION}" "${reqs[@]}"
    rm -rf "$target"
    ;;
  urls)
    exllama_source exllamav2 "$EXLLAMAV2_VERSION"
    exllama_source exllamav3 "$EXLLAMAV3_VERSION"
    flash_attn_wheel TRUE
    flash_attn_wheel FALSE
    ;;
  *)
    echo "usage: $0 build|runtime|replay REPORT|urls" >&2
    exit 2
    ;;
esac
