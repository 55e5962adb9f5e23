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
