"""`docker compose --profile gpu up` rehearsed without Docker (issue 23): every Spool service of
docker-compose.yml runs its own `command` with its own `environment` (interpolated from an unchanged
.env.example, as compose does) as a local process. Replaced, and only these: hostnames (postgres,
redis -> the test database and Redis db), container paths (/etc/spool/models.toml -> a registry file
on disk), listening ports (so parallel runs don't collide), and for the GPU worker the engine of its
registry entry: a rehearsal copy of the example registry where that entry is served by llama.cpp with
the bundled GGUF. The GPU worker keeps its registry form (SPOOL_WORKER_MODELS names its entry), so a
stream for the GPU model name goes through the GPU worker's queue and process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import redis as redis_lib
import yaml

from ops.harness import side_redis
from tests.conftest import ROOT, TEST_DB, Stack, free_port, wait_for
from tests.helpers import answers_health, env_example

# A database and Redis db of its own: the rehearsal starts from empty ones, and must not wipe the
# session's shared stack (it did: every later test on that stack then got 401s).
COMPOSE_DB = TEST_DB.rsplit("/", 1)[0] + "/spool_compose"
COMPOSE_REDIS = side_redis("compose")

SERVICES = ("migrate", "api", "dispatcher", "worker", "worker-gpu")


def _registry_ids() -> list[str]:
    return [m["id"] for m in tomllib.loads((ROOT / "ops/models.example.toml").read_text())["models"]]


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} / ${VAR} / $$ rules (the subset docker-compose.yml uses)."""

    def sub(m: re.Match[str]) -> str:
        var, default = m.group(1), m.group(2)
        return env.get(var) or (default if default is not None else "")

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", sub, str(value)).replace("$$", "$")


def _rehearsal_registry(tmp: Path, gpu_model: str) -> Path:
    """The example registry, with the GPU worker's entry served by the bundled CPU model."""
    from core.registry import smollm2_gguf

    gguf = smollm2_gguf()
    text = (ROOT / "ops/models.example.toml").read_text()
    entries = tomllib.loads(text)["models"]
    assert gpu_model in {m["id"] for m in entries}
    lines, out, current = text.splitlines(), [], None
    for line in lines:
        m = re.match(r'\s*id\s*=\s*"([^"]+)"', line)
        if line.strip() == "[[models]]":
            current = None
        elif m:
            current = m.group(1)
        if current == gpu_model and re.match(r"\s*engine\s*=", line):
            line = 'engine = "llamacpp"   # rehearsal: the bundled GGUF in place of the GPU model'
        elif current == gpu_model and re.match(r"\s*path\s*=", line):
            line = f"path = {str(gguf)!r}"
        elif current == gpu_model and re.match(r"\s*(tokenizer|chat_template)\s*=", line):
            continue
        elif current == gpu_model and re.match(r"\s*n_ctx\s*=", line):
            line = "n_ctx = 2048"  # the bundled model's own context
        out.append(line)
    path = tmp / "models.toml"
    path.write_text("\n".join(out) + "\n")
    swapped = {m["id"]: m for m in tomllib.loads(path.read_text())["models"]}[gpu_model]
    assert swapped["engine"] == "llamacpp" and swapped["path"] == str(gguf)
    return path


def _service_env(svc: dict, env_file: dict[str, str], registry: Path) -> dict[str, str]:
    env = {k: _interpolate(v, env_file) for k, v in (svc.get("environment") or {}).items()}
    # Hostnames -> the test's own Postgres database and Redis db.
    assert (
        env["SPOOL_DATABASE_URL"].startswith("postgresql+psycopg://") and "@postgres:5432/" in env["SPOOL_DATABASE_URL"]
    )
    assert env["SPOOL_REDIS_URL"].startswith("redis://redis:6379/")
    env["SPOOL_DATABASE_URL"] = COMPOSE_DB
    env["SPOOL_REDIS_URL"] = COMPOSE_REDIS
    # Container paths -> files on disk (the registry is mounted at /etc/spool/models.toml).
    mounts = {m.rsplit(":", 2)[1]: m for m in svc.get("volumes", [])}
    assert env["SPOOL_MODELS_FILE"] in mounts
    env["SPOOL_MODELS_FILE"] = str(registry)
    if "SPOOL_METRICS_PORT" in env:
        env["SPOOL_METRICS_PORT"] = str(free_port())
    return env


def _argv(command: list[str], port: int) -> list[str]:
    assert command[0] == "spool", command  # the image's console script == python -m core.cli
    args = list(command[1:])
    if "--port" in args:
        args[args.index("--port") + 1] = str(port)
    if "--host" in args:
        args[args.index("--host") + 1] = "127.0.0.1"
    return args


def test_compose_services_serve_a_stream_for_the_gpu_and_the_cpu_model(tmp_path):
    from core.infra.dbadmin import drop_database

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    env_file = env_example()
    gpu_model = _interpolate(compose["worker-gpu"]["environment"]["SPOOL_WORKER_MODELS"], env_file)
    cpu_model = _interpolate(compose["worker"]["environment"]["SPOOL_WORKER_MODELS"], env_file)
    assert gpu_model == env_file["SPOOL_GPU_MODEL"] and gpu_model != cpu_model
    registry = _rehearsal_registry(tmp_path, gpu_model)

    drop_database(COMPOSE_DB)
    redis_lib.Redis.from_url(COMPOSE_REDIS).flushdb()
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPOOL_")}
    st = Stack(env={**base, "PYTHONUNBUFFERED": "1"}, logdir=tmp_path, port=port)
    envs = {name: _service_env(compose[name], env_file, registry) for name in SERVICES}

    # migrate: `spool init` runs to completion and prints the first admin key once.
    init = subprocess.run(
        [sys.executable, "-m", "core.cli", *_argv(compose["migrate"]["command"], port)],
        env={**st.env, **envs["migrate"]},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert init.returncode == 0, init.stderr[-3000:]
    st.keys["admin"] = init.stdout.strip().rsplit(" ", 1)[-1]
    try:
        for name in SERVICES[1:]:
            st.start(name, *_argv(compose[name]["command"], port), env=envs[name])
        for name in ("worker", "worker-gpu"):
            wait_for(lambda n=name: "ready." in st.log(n) or st.procs[n].poll() is not None, 120, f"{name} ready")
            assert st.procs[name].poll() is None, st.log(name)[-3000:]

        wait_for(lambda: answers_health(st.base_url, timeout=5), 60, "api health")  # compose's api healthcheck
        # /ready wants a worker per registry entry: only the entries no compose worker serves lack one.
        others = [m for m in _registry_ids() if m not in (gpu_model, cpu_model)]
        want = sorted(f"no live worker for model '{m}'" for m in others)
        wait_for(lambda: sorted(httpx.get(st.base_url + "/ready").json()["problems"]) == want, 60, "workers live")
        st.keys["alpha"] = st.new_tenant("alpha")
        client = st.openai("alpha")
        for model in (gpu_model, cpu_model):
            chunks = list(
                client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, stream=True)
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert text.strip(), (model, chunks)
            assert chunks[0].model == model
        # The example registry's other GPU entry has no weights on this host: the API still serves
        # the rest, and lists or refuses that one without a 500.
        with st.http(st.keys["alpha"]) as http:
            listed = http.get("/v1/models")
            assert listed.status_code == 200, listed.text
            assert {m["id"] for m in listed.json()["data"]} >= {gpu_model, cpu_model, *others}
            for other in others:
                body = {"model": other, "prompt": "x", "max_tokens": 1}
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_loaded", r.text
                # Queued for later, it needs its tokenizer now: a 503 naming the absent folder.
                r = http.post("/v1/completions", json=body, headers={"Prefer": "respond-async"})
                assert r.status_code == 503 and "does not exist" in r.json()["error"]["message"], r.text
        # Each model's job ran on its own worker (each consumes only its models' queues).
        assert gpu_model in st.log("worker-gpu") or "succeeded" in st.log("worker-gpu"), st.log("worker-gpu")[-2000:]
    finally:
        st.stop_all()
