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


def test_a_workers_batch_slots_follow_its_models_registry_batch(tmp_path):
    """The heartbeat advertised the global SPOOL_MAX_BATCH: a GPU model whose registry entry sets a
    bigger batch was fed fewer lines than its engine decodes at once."""
    from workers.runtime import batch_slots

    registry_file = tmp_path / "models.toml"
    registry_file.write_text(
        f'[[models]]\nid = "{M}"\nengine = "null"\n\n[[models]]\nid = "wide"\nengine = "null"\nmax_batch = 48\n'
    )
    s = Settings(models_file=str(registry_file), max_batch=16, batch_prefetch=3)
    assert batch_slots("wide", s) == 48 + 3
    assert batch_slots(M, s) == 16 + 3  # no batch of its own: the deployment's


def test_by_default_a_worker_prefetches_half_its_batch_and_has_threads_for_every_line(tmp_path):
    """Lines of equal length end in the same step: with 2 spare lines a 64-wide engine decoded nearly
    empty until the dispatcher refilled it (2,000 lines x 64 tokens: 0.897 of the engine's exact time
    with 2, 0.925 with 32; BENCHMARKS.md). Its threads cover every line it may hold, plus the
    interactive ones, unless set."""
    from workers.runtime import batch_slots

    registry_file = tmp_path / "models.toml"
    registry_file.write_text(f'[[models]]\nid = "{M}"\nengine = "null"\nmax_batch = 64\n')
    s = Settings(models_file=str(registry_file), max_batch=16, interactive_slots=4)
    assert s.prefetch_for(64) == 32 and s.prefetch_for(2) == 2
    assert batch_slots(M, s) == 64 + 32
    assert s.threads_for(batch_slots(M, s)) == 96 + 4 + 4
    assert Settings(worker_concurrency=40).threads_for(96) == 40  # set: as set
