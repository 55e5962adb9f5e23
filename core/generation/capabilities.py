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
