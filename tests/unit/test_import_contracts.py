"""The import contracts in pyproject.toml fail on a planted violation: each contract is run by
import-linter itself on a small tree of the same package names in which one module imports what the
contract forbids, and must come back broken (and kept without the plant): a `forbidden` contract's
source importing its forbidden module; an `independence` contract's modules importing each other; a
`layers` contract's lowest layer importing its highest, and each side of an `a | b` layer the other."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
FORBIDDEN = [c for c in CONFIG["contracts"] if c["type"] == "forbidden"]


def _tree(tmp: Path, contract: dict, plant: bool) -> Path:
    mods = {*CONFIG["root_packages"], *contract["source_modules"], *contract["forbidden_modules"]}
    for mod in sorted(mods):
        if mod.split(".")[0] not in CONFIG["root_packages"]:
            continue  # an external package (sqlalchemy, ...): not part of the tree
        parts = mod.split(".")
        for n in range(1, len(parts) + 1):  # every package on the way, not only the last
            pkg = tmp.joinpath(*parts[:n])
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


def _config(tmp: Path, contract: dict, mods: set[str], plant: tuple[str, str] | None) -> Path:
    """A tree of `mods` (every package on the way), optionally with `plant` = (module, what it imports),
    and a config holding `contract` alone (its own keys, ignore_imports left out: the tree is bare)."""
    for mod in sorted(mods | set(CONFIG["root_packages"])):
        parts = mod.split(".")
        for n in range(1, len(parts) + 1):
            pkg = tmp.joinpath(*parts[:n])
            pkg.mkdir(parents=True, exist_ok=True)
            (pkg / "__init__.py").touch()
    if plant:
        src, bad = plant
        tmp.joinpath(*src.split("."), "planted.py").write_text(f"import {bad}\n")
    lines = ["[tool.importlinter]", f"root_packages = {CONFIG['root_packages']!r}".replace("'", '"'), ""]
    lines += ["[[tool.importlinter.contracts]]", f"name = {contract['name']!r}".replace("'", '"')]
    for key, value in contract.items():
        if key not in ("name", "ignore_imports"):
            lines.append(f"{key} = {value!r}".replace("'", '"').replace("False", "false").replace("True", "true"))
    cfg = tmp / "contracts.toml"
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


OTHERS = [c for c in CONFIG["contracts"] if c["type"] in ("independence", "layers")]


def _plants(contract: dict) -> tuple[set[str], list[tuple[str, str]]]:
    """The modules a contract names, and the imports that must each break it: for independence, one
    module importing another; for layers, the lowest layer importing the highest, and each side of a
    `a | b` layer importing the other."""
    if contract["type"] == "independence":
        mods = contract["modules"]
        return set(mods), [(mods[0], mods[1]), (mods[1], mods[0])]
    layers = [[m.strip() for m in layer.split("|")] for layer in contract["layers"]]
    plants = [(layers[-1][0], layers[0][0])]
    plants += [(layer[0], layer[1]) for layer in layers if len(layer) > 1]
    return {m for layer in layers for m in layer}, plants


@pytest.mark.parametrize("contract", OTHERS, ids=[c["name"][:40] for c in OTHERS])
def test_a_planted_import_breaks_the_independence_and_layer_contracts(tmp_path: Path, contract: dict) -> None:
    mods, plants = _plants(contract)
    clean = _lint(tmp_path / "clean", _config(tmp_path / "clean", contract, mods, None))
    assert clean.returncode == 0, clean.stdout[-1500:]
    for n, plant in enumerate(plants):
        tree = tmp_path / f"planted{n}"
        broken = _lint(tree, _config(tree, contract, mods, plant))
        assert broken.returncode != 0 and "BROKEN" in broken.stdout, (plant, broken.stdout[-1500:])
