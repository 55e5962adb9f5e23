"""GenerationParams -> llama.cpp sampler chain (pure: no model needed)."""

from __future__ import annotations

from core.generation.params import GenerationParams
from workers.engine.llamacpp import sampler_plan

V, CTX = 1000, 512


def names(**kw) -> list[str]:
    return [n for n, _ in sampler_plan(GenerationParams(**kw), 7, V, CTX)]


def test_defaults_are_plain_temperature_sampling():
    assert names() == ["temp", "dist"]


def test_greedy_skips_truncation_but_keeps_biases_and_penalties():
    assert names(temperature=0, top_k=5, logit_bias={1: 2.0}, presence_penalty=1.0) == [
        "logit_bias",
        "output_penalties",
        "greedy",
    ]


def test_full_chain_in_llama_server_order():
    got = names(
        top_k=40,
        typical_p=0.9,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        dry_multiplier=0.8,
        logit_bias={3: -100.0},
    )
    assert got == ["logit_bias", "penalties", "dry", "top_k", "typical", "top_p", "min_p", "temp", "dist"]


def test_mirostat_replaces_truncation_and_draw():
    assert names(mirostat=1, top_k=40) == ["temp", "mirostat"]
    assert names(mirostat=2) == ["temp", "mirostat_v2"]
    plan = dict(sampler_plan(GenerationParams(mirostat=2, mirostat_tau=3.0, mirostat_eta=0.2), 2**40 + 5, V, CTX))
    assert plan["mirostat_v2"] == (5, 3.0, 0.2)  # the seed is folded to llama.cpp's 32 bits


def test_arguments_carry_the_values():
    plan = dict(
        sampler_plan(
            GenerationParams(
                frequency_penalty=0.5,
                presence_penalty=-0.5,
                repetition_penalty=1.2,
                dry_multiplier=2.0,
                dry_base=1.5,
                dry_allowed_length=3,
                dry_sequence_breakers=("\n",),
            ),
            1,
            V,
            CTX,
        )
    )
    # repetition sees the prompt too; presence/frequency only the output: separate samplers
    assert plan["penalties"] == (V, CTX, 1.2, 0.0, 0.0)
    assert plan["output_penalties"] == (V, CTX, 1.0, 0.5, -0.5)
    assert plan["dry"] == (2.0, 1.5, 3, CTX, ("\n",))
    assert plan["dist"] == (1,)


def test_a_penalty_window_is_never_larger_than_the_context():
    """llama.cpp allocates the window as a ring buffer per sampler: 250M tokens would be gigabytes."""
    plan = dict(
        sampler_plan(
            GenerationParams(repetition_penalty=1.1, frequency_penalty=0.5, penalty_last_n=250_000_000, temperature=0),
            7,
            V,
            CTX,
        )
    )
    assert plan["penalties"][1] == CTX and plan["output_penalties"][1] == CTX
    small = dict(sampler_plan(GenerationParams(repetition_penalty=1.1, penalty_last_n=64), 7, V, CTX))
    assert small["penalties"][1] == 64
