"""One table, every engine: the same requests through llama.cpp's sampler_plan, the exllamav2 and
exllamav3 mappings and the null/paced engines' capabilities. For each request an engine either
honours the parameter (its mapping carries the value) or refuses it up front (capabilities.unsupported
names it, which the API turns into a 400): never a silent difference. REFUSED states where they differ.
"""

from __future__ import annotations

from typing import Any

import pytest

from core.generation import capabilities
from core.generation.params import GenerationParams
from workers.engine import exl2_mapping, exl3_mapping
from workers.engine.llamacpp import sampler_plan

# request (GenerationParams fields) -> the parameter name a refusal would carry
REQUESTS: dict[str, tuple[dict[str, Any], str]] = {
    "temperature": ({"temperature": 0.7}, "temperature"),
    "top_k": ({"temperature": 1.0, "top_k": 40}, "top_k"),
    "top_p": ({"temperature": 1.0, "top_p": 0.9}, "top_p"),
    "min_p": ({"temperature": 1.0, "min_p": 0.05}, "min_p"),
    "typical_p": ({"temperature": 1.0, "typical_p": 0.9}, "typical_p"),
    "mirostat2": ({"temperature": 1.0, "mirostat": 2}, "mirostat"),
    "mirostat1": ({"temperature": 1.0, "mirostat": 1}, "mirostat"),
    "dry": ({"temperature": 1.0, "dry_multiplier": 0.8}, "dry_multiplier"),
    "presence": ({"temperature": 1.0, "presence_penalty": 0.5}, "presence_penalty"),
    "frequency": ({"temperature": 1.0, "frequency_penalty": 0.5}, "frequency_penalty"),
    "repetition": ({"temperature": 1.0, "repetition_penalty": 1.1}, "repetition_penalty"),
    "repeat_last_n": ({"temperature": 1.0, "repetition_penalty": 1.1, "penalty_last_n": 64}, "repeat_last_n"),
    "logit_bias": ({"temperature": 1.0, "logit_bias": {3: 2.0}}, "logit_bias"),
}

# Where engines differ: (engine, request) pairs refused with a 400. Everything else is honoured.
REFUSED = {
    ("exllamav2", "mirostat1"),  # exllamav2 has Mirostat 2.0 only
    ("exllamav2", "repeat_last_n"),  # its penalty window is the whole sequence
    ("exllamav3", "typical_p"),  # ComboSampler has no typical sampling
    ("exllamav3", "mirostat2"),  # ... nor Mirostat
    ("exllamav3", "mirostat1"),
}


def llamacpp_honours(name: str, p: GenerationParams) -> bool:
    plan = dict(sampler_plan(p, 1, 1000, 4096))
    return {
        "temperature": plan.get("temp") == (0.7,),
        "top_k": plan.get("top_k") == (40,),
        "top_p": plan.get("top_p", (None,))[0] == 0.9,
        "min_p": plan.get("min_p", (None,))[0] == 0.05,
        "typical_p": plan.get("typical", (None,))[0] == 0.9,
        "mirostat2": "mirostat_v2" in plan,
        "mirostat1": "mirostat" in plan,
        "dry": plan.get("dry", (None,))[0] == 0.8,
        "presence": 0.5 in plan.get("output_penalties", ()),
        "frequency": 0.5 in plan.get("output_penalties", ()),
        "repetition": 1.1 in plan.get("penalties", ()),
        "repeat_last_n": 64 in plan.get("penalties", ()),
        "logit_bias": "logit_bias" in plan,
    }[name]


def exl2_honours(name: str, p: GenerationParams) -> bool:
    s = exl2_mapping.sampler_settings(p, frozenset())
    return {
        "temperature": s["temperature"] == 0.7,
        "top_k": s["top_k"] == 40,
        "top_p": s["top_p"] == 0.9,
        "min_p": s["min_p"] == 0.05,
        "typical_p": s["typical"] == 0.9,
        "mirostat2": s["mirostat"] is True,
        "mirostat1": False,
        "dry": s["dry_multiplier"] == 0.8,
        "presence": s["token_presence_penalty"] == 0.5,
        "frequency": s["token_frequency_penalty"] == 0.5,
        "repetition": s["token_repetition_penalty"] == 1.1,
        "repeat_last_n": s["token_repetition_range"] == 64,
        "logit_bias": bool(s["token_bias"]),
    }[name]


def exl3_honours(name: str, p: GenerationParams) -> bool:
    try:
        a = exl3_mapping.sampler_args(p)
    except exl3_mapping.Unsupported:
        return False
    return {
        "temperature": a["temperature"] == 0.7,
        "top_k": a["top_k"] == 40,
        "top_p": a["top_p"] == 0.9,
        "min_p": a["min_p"] == 0.05,
        "typical_p": False,
        "mirostat2": False,
        "mirostat1": False,
        "dry": a.get("dry_multiplier") == 0.8,
        "presence": a["pres_p"] == 0.5,
        "frequency": a["freq_p"] == 0.5,
        "repetition": a["rep_p"] == 1.1,
        "repeat_last_n": a["rep_sustain_range"] == 64,
        "logit_bias": bool(a["logit_bias"]),
    }[name]


HONOURS = {"llamacpp": llamacpp_honours, "exllamav2": exl2_honours, "exllamav3": exl3_honours}


@pytest.mark.parametrize("engine", sorted(HONOURS))
@pytest.mark.parametrize("request_name", sorted(REQUESTS))
def test_honoured_or_refused_never_silent(engine: str, request_name: str) -> None:
    fields, refused_as = REQUESTS[request_name]
    p = GenerationParams(**fields)
    refused = refused_as in capabilities.unsupported(engine, p)
    assert refused == ((engine, request_name) in REFUSED), "the table of differences is out of date"
    if not refused:
        assert HONOURS[engine](request_name, p), f"{engine} neither honours nor refuses {request_name}"


@pytest.mark.parametrize("engine", ["null", "paced"])
def test_modelless_engines_refuse_what_needs_logits(engine: str) -> None:
    """The null and paced engines (tests, load rehearsal) have no model: sampling parameters do not
    apply to their canned tokens; grammar and prompt scoring, which would be wrong, are refused."""
    assert capabilities.unsupported(engine, GenerationParams(grammar='root ::= "a"', prompt_logprobs=1)) == [
        "grammar",
        "prompt_logprobs",
    ]
    for fields, _ in REQUESTS.values():
        assert capabilities.unsupported(engine, GenerationParams(**fields)) == []
