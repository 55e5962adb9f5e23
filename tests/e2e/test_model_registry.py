"""Two models served at once from a registry file, each with its own worker and queues: one with the
GGUF's vocabulary, one whose tokenizer folder holds only tokenizer.json (made from the GGUF, no
hub). Requests go to the right worker; the HF-tokenized model counts and answers exactly as the
GGUF one does; each model keeps its own context length."""

from __future__ import annotations

import os

import pytest

from core.registry import smollm2_gguf
from ops.harness import side_redis
from tests.conftest import MODEL, TEST_DB, job_row, running_stack, wait_for

pytest.importorskip("gguf")

HF_MODEL = "smollm2-hf"


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    from ops.tokenizer_from_gguf import export

    tok_dir = export(smollm2_gguf(), tmp_path_factory.mktemp("tok"))
    assert not list(tok_dir.glob("*.gguf"))
    registry = tmp_path_factory.mktemp("reg") / "models.toml"
    registry.write_text(
        f"""
[[models]]
id = "{MODEL}"
engine = "llamacpp"
n_ctx = 1024

[[models]]
id = "{HF_MODEL}"
engine = "llamacpp"
path = "{smollm2_gguf()}"
tokenizer = "{tok_dir}"
aliases = ["small"]
n_ctx = 512
"""
    )
    logs = tmp_path_factory.mktemp("registry-logs")
    db_url = TEST_DB.rsplit("/", 1)[0] + "/spool_registry"
    redis_url = side_redis("registry")
    with running_stack(
        logs, db_url, redis_url, extra_workers=({"SPOOL_WORKER_MODELS": HF_MODEL},), SPOOL_MODELS_FILE=str(registry)
    ) as st:
        yield st, st.procs["worker-extra1"].pid


def test_models_are_listed_with_their_own_context_and_workers(two_models):
    st, _ = two_models
    with st.http(st.keys["alpha"]) as http:
        data = {m["id"]: m for m in wait_for(lambda: _live(http), 30, "both live")}
    assert data[MODEL]["context_length"] == 1024 and data[HF_MODEL]["context_length"] == 512
    assert data["small"]["alias_of"] == HF_MODEL


def _live(http):
    data = http.get("/v1/models").json()["data"]
    return data if all(m["live_workers"] == 1 for m in data) else None


def test_each_model_is_answered_by_its_own_worker_with_the_same_tokens(two_models):
    st, hf_pid = two_models
    from sqlalchemy import create_engine

    db = create_engine(st.env["SPOOL_DATABASE_URL"])
    body = {"prompt": "Ünïcödé and digits 12345: once upon a time", "max_tokens": 12, "temperature": 0}
    with st.http(st.keys["alpha"]) as http:
        a = http.post("/v1/completions", json={"model": MODEL, **body}).json()
        b = http.post("/v1/completions", json={"model": "small", **body}).json()
    assert b["model"] == HF_MODEL
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]  # HF tokenizer == GGUF vocabulary
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # so the model saw the same tokens
    workers = {job_row(db, a["id"])["worker"], job_row(db, b["id"])["worker"]}
    assert len(workers) == 2 and any(w.endswith(f":{hf_pid}") for w in workers)
    assert job_row(db, b["id"])["worker"].endswith(f":{hf_pid}")
    db.dispose()


def test_the_hf_tokenizer_model_chats_with_the_template_from_its_folder(two_models):
    st, _ = two_models
    with st.http(st.keys["alpha"]) as http:
        r = http.post(
            "/v1/chat/completions",
            json={"model": HF_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        )
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"


def test_each_model_keeps_its_own_context_length(two_models):
    st, _ = two_models
    prompt = "word " * 600  # ~600 tokens: fits 1024, not 512
    with st.http(st.keys["alpha"]) as http:
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        refused = http.post("/v1/completions", json={"model": HF_MODEL, "prompt": prompt, "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert "512" in refused.json()["error"]["message"]


def test_a_worker_consumes_only_its_models_queues(two_models):
    st, _ = two_models
    assert os.environ.get("SPOOL_WORKER_MODELS") is None  # the first worker took the default: the first model
    log = (st.logdir / "worker1.log").read_text(errors="replace")
    assert f"spool.model.{MODEL}.interactive" in log and f"spool.model.{HF_MODEL}" not in log
