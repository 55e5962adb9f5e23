#!/usr/bin/env bash
# Build llama-cpp-python once per version and CPU flags, for a portable CPU baseline, into a wheel
# cache outside the checkout; prints the wheel's path. Usage: bash ops/llama_wheel.sh PYTHON
#
# Why not let pip build it: pip compiles llama.cpp with -march=native (GGML_NATIVE) and its wheel
# cache hands that build to every later virtualenv on the machine, whatever CPU the machine has by
# then, and an image built so carries the build host's CPU. Seen here (2026-11-26): a VM whose CPU
# advertises AMX got ggml's AMX kernels, but the VM does not enable AMX tile state, so every matrix
# product died in `ldtilecfg` (a general protection fault: no llama.cpp job could run). A native
# build also stops with SIGILL on an older CPU. The baseline below (AVX2, FMA, F16C) runs on any
# x86-64 CPU since 2013 (Haswell); a host that wants more passes CMAKE_ARGS, which come after it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:?usage: ops/llama_wheel.sh PYTHON}
SPEC=$(grep -o '"llama-cpp-python[^"]*"' pyproject.toml | head -1 | tr -d '"')
case "$(uname -m)" in
  x86_64 | amd64) FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" ;;
  *) FLAGS="-DGGML_NATIVE=OFF" ;;
esac
# CMAKE_ARGS count too (with none the key is what it always was): a host's own flags get a build of their own.
KEY=$(printf '%s|%s|%s%s' "$SPEC" "$FLAGS" "$("$PY" -c 'import sys; print(sys.version_info[:2])')" "${CMAKE_ARGS:+|$CMAKE_ARGS}" \
  | sha1sum | cut -c1-12)
DIR=${SPOOL_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spool/wheels}/llama-$KEY
if ! ls "$DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  # About 8-12 minutes on 2 cores, once per machine (or image build).
  rm -rf "$DIR.tmp" && mkdir -p "$DIR.tmp"
  CMAKE_ARGS="$FLAGS ${CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    "$PY" -m pip wheel --quiet --progress-bar off --no-deps --no-cache-dir --no-binary llama-cpp-python \
    "$SPEC" -w "$DIR.tmp" >&2
  rm -rf "$DIR" && mv "$DIR.tmp" "$DIR"
fi
ls "$DIR"/llama_cpp_python-*.whl | head -1
