"""What each engine cannot honour, known to the API so it can refuse with a 400 naming the
parameter instead of silently ignoring it. The engines' adapters ask the same table."""

from __future__ import annotations

from core.generation.params import GenerationParams


def unsupported(engine: str, p: GenerationParams) -> list[str]:
    """GenerationParams field names this engine cannot honour for these values."""
    bad: list[str] = []
    if engine == "exllamav2" and p.mirostat == 1:
        bad.append("mirostat")  # exllamav2 has only Mirostat 2.0
    if engine in ("null", "paced"):  # no logits: nothing to constrain or to score
        bad += [name for name, on in (("grammar", p.grammar), ("prompt_logprobs", p.prompt_logprobs is not None)) if on]
    if engine == "exllamav2" and p.penalty_last_n is not None:
        bad.append("repeat_last_n")  # its penalty range is not mapped (the whole sequence only)
    if engine == "exllamav3":  # its sampler stack (1.6.5) has no typical-p or Mirostat
        bad += [name for name, on in (("typical_p", p.typical_p != 1.0), ("mirostat", p.mirostat != 0)) if on]
        # Its generator keeps no prompt logits and the engine has no scoring pass (yet): refused
        # here, before the job is stored, rather than failing the job in the worker.
        bad += [
            name
            for name, on in (
                ("prompt_logprobs", p.prompt_logprobs is not None),
                ("echo", p.echo and p.logprobs is not None),
            )
            if on
        ]
    return bad


# What the engines table shows: a request parameter (as the wire spells it) and values that set it.
PROBES: dict[str, dict[str, object]] = {
    "`temperature`, `top_p`, `top_k`, `min_p`": {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05},
    "`typical_p`": {"typical_p": 0.9},
    "`mirostat` 1": {"mirostat": 1},
    "`mirostat` 2": {"mirostat": 2},
    "`dry_multiplier`": {"dry_multiplier": 0.8},
    "`presence_penalty`, `frequency_penalty`": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "`repetition_penalty`": {"repetition_penalty": 1.1},
    "`repeat_last_n`": {"repetition_penalty": 1.1, "penalty_last_n": 64},
    "`logit_bias`": {"logit_bias": {3: 2.0}},
    "`response_format`, `tools` (a grammar)": {"grammar": 'root ::= "a"'},
    "`prompt_logprobs`": {"prompt_logprobs": 1},
    "`echo` with `logprobs`": {"echo": True, "logprobs": 1},
}


def markdown(engines: tuple[str, ...]) -> str:
    """docs/parameters.md's engines table: for each engine (core/registry.py's ENGINES), whether it
    honours each probed parameter or refuses it with a 400 (from `unsupported`; that an honoured one
    reaches the engine's sampler is tests/unit/test_cross_engine.py's). tests/unit/test_reference_tables.py
    keeps the doc's copy current; `python -m ops.docs` rewrites it."""
    rows = ["| parameter | " + " | ".join(f"`{e}`" for e in engines) + " |", "|---" * (len(engines) + 1) + "|"]
    for label, values in PROBES.items():
        p = GenerationParams.model_validate(values)
        cells = ["400" if unsupported(e, p) else "yes" for e in engines]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
