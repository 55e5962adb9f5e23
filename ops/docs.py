"""The reference tables the docs show, each generated from the code that enumerates it and kept between
`<!-- NAME:begin -->` and `<!-- NAME:end -->` markers in one doc (tests/unit/test_reference_tables.py
fails when one is stale).

    python -m ops.docs          # rewrite every table in place
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _metrics() -> str:
    from core.infra import metrics

    return metrics.markdown()


def _cli() -> str:
    from core.cli.main import commands_markdown

    return commands_markdown()


def _engines() -> str:
    from core.generation import capabilities
    from core.registry import ENGINES

    return capabilities.markdown(ENGINES)


def _routes() -> str:
    from api import costs
    from api.app import create_app
    from core.config import Settings

    return costs.markdown(create_app(), Settings())


def _sdk_params() -> str:
    from core.protocol import sdk_params

    return sdk_params.markdown().removesuffix("\n")


# name -> (the doc that holds it, what makes it)
TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "metrics": ("docs/operations.md", _metrics),
    "cli": ("README.md", _cli),
    "engines": ("docs/parameters.md", _engines),
    "routes": ("docs/reliability.md", _routes),
    "sdk-params": ("docs/parameters.md", _sdk_params),
}


def markers(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- {re.escape(name)}:begin -->\n)(.*?)(\n<!-- {re.escape(name)}:end -->)", re.S)


def shown(text: str, name: str) -> str | None:
    """The table a doc holds between NAME's markers (None: no markers, or more than one pair)."""
    found = markers(name).findall(text)
    return found[0][1] if len(found) == 1 else None


def _between(table: str) -> Callable[[re.Match[str]], str]:
    return lambda m: m.group(1) + table + m.group(3)


def write(root: Path = ROOT) -> list[str]:
    """Rewrite every table in its doc; the names of those that changed."""
    changed = []
    for name, (doc, make) in TABLES.items():
        path = root / doc
        text = path.read_text()
        if shown(text, name) is None:
            raise SystemExit(f"{doc}: no single pair of {name} markers")
        table = make()
        new = markers(name).sub(_between(table), text)
        if new != text:
            path.write_text(new)
            changed.append(name)
    return changed


if __name__ == "__main__":
    print("rewritten:", ", ".join(write()) or "none")
    sys.exit(0)
