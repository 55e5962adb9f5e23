"""The proof kit's carried folder, assembled here (PyPI reachable), and the size rule it must keep.

    python -m ops.gpu_proof.bundle            # bash ops/gpu_proof.sh bundle: build gpu_kit/, then check
    python -m ops.gpu_proof.bundle --check    # bash ops/gpu_proof.sh check: the size rule only

gpu_kit/ holds what the GPU machine (CPython 3.12, pip, torch 2.11 for CUDA 13 and what torch brought,
nvcc; no package registry) lacks to run tests/gpu and the engine bench:

    wheels/   cp312 manylinux x86_64 wheels of REQUIREMENTS and everything they need (never torch)
    src/      exllamav2's and exllamav3's PyPI wheels at the pyproject `gpu` pins: pure Python plus
              their C++/CUDA sources, which torch compiles at first import (PyPI has no compiled
              build of either); the GPU half compiles them for its GPU only
    model/    SmolLM2's tokenizer.json and tokenizer_config.json, rebuilt from the bundled GGUF
              (ops/tokenizer_from_gguf.py; the 93 MB GGUF wheel does not fit), and the config.json
              of the random-weight model the GPU half writes (ops/gpu_proof/model.py)
    manifest.json

What travels (the working tree: tracked and untracked-not-ignored files, plus the carried kit) must
stay under 64 MiB: `check_size` refuses more, loudly.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.gpu_proof import CARRY, DEVICE_COMMAND, KIT, LIMIT_BYTES, model

ROOT = Path(__file__).resolve().parents[2]
# What tests/gpu, the two engines and the engine bench import beyond the standard library and torch
# (tests/unit/test_gpu_proof.py checks this against what importing them loads), with every
# dependency their metadata names, for CPython 3.12 on x86_64 Linux, but for NOT_IMPORTED. Floors
# only: the GPU half installs what its Python lacks and keeps what it has.
REQUIREMENTS = [
    "pytest>=8",
    "numpy>=1.26",
    "pillow>=9.1",  # exllamav2 and exllamav3 import PIL at import time
    "rich>=13",
    "safetensors>=0.4.3",
    "tokenizers>=0.22",
    "llguidance>=1.0,<2",
    "pydantic>=2.7,<3",
    "pydantic-settings>=2.3,<3",  # the bench's engine loop reaches core.config through workers/engine/paced.py
    "httpx>=0.27,<1",  # ops/bench/client.py
    "ninja",  # torch's JIT build of the two extensions runs it
]
# Named in a requirement's metadata, imported by nothing on the GPU path: left out with what only
# they bring (hf-xet alone is 4 MB).
NOT_IMPORTED = {"huggingface-hub": "tokenizers needs it only to download from the hub (from_pretrained)"}
# What the GPU machine's torch brought with it: never carried (a second torch must never travel).
TORCH_BRINGS = {
    "torch",
    "triton",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "filelock",
    "fsspec",
    "setuptools",
}
TARGET_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
# The kit's own share of the 64 MiB; the rest is the working tree's (checked in CI without a download).
KIT_BUDGET_BYTES = 48 * 1024 * 1024
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64"]
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
TARGET += [a for p in PLATFORMS for a in ("--platform", p)]


class SizeError(SystemExit):
    pass


@dataclass
class Sizes:
    tree_bytes: int
    carried_bytes: int
    limit: int = LIMIT_BYTES

    @property
    def total(self) -> int:
        return self.tree_bytes + self.carried_bytes

    @property
    def ok(self) -> bool:
        return self.total <= self.limit

    def line(self) -> str:
        mib = 1024 * 1024
        return (
            f"working tree {self.tree_bytes / mib:.1f} MiB + carried {self.carried_bytes / mib:.1f} MiB = "
            f"{self.total / mib:.1f} MiB of {self.limit / mib:.0f} MiB"
        )


def tree_files(root: Path) -> list[Path]:
    """What a device call sends: tracked files and untracked files git does not ignore, and shared/."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    files = {root / p for p in out.decode().split("\0") if p}
    if (root / "shared").is_dir():
        files |= {p for p in (root / "shared").rglob("*") if p.is_file()}
    return sorted(files)


def folder_bytes(path: Path) -> int:
    if path.is_file():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() or p.is_symlink())


def sizes(root: Path, carried: list[Path]) -> Sizes:
    tree = sum(p.lstat().st_size for p in tree_files(root) if p.exists() or p.is_symlink())
    return Sizes(tree, sum(folder_bytes(c) for c in carried if c.exists()))


def check_size(root: Path, carried: list[Path], limit: int = LIMIT_BYTES) -> Sizes:
    s = sizes(root, carried)
    s.limit = limit
    if not s.ok:
        biggest = sorted(((folder_bytes(p), p) for c in carried for p in c.iterdir()), reverse=True)[:5]
        raise SizeError(
            "TOO BIG TO CARRY: "
            + s.line()
            + "; the largest carried entries: "
            + ", ".join(f"{p.relative_to(p.parents[1])} {b / 1e6:.1f} MB" for b, p in biggest)
        )
    return s


def gpu_pins(root: Path = ROOT) -> dict[str, str]:
    """exllamav2's and exllamav3's versions, from pyproject's `gpu` extra (the one place they are pinned)."""
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    found = (re.fullmatch(r"\s*(exllamav[23])==([\w.]+)\s*", r) for r in extra)
    pins = {m[1]: m[2] for m in found if m}
    if set(pins) != {"exllamav2", "exllamav3"}:
        raise SystemExit(f"pyproject's gpu extra must pin exllamav2 and exllamav3 exactly: {extra}")
    return pins


def _pip(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_meta(path: Path) -> tuple[str, str, list[str]]:
    """(distribution name, version, Requires-Dist lines) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    fields = [line.split(": ", 1) for line in text.splitlines() if ": " in line]
    first = {k: v for k, v in reversed(fields)}
    return first["Name"], first["Version"], [v for k, v in fields if k == "Requires-Dist"]


def _needs(requires: list[str]) -> set[str]:
    """The distributions a wheel needs on the GPU machine (markers read for CPython 3.12, Linux x86_64)."""
    from packaging.requirements import Requirement

    out = set()
    for line in requires:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({**TARGET_ENV, "extra": ""}):
            out.add(_canon(req.name))
    return out


def prune(wheels: Path, requirements: list[str]) -> dict[str, list[str]]:
    """Keep the wheels the requirements reach without passing through NOT_IMPORTED or TORCH_BRINGS;
    delete the rest. Fails where a kept wheel needs one the folder lacks."""
    from packaging.requirements import Requirement

    found = {}
    for p in wheels.glob("*.whl"):
        name, _, requires = _wheel_meta(p)
        found[_canon(name)] = (p, _needs(requires))
    stop = {_canon(n) for n in NOT_IMPORTED} | TORCH_BRINGS
    todo = [_canon(Requirement(r).name) for r in requirements]
    keep: set[str] = set()
    missing = []
    while todo:
        name = todo.pop()
        if name in keep or name in stop:
            continue
        if name not in found:
            missing.append(name)
            continue
        keep.add(name)
        todo += sorted(found[name][1])
    if missing:
        raise SystemExit(f"the kit lacks wheels its requirements need: {sorted(set(missing))}")
    dropped = sorted(set(found) - keep)
    for name in dropped:
        found[name][0].unlink()
    return {"kept": sorted(keep), "dropped": dropped}


def tokenizer(dest: Path) -> None:
    """tokenizer.json + tokenizer_config.json of SmolLM2, and the random model's config.json."""
    from core.registry import smollm2_gguf
    from ops.tokenizer_from_gguf import export

    export(smollm2_gguf(), dest)
    (dest / "config.json").write_text(json.dumps(model.config(), indent=2))


def _listing(folder: Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted(folder.glob("*.whl")):
        name, version, _ = _wheel_meta(p)
        out.append({"dist": _canon(name), "version": version, "file": p.name, "bytes": p.stat().st_size})
    return out


def assemble(
    kit: Path,
    requirements: list[str] | None = None,
    pins: dict[str, str] | None = None,
    index: list[str] | None = None,
    root: Path = ROOT,
) -> dict[str, Any]:
    """Build `kit` from scratch and check the size rule. `index`: pip's index options (default: its
    configured index, PyPI); the tests hand a local folder instead."""
    started = time.monotonic()
    reqs = REQUIREMENTS if requirements is None else requirements
    pins = gpu_pins(root) if pins is None else pins
    index = index or []
    if kit.exists():
        shutil.rmtree(kit)
    wheels, src, mdir = kit / "wheels", kit / "src", kit / "model"
    for d in (wheels, src, mdir):
        d.mkdir(parents=True)
    _pip(["download", "--quiet", *index, *TARGET, "-d", str(wheels), *reqs])
    pruned = prune(wheels, reqs)
    _pip(["download", "--quiet", "--no-deps", *index, *TARGET, "-d", str(src), *(f"{d}=={v}" for d, v in pins.items())])
    tokenizer(mdir)
    manifest: dict[str, Any] = {
        "requirements": reqs,
        "wheels": _listing(wheels),
        "left_out": {"not_imported": NOT_IMPORTED, "dropped": pruned["dropped"], "torch_brings": sorted(TORCH_BRINGS)},
        "sources": _listing(src),
        "model": sorted(p.name for p in mdir.iterdir()),
        "device_command": DEVICE_COMMAND,
        "carry": list(CARRY),
    }
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=2))
    kit_bytes = folder_bytes(kit)
    if kit_bytes > KIT_BUDGET_BYTES:
        raise SizeError(
            f"TOO BIG TO CARRY: the kit is {kit_bytes / 2**20:.1f} MiB, over its {KIT_BUDGET_BYTES >> 20} MiB share"
        )
    s = check_size(root, [kit])
    manifest |= {"kit_bytes": kit_bytes, "tree_bytes": s.tree_bytes, "seconds": round(time.monotonic() - started, 1)}
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kit", type=Path, default=ROOT / KIT)
    ap.add_argument("--check", action="store_true", help="only the size rule, on the kit as it is")
    args = ap.parse_args()
    try:
        if args.check:
            if not args.kit.is_dir():
                raise SizeError(f"no kit at {args.kit}: bash ops/gpu_proof.sh bundle")
            s = check_size(ROOT, [args.kit])
            print(f"fits: {s.line()}")
            return 0
        m = assemble(args.kit)
    except SizeError as exc:
        print(exc, file=sys.stderr)
        return 2
    mib = 2**20
    print(
        f"kit {args.kit}: {len(m['wheels'])} wheels, {len(m['sources'])} source wheels, model files {m['model']}; "
        f"kit {m['kit_bytes'] / mib:.1f} MiB + working tree {m['tree_bytes'] / mib:.1f} MiB "
        f"<= {LIMIT_BYTES // mib} MiB; {m['seconds']}s"
    )
    print(f"device call: command {DEVICE_COMMAND!r}, carry {list(CARRY)}")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
