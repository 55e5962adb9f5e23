"""One table, every engine: the same requests through llama.cpp's sampler_plan, the exllamav2 and
exllamav3 mappings and the null/paced engines' capabilities. For each request an engine either
honours the parameter (its mapping carries the value) or refuses it up front (capabilities.unsupported
names it, which the API turns into a 400): never a silent difference. REFUSED states where they differ.

Then the promises every model engine keeps (DESIGN.md, "Engines and models"): presence/frequency over
the output only, logprobs of the model's own row, the EOS token reported, prefix reuse and
`cached_tokens` within one tenant. PROMISES names, per engine, the test that shows each one on that
engine's real code path (the GPU engines': the pinned libraries' own generators, CUDA stubbed); the
mapping-level half of the penalty promise is checked here for every engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.generation import capabilities
from core.generation.params import GenerationParams
from workers.engine import exl2_mapping, exl3_mapping
from workers.engine.llamacpp import SEES_PROMPT, sampler_plan

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
        "presence": exl2_mapping.output_penalties(p)[0] == 0.5,  # applied by the job, over the output
        "frequency": exl2_mapping.output_penalties(p)[1] == 0.5,
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


# -- promises ---------------------------------------------------------------------------------------
GPU = "tests/unit/test_gpu_promises.py"
LLAMA = "tests/integration/test_llamacpp_engine.py"
PROMISES: dict[str, dict[str, str | None]] = {
    "presence and frequency count the output only": {
        "llamacpp": "tests/e2e/test_clients.py::"
        "test_presence_penalty_ignores_the_prompt_and_repetition_penalty_does_not",
        "exllamav2": f"{GPU}::test_presence_frequency_count_the_output_only",
        "exllamav3": f"{GPU}::test_presence_frequency_count_the_output_only",
    },
    "logprobs of the model's row, before penalties, bias and the blocked EOS": {
        "llamacpp": None,  # a gap: no test pins it on the CPU engine yet (it reads its row before sampling)
        "exllamav2": f"{GPU}::test_logprobs_of_the_model_row_and_the_eos_token_reported",
        "exllamav3": f"{GPU}::test_logprobs_of_the_model_row_and_the_eos_token_reported",
    },
    "the EOS token that ends a sequence is reported": {
        "llamacpp": "tests/integration/test_eos_count.py::"
        "test_the_end_of_sequence_token_is_counted_and_marked_on_the_last_delta",
        "exllamav2": f"{GPU}::test_logprobs_of_the_model_row_and_the_eos_token_reported",
        "exllamav3": f"{GPU}::test_logprobs_of_the_model_row_and_the_eos_token_reported",
    },
    "prefix reuse and cached_tokens within one tenant only": {
        "llamacpp": f"{LLAMA}::test_prompt_prefixes_are_reused_only_within_a_tenant",
        "exllamav2": f"{GPU}::test_same_long_prompt_two_tenants_no_reuse_across_reuse_within",
        "exllamav3": f"{GPU}::test_same_long_prompt_two_tenants_no_reuse_across_reuse_within",
    },
}
KNOWN_GAPS = {("logprobs of the model's row, before penalties, bias and the blocked EOS", "llamacpp")}
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("promise", sorted(PROMISES))
def test_every_model_engine_shows_every_promise(promise: str) -> None:
    """Each engine that samples from a model names the test that shows the promise, and it exists;
    a missing one is a stated gap, not a silent one."""
    shown = PROMISES[promise]
    assert set(shown) == set(HONOURS), f"{promise!r}: an engine is missing from the table"
    for engine, ref in shown.items():
        if ref is None:
            assert (promise, engine) in KNOWN_GAPS
            continue
        path, _, name = ref.partition("::")
        assert f"def {name}(" in (ROOT / path).read_text(), f"{engine}: {ref} does not exist"


@pytest.mark.parametrize("engine", sorted(HONOURS))
def test_presence_and_frequency_reach_the_engine_as_output_only_penalties(engine: str) -> None:
    """The mapping half of the penalty promise: no engine hands presence or frequency to a sampler
    that sees the prompt. llama.cpp: its own penalties sampler fed generated tokens only. exllamav2:
    its sampler's penalty pass (one range, prompt included) gets zero, the job applies them over the
    output. exllamav3: ComboSampler's step keeps them, its range cut to the output before each token."""
    p = GenerationParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1)
    if engine == "llamacpp":
        plan = dict(sampler_plan(p, 1, 1000, 4096))
        assert plan["output_penalties"][2:] == (1.0, 0.25, 0.5)  # no repetition, frequency, presence
        assert plan["penalties"][2:] == (1.1, 0.0, 0.0)  # the one that sees the prompt: repetition only
        assert "output_penalties" not in SEES_PROMPT and "penalties" in SEES_PROMPT
    elif engine == "exllamav2":
        s = exl2_mapping.sampler_settings(p)
        assert (s["token_repetition_penalty"], s["token_presence_penalty"], s["token_frequency_penalty"]) == (
            1.1,
            0.0,
            0.0,
        )
        assert exl2_mapping.output_penalties(p) == (0.5, 0.25)
    else:
        a = exl3_mapping.sampler_args(p)
        assert (a["rep_p"], a["pres_p"], a["freq_p"]) == (1.1, 0.5, 0.25)
        assert exl3_mapping.output_window(p) == exl3_mapping.WHOLE_SEQUENCE
        assert exl3_mapping.output_window(GenerationParams(presence_penalty=0.5, penalty_last_n=64)) == 64


# Where engines honour a parameter with a documented difference that is not a 400 (docs/parameters.md
# says each): the order of the repetition penalty and the output-only presence/frequency penalties.
# llama.cpp and exllamav3 apply repetition first; exllamav2's job subtracts presence/frequency from the
# model's row before handing it to the library's sampler, whose one penalty pass (repetition) follows.
PENALTY_ORDER = {
    "llamacpp": ("repetition", "presence/frequency"),
    "exllamav3": ("repetition", "presence/frequency"),
    "exllamav2": ("presence/frequency", "repetition"),
}


def test_the_penalty_order_of_each_engine_is_the_documented_one() -> None:
    from workers.engine.exllamav3 import sampler_class  # noqa: F401  (only its docstring is read here)

    p = GenerationParams(temperature=1.0, repetition_penalty=1.1, presence_penalty=0.5)
    # exllamav3: ComboSampler's stack order is the library's (rep, then pres/freq); the mapping sets both.
    args = exl3_mapping.sampler_args(p)
    assert (args["rep_p"], args["pres_p"]) == (1.1, 0.5)
    # exllamav2: the sampler gets the repetition penalty only; presence/frequency go to the job.
    settings = exl2_mapping.sampler_settings(p)
    assert settings["token_repetition_penalty"] == 1.1 and settings["token_presence_penalty"] == 0.0
    assert exl2_mapping.output_penalties(p) == (0.5, 0.0)
    doc = (Path(__file__).resolve().parents[2] / "docs/parameters.md").read_text()
    assert "before the repetition penalty" in doc and PENALTY_ORDER["exllamav2"][0] == "presence/frequency"
