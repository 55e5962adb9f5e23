"""The bare-host GPU path of docs/gpu.md ("Without Docker") rehearsed without a GPU (issue 34), as
tests/e2e/test_compose_rehearsal.py rehearses compose: the documented start command
(`spool up --registry ops/models.host.example.toml`) runs as written, from a directory laid out as the
docs' checkout (the registry's relative model paths under ./models), on the documented host registry.
Replaced, and only these: the database and Redis (this test's own), the API port, the registry
argument (a rehearsal copy of ops/models.host.example.toml), and in that copy the GPU entry's engine:
llama.cpp with the bundled GGUF, linked at a relative path under ./models as the GPU folder would be.
The entry keeps its id, its other settings and its relative path form; a completion for that id is
streamed through the one command's API, dispatcher and worker with the openai SDK."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import redis as redis_lib
from openai import OpenAI

from tests.conftest import ROOT, TEST_DB, TEST_REDIS, free_port, wait_for

# A database and Redis db of their own: `spool up` migrates and makes a first key on an empty one.
BARE_DB = TEST_DB.rsplit("/", 1)[0] + "/spool_bare"
BARE_REDIS = TEST_REDIS.rsplit("/", 1)[0] + "/2"
HOST_REGISTRY = "ops/models.host.example.toml"


def _documented_command() -> list[str]:
    """The start command of docs/gpu.md's "Without Docker" section: its one `spool up` line."""
    text = (ROOT / "docs/gpu.md").read_text()
    section = text.split("## Without Docker", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    lines = [ln.split("#", 1)[0].strip() for b in blocks for ln in b.splitlines()]
    (line,) = [ln for ln in lines if ln.startswith("spool up")]
    return shlex.split(line)


def _rehearsal_registry(tmp: Path) -> tuple[Path, str]:
    """The host registry with its GPU entry served by the bundled GGUF, linked at ./models/<name>."""
    from core.registry import smollm2_gguf

    text = (ROOT / HOST_REGISTRY).read_text()
    entries = tomllib.loads(text)["models"]
    gpu = [m for m in entries if m["engine"] in ("exllamav2", "exllamav3")]
    assert len(gpu) == 1 and len(entries) == 1, entries  # one GPU worker, one entry
    (entry,) = gpu
    assert not Path(entry["path"]).is_absolute() and entry["path"].startswith("models/"), entry
    gguf = smollm2_gguf()
    rel = f"models/{gguf.name}"
    (tmp / "models").mkdir()
    (tmp / rel).symlink_to(gguf)
    out = []
    for line in text.splitlines():
        if re.match(r"\s*engine\s*=", line):
            line = 'engine = "llamacpp"   # rehearsal: the bundled GGUF in place of the GPU model'
        elif re.match(r"\s*path\s*=", line):
            line = f'path = "{rel}"'
        elif re.match(r"\s*n_ctx\s*=", line):
            line = "n_ctx = 2048  # the bundled model's own context"
        out.append(line)
    path = tmp / "models.host.toml"
    path.write_text("\n".join(out) + "\n")
    (swapped,) = tomllib.loads(path.read_text())["models"]
    assert swapped["engine"] == "llamacpp" and swapped["path"] == rel
    assert {k: v for k, v in swapped.items() if k not in ("engine", "path", "n_ctx")} == {
        k: v for k, v in entry.items() if k not in ("engine", "path", "n_ctx")
    }
    return path, entry["id"]


def test_the_documented_bare_host_command_serves_a_stream(tmp_path):
    from core.infra.dbadmin import drop_database

    argv = _documented_command()
    assert argv == ["spool", "up", "--registry", HOST_REGISTRY], argv
    checkout = tmp_path / "checkout"  # where the docs run it: relative model paths are read from here
    checkout.mkdir()
    registry, model = _rehearsal_registry(checkout)
    argv[argv.index("--registry") + 1] = str(registry)

    drop_database(BARE_DB)
    redis_lib.Redis.from_url(BARE_REDIS).flushdb()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOL_")}
    env |= {
        "PYTHONUNBUFFERED": "1",
        "SPOOL_DATABASE_URL": BARE_DB,
        "SPOOL_REDIS_URL": BARE_REDIS,
        "SPOOL_API_PORT": str(port),
    }
    log_path = tmp_path / "up.log"
    log = open(log_path, "wb")  # the process writes it; closed at the end
    # `spool` is the console script of `python -m core.cli`.
    up = subprocess.Popen(
        [sys.executable, "-m", "core.cli", *argv[1:]],
        cwd=checkout,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def ready() -> bool:
            if up.poll() is not None:
                return True
            try:
                return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=3).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 180, "spool up to be ready")
        out = log_path.read_text(errors="replace")
        assert up.poll() is None, out[-3000:]
        assert "does not exist" not in out, out[-3000:]  # every registry path resolved on this "host"
        key = re.search(r"API key for tenant 'default' \(shown once\): (\S+)", out)
        assert key, out[-3000:]
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key.group(1), max_retries=0)
        listed = {m.id for m in client.models.list()}
        assert model in listed, listed
        chunks = list(
            client.chat.completions.create(
                model=model,
                stream=True,
                max_tokens=16,
                messages=[{"role": "user", "content": "Say hello in five words."}],
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip(), chunks
        assert chunks[0].model == model
        assert any(c.choices and c.choices[0].finish_reason in ("stop", "length") for c in chunks), chunks
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
        log.close()
