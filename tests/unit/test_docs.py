"""The README's configuration table and commands stay true to the code."""

from __future__ import annotations

from pathlib import Path

from core.config import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_is_documented():
    missing = [f"SPOOL_{n.upper()}" for n in Settings.model_fields if f"`SPOOL_{n.upper()}`" not in README]
    assert not missing, f"README lacks {missing}"


def test_quick_start_commands_exist():
    root = Path(__file__).resolve().parents[2]
    assert "bash ops/run.sh" in README and (root / "ops/run.sh").exists()
    assert "bash ops/test.sh" in README and (root / "ops/test.sh").exists()
    assert "ops/test.sh" in (root / ".ci/run").read_text()


def test_the_quick_start_installs_only_what_serving_needs():
    """ops/run.sh serves: it must not pull the test/eval extras (lm-eval, torch, selenium) onto a host."""
    root = Path(__file__).resolve().parents[2]
    run, boot, test = ((root / "ops" / f).read_text() for f in ("run.sh", "bootstrap.sh", "test.sh"))
    assert "SPOOL_EXTRAS" not in run and "bash ops/bootstrap.sh" in run
    assert "EXTRAS=${SPOOL_EXTRAS:-cpu}" in boot
    assert "EXTRAS=cpu,test,bench,eval" in test and "SPOOL_EXTRAS=$EXTRAS bash ops/bootstrap.sh" in test
    assert "nvidia-smi -L" in test and 'EXTRAS="$EXTRAS,gpu"' in test  # a CUDA host runs tests/gpu


def _named_paths(text: str) -> set[str]:
    """Repository paths a text names: `core/jobs/lifecycle.py`, `core/infra/streams.Hub` (a module
    and one of its names), `tests/e2e/`..."""
    import re

    return set(re.findall(r"(?<![\w./-])((?:api|core|workers|ops|tests|migrations|docs)/[\w./-]*\w)", text))


def _exists(root: Path, named: str) -> bool:
    path = named.split(":")[0]
    if (root / path).exists() or (root / f"{path}.py").exists():  # a package, or a module by its name
        return True
    module, _, _attr = path.rpartition(".")  # core/infra/streams.Hub -> core/infra/streams.py
    return bool(module) and (root / f"{module}.py").exists()


def test_every_path_named_in_docs_and_docstrings_exists():
    root = Path(__file__).resolve().parents[2]
    texts = [*root.glob("*.md"), *root.glob("docs/*.md")]
    texts += [p for pkg in ("api", "core", "workers", "ops") for p in (root / pkg).rglob("*.py")]
    missing = sorted(
        f"{f.relative_to(root)}: {named}"
        for f in texts
        for named in _named_paths(f.read_text(errors="replace"))
        if not _exists(root, named)
    )
    assert not missing, missing
