"""EleutherAI's lm-evaluation-harness, unchanged, against Spool: `local-completions` with token-array
prompts and 4 concurrent requests, on a multiple-choice and a generation task of our own (no hub:
the tasks read local JSON, the tokenizer is made from the bundled GGUF). Every loglikelihood it
computes must equal the one computed in-process from the same model within 1e-3 nats."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import MODEL

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the `eval` extra (lm_eval, gguf): installed by ops/bootstrap.sh unless SPOOL_SKIP_EVAL=1",
)

TASKS = Path(__file__).parent / "lm_eval_tasks"


def _in_process_loglikelihood(llm, ids: list[int], ctxlen: int) -> float:
    """Sum of log p(token | everything before it) over the continuation, from llama.cpp's logits, with
    the engine's arithmetic: flash attention on (llama.cpp's default on CPU, and the CPU engine's).
    Without it the same model differs by up to ~0.1 nats per token on this prompt set (measured)."""
    llm.reset()
    llm.eval(ids)
    scores = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
    total = 0.0
    for pos in range(ctxlen, len(ids)):
        row = scores[pos - 1]
        total += float(row[ids[pos]] - (row.max() + math.log(np.exp(row - row.max()).sum())))
    return total


@pytest.fixture
def llm():
    """The model in this process, closed after the test (one left to the interpreter's exit is
    finalized after llama-cpp-python's modules, and prints a TypeError from `Llama.__del__`)."""
    from llama_cpp import Llama

    from core.registry import smollm2_gguf

    model = Llama(str(smollm2_gguf()), n_ctx=1024, logits_all=True, flash_attn=True, verbose=False)
    yield model
    model.close()


def test_lm_eval_local_completions_scores_what_the_model_computes(stack, llm, tmp_path):
    from core.registry import smollm2_gguf
    from ops.tokenizer_from_gguf import export

    tok_dir = export(smollm2_gguf(), tmp_path / "tokenizer")
    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS, tasks)
    for y in tasks.glob("*.yaml"):
        y.write_text(y.read_text().replace("__DIR__", str(tasks)))
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OPENAI_API_KEY": stack.keys["alpha"],
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
    }
    model_args = ",".join(
        [
            f"model={MODEL}",
            f"base_url={stack.base_url}/v1/completions",
            "num_concurrent=4",
            "max_retries=2",
            "tokenized_requests=True",
            "tokenizer_backend=huggingface",
            f"tokenizer={tok_dir}",
            "max_length=1024",
        ]
    )
    run = subprocess.run(
        [
            sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
            "--tasks", "spool_mc,spool_gen", "--include_path", str(tasks), "--output_path", str(out),
            "--log_samples", "--batch_size", "1",
        ],
        env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]

    mc_file = next(out.rglob("samples_spool_mc_*.jsonl"))
    mc = [json.loads(line) for line in mc_file.read_text().splitlines()]
    assert len(mc) == 10
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    worst = 0.0
    for s in mc:
        pairs = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
        for (context, continuation), resp in zip(pairs, s["resps"], strict=True):
            loglik = float(resp[0][0])
            assert loglik < 0, (context, continuation, loglik)  # never 0 (a dropped token) or positive
            # How lm-eval splits a pair into tokens (TemplateLM._encode_pair): the whole, then the context.
            whole = hf.encode(context + continuation, add_special_tokens=False).ids
            ctxlen = len(hf.encode(context, add_special_tokens=False).ids)
            expected = _in_process_loglikelihood(llm, whole, ctxlen)
            worst = max(worst, abs(loglik - expected))
            assert abs(loglik - expected) < 1e-3, (context, continuation, loglik, expected)
    print(f"largest difference from the in-process value: {worst:.2e} nats over {len(mc) * 4} continuations")

    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert results["spool_mc"]["acc,none"] >= 0.5  # the model knows most of these; a broken scorer does not
    assert "contains,none" in results["spool_gen"]
