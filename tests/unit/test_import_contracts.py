"""The import contracts in pyproject.toml fail on a planted violation: each `forbidden` contract is run
by import-linter itself on a small tree of the same package names in which one of its source modules
imports one of its forbidden modules, and must come back broken (and kept without the plant)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
FORBIDDEN = [
    c for c in CONFIG["contracts"] if c["type"] == "forbidden" and c.get("allow_indirect_imports") is not False
]


def _tree(tmp: Path, contract: dict, plant: bool) -> Path:
    mods = {*CONFIG["root_packages"], *contract["source_modules"], *contract["forbidden_modules"]}
    for mod in sorted(mods):
        if mod.split(".")[0] not in CONFIG["root_packages"]:
            continue  # an external package (sqlalchemy, ...): not part of the tree
        pkg = tmp.joinpath(*mod.split("."))
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").touch()
    if plant:
        src, bad = contract["source_modules"][0], contract["forbidden_modules"][0]
        tmp.joinpath(*src.split("."), "planted.py").write_text(f"import {bad}\n")
    lines = ["[tool.importlinter]", f"root_packages = {CONFIG['root_packages']!r}".replace("'", '"')]
    lines += ["include_external_packages = true", "", "[[tool.importlinter.contracts]]"]
    lines += [f"name = {contract['name']!r}".replace("'", '"'), 'type = "forbidden"']
    for key in ("source_modules", "forbidden_modules"):
        lines.append(f"{key} = {contract[key]!r}".replace("'", '"'))
    if "allow_indirect_imports" in contract:
        lines.append(f"allow_indirect_imports = {str(contract['allow_indirect_imports']).lower()}")
    cfg = tmp / "contracts.toml"
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def _lint(tmp: Path, cfg: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tmp)}
    lint = Path(sys.executable).parent / "lint-imports"
    return subprocess.run([str(lint), "--no-cache", str(cfg)], cwd=tmp, env=env, capture_output=True, text=True)


@pytest.mark.parametrize("contract", FORBIDDEN, ids=[c["name"][:40] for c in FORBIDDEN])
def test_a_planted_import_breaks_the_contract(tmp_path: Path, contract: dict) -> None:
    clean = _lint(tmp_path, _tree(tmp_path, contract, plant=False))
    assert clean.returncode == 0, clean.stdout[-1500:]
    broken = _lint(tmp_path, _tree(tmp_path, contract, plant=True))
    assert broken.returncode != 0 and "BROKEN" in broken.stdout, broken.stdout[-1500:]
