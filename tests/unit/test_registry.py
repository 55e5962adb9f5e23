"""Which served model a client's `model` names."""

from __future__ import annotations

from core.config import Settings
from core.registry import aliases, resolve

M = "smollm2-135m-instruct"


def test_ids_and_aliases_resolve_unknown_names_do_not():
    s = Settings(model_aliases={"gpt-3.5-turbo": M, "ghost": "not-served"})
    assert resolve(M, s) == M and resolve("gpt-3.5-turbo", s) == M
    assert resolve("ghost", s) is None and resolve("llama", s) is None
    assert aliases(s) == {"gpt-3.5-turbo": M}


def test_a_single_model_deployment_may_accept_any_name():
    assert resolve("whatever-the-client-sends", Settings(accept_any_model=True)) == M
    two = Settings(models=f"{M},other", accept_any_model=True)
    assert resolve("whatever", two) is None  # with two models a name must mean one of them
