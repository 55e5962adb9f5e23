"""Contract test: everything the GPU adapters call on exllamav2 / exllamav3 exists in the pinned
releases with those keyword arguments, checked with inspect.signature against the real packages.

The pinned wheels (versions read from pyproject's `gpu` extra) are installed with --no-deps into
.venv/gpu-contract/ (ops/test-tools.sh, or here on first use). Their CUDA extensions and triton are
stubbed, and the inspection runs in a subprocess so the stubs never leak into this process. Keyword
names come from calling the mappings themselves (exl2_mapping / exl3_mapping), so a field added there
is checked here without editing this file; a version bump that renames or drops any of them fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from core.generation.params import GenerationParams
from workers.engine import exl2_mapping, exl3_mapping
from workers.engine.base import SeqSpec

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / ".venv" / "gpu-contract"

# What the engines call directly (besides the mappings' keyword sets, added below): target, keyword
# names, and methods that must exist. Targets are "module:Qualified.name".
EXL2_DIRECT: list[tuple[str, list[str], list[str]]] = [
    ("exllamav2:ExLlamaV2Config", [], ["arch_compat_overrides"]),
    ("exllamav2:ExLlamaV2", [], ["load_autosplit", "forward"]),
    ("exllamav2:ExLlamaV2.load_autosplit", ["progress"], []),
    ("exllamav2:ExLlamaV2Tokenizer", [], ["encode", "get_id_to_piece_list"]),
    ("exllamav2:ExLlamaV2Tokenizer.encode", ["add_bos", "encode_special_tokens"], []),
    (
        "exllamav2.generator:ExLlamaV2DynamicGenerator",
        ["model", "cache", "tokenizer", "max_batch_size", "max_seq_len", "max_chunk_size", "paged"],
        ["warmup", "cancel", "iterate", "num_remaining_jobs", "clear_queue", "enqueue"],
    ),
    (
        "exllamav2.generator.filters:ExLlamaV2Filter",
        [],
        [
            "clone",
            "begin",
            "feed",
            "use_background_worker",
            "can_mask_logits",
            "prepare_logit_mask",
            "mask_logits",
            "next",
        ],
    ),
    *[(f"exllamav2:{cls}", ["max_seq_len", "lazy"], []) for cls in sorted(set(exl2_mapping.CACHE_CLASSES.values()))],
    (  # what exllamav2.job_class overrides (the tenant-scoped prefix cache, logprobs, output penalties)
        "exllamav2.generator:ExLlamaV2DynamicJob",
        [],
        ["prepare_for_queue", "allocate_pages", "deallocate_pages", "prefill", "receive_logits", "receive_sample"],
    ),
    ("exllamav2.generator.dynamic:ExLlamaV2DynamicJob.prepare_for_queue", ["generator", "serial_number"], []),
    ("exllamav2.generator.dynamic:CachePage", ["prev_hash", "kv_position_revert", "can_revert", "ref_count"], []),
]
EXL3_DIRECT: list[tuple[str, list[str], list[str]]] = [  # workers/engine/exllamav3.py
    ("exllamav3:Config.from_directory", [], []),
    ("exllamav3:Model.from_config", [], []),
    ("exllamav3.model.model:Model.load_gen", ["progressbar", "max_chunk_size"], []),
    ("exllamav3:Cache", ["max_num_tokens"], []),
    ("exllamav3:Tokenizer.from_config", [], []),
    ("exllamav3:Tokenizer.encode", ["add_bos", "encode_special_tokens"], []),
    (
        "exllamav3:Generator",
        ["model", "cache", "tokenizer", "max_batch_size", "max_chunk_size"],
        ["enqueue", "iterate", "cancel", "num_remaining_jobs", "clear_queue"],
    ),
    ("exllamav3:Filter", [], ["reset", "accept_token", "rollback_tokens", "get_next_logit_mask", "is_completed"]),
    ("exllamav3:Filter.__init__", ["tokenizer", "trigger_token", "prefix_str", "eos_after_completed"], []),
    (  # what exllamav3.job_class and sampler_class override
        "exllamav3:Job",
        [],
        ["prepare_for_queue", "hash_completed_page", "allocate_pages", "deallocate_pages", "prefill"],
    ),
    ("exllamav3.generator.pagetable:CachePage", ["prev_hash", "can_revert", "ref_count"], []),
    ("exllamav3:ComboSampler.forward", ["logits", "sequence_ids"], []),
    ("exllamav3.generator.sampler.custom:SS_PresFreqP", ["pres_p", "freq_p", "sustain_range", "decay_range"], []),
]
EXL2_ATTRS = ["exllamav2.attn:has_flash_attn_with_paged", "exllamav2.generator.dynamic:_tensor_hash_checksum"]
EXL3_ATTRS = [
    "exllamav3.generator.job:tensor_hash_checksum",  # wrapped by gpu_plan.salted_checksum
    "exllamav3.generator.pagetable:tensor_hash_checksum",
    "exllamav3.generator.pagetable:CachePage.__dataclass_fields__",
    "exllamav3:CustomSampler",
]


def pins() -> dict[str, str]:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    out = {}
    for req in extra:
        m = re.fullmatch(r"(exllamav[23])==([\w.]+)", req.strip())
        if m:
            out[m[1]] = m[2]
    assert set(out) == {"exllamav2", "exllamav3"}, f"the gpu extra must pin exllamav2 and exllamav3 exactly: {extra}"
    return out


def installed(p: dict[str, str]) -> bool:
    return all(any(TARGET.glob(f"{name}-{ver}.dist-info")) for name, ver in p.items())


@pytest.fixture(scope="session")
def contract_path() -> Path:
    p = pins()
    if not installed(p):
        reqs = [f"{name}=={ver}" for name, ver in sorted(p.items())]
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(TARGET), *reqs],
            check=True,
        )
    assert installed(p)
    return TARGET


INSPECT = r"""
import importlib, inspect, json, sys, types
from unittest import mock

class Stub(types.ModuleType):  # a compiled extension / triton: any attribute is a mock
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return mock.MagicMock(name=name)

for name in ("exllamav2.ext", "exllamav3.ext", "triton", "triton.language"):
    sys.modules[name] = Stub(name)

def resolve(target):
    mod, _, qual = target.partition(":")
    obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj

spec = json.load(sys.stdin)
problems = []
for target, kwargs, methods in spec["calls"]:
    try:
        obj = resolve(target)
    except Exception as e:
        problems.append(f"{target}: not found ({type(e).__name__}: {e})")
        continue
    if kwargs:
        params = inspect.signature(obj).parameters
        named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        # A **kwargs catch-all would swallow a renamed argument silently: names must be explicit.
        problems += [f"{target}: no keyword argument {k!r}" for k in kwargs if k not in named]
    problems += [f"{target}: no method {m!r}" for m in methods if not callable(getattr(obj, m, None))]
for target in spec["attrs"]:
    try:
        resolve(target)
    except Exception as e:
        problems.append(f"{target}: not found ({type(e).__name__})")
from importlib.metadata import version
versions = {m: version(m) for m in ("exllamav2", "exllamav3")}
origins = {m: importlib.import_module(m).__file__ for m in ("exllamav2", "exllamav3")}
print(json.dumps({"problems": problems, "versions": versions, "origins": origins}))
"""


def check(contract_path: Path, calls: list[tuple[str, list[str], list[str]]], attrs: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(contract_path)}
    out = subprocess.run(
        [sys.executable, "-c", INSPECT],
        input=json.dumps({"calls": calls, "attrs": attrs}),
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def sample_spec(**kw: object) -> SeqSpec:
    return SeqSpec(key=("j", 0, 0), prompt_ids=[1, 2, 3], max_new_tokens=8, params=GenerationParams(**kw), seed=7)


def test_exllamav2_contract(contract_path: Path) -> None:
    # Every optional setting switched on, so each keyword the mapping can emit is present.
    p = GenerationParams(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, typical_p=0.9, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=0.2, mirostat=2, dry_multiplier=0.8, logit_bias={3: 1.0},
    )  # fmt: skip
    settings = sorted(exl2_mapping.sampler_settings(p, frozenset({1})))
    job = sorted(exl2_mapping.job_arguments(sample_spec(logprobs=3), [2]))
    calls = [
        *EXL2_DIRECT,
        ("exllamav2.generator:ExLlamaV2Sampler.Settings", settings, []),
        ("exllamav2.generator:ExLlamaV2DynamicJob", ["input_ids", "gen_settings", "filters", *job], []),
    ]
    result = check(contract_path, calls, EXL2_ATTRS)
    assert result["versions"]["exllamav2"] == pins()["exllamav2"]
    assert result["origins"]["exllamav2"].startswith(str(contract_path))  # the real package, not a stub
    assert result["problems"] == []


def test_exllamav3_contract(contract_path: Path) -> None:
    p = GenerationParams(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=0.2, logit_bias={3: 1.0},
    )  # fmt: skip
    calls = [
        ("exllamav3:ComboSampler", sorted(exl3_mapping.sampler_args(p, frozenset({1}))), []),
        ("exllamav3:Tokenizer", [], ["get_id_to_piece_list"]),
        ("exllamav3:Job", ["input_ids", "sampler", *sorted(exl3_mapping.job_args(sample_spec(logprobs=3), [2]))], []),
        *EXL3_DIRECT,
    ]
    result = check(contract_path, calls, EXL3_ATTRS)
    assert result["versions"]["exllamav3"] == pins()["exllamav3"]
    assert result["origins"]["exllamav3"].startswith(str(contract_path))
    assert result["problems"] == []


def test_contract_catches_a_renamed_argument(contract_path: Path) -> None:
    """The check itself: a keyword the pinned release does not have is reported, not ignored
    (exllamav3's Job takes **kwargs, which would swallow it)."""
    result = check(contract_path, [("exllamav3:Job", ["input_ids", "max_new_token"], ["no_such_method"])], [])
    assert result["problems"] == [
        "exllamav3:Job: no keyword argument 'max_new_token'",
        "exllamav3:Job: no method 'no_such_method'",
    ]
