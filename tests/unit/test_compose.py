"""docker-compose.yml, read as data (no Docker engine on CI machines): the GPU path for one host."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from core.config import Settings
from core.registry import ENGINES
from tests.helpers import env_example

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
S = COMPOSE["services"]


def test_every_spool_service_reads_the_registry_and_the_model_folder():
    for name in ("migrate", "api", "dispatcher", "worker", "worker-gpu"):
        env = S[name]["environment"]
        assert env["SPOOL_MODELS_FILE"] == "/etc/spool/models.toml", name
        mounts = [v.rsplit(":", 2)[1] for v in S[name]["volumes"]]  # "source:target:ro"
        assert "/etc/spool/models.toml" in mounts and "/models" in mounts, name
    assert (ROOT / "ops/models.example.toml").exists()


def test_cpu_and_gpu_workers_serve_different_models():
    assert S["worker-gpu"]["profiles"] == ["gpu"] and "profiles" not in S["worker"]
    assert S["worker"]["environment"]["SPOOL_WORKER_MODELS"] != S["worker-gpu"]["environment"]["SPOOL_WORKER_MODELS"]
    gpu = S["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]


def test_first_key_healthchecks_and_monitoring():
    assert S["migrate"]["command"] == ["spool", "init"]
    for name in ("api", "dispatcher", "worker", "worker-gpu", "postgres", "redis"):
        assert "healthcheck" in S[name], name
    prom = S["prometheus"]
    assert prom["profiles"] == ["monitoring"] and any("alerts.yml" in v for v in prom["volumes"])
    scraped = (ROOT / "ops/prometheus/prometheus.yml").read_text()
    assert "worker-gpu:9101" in scraped and "dispatcher:9101" in scraped
    for v in S["grafana"]["volumes"]:
        assert (ROOT / v.split(":")[0]).exists(), v


def test_env_example_and_dockerignore():
    env = (ROOT / ".env.example").read_text()
    for var in ("POSTGRES_PASSWORD", "SPOOL_REGISTRY", "SPOOL_MODEL_DIR", "SPOOL_GPU_MODEL"):
        assert f"{var}=" in env
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".env" in ignored and "models" in ignored


# -- one name per setting, and defaults that serve (issue 23) ------------------------------------------

SETTINGS = {f"SPOOL_{name.upper()}" for name in Settings.model_fields}
# Variables docker compose itself interpolates (never read by Spool): named in .env.example and docs.
COMPOSE_VARS = {"SPOOL_REGISTRY", "SPOOL_MODEL_DIR", "SPOOL_PORT", "SPOOL_CPU_MODELS", "SPOOL_GPU_MODEL"}
COMPOSE_VARS |= {"SPOOL_GPU_WORKER_CONCURRENCY"}
# Read by the `spool` client commands (typer envvar=) and the scripts, not by the service.
CLI_VARS = {"SPOOL_URL", "SPOOL_API_KEY", "SPOOL_KEY", "SPOOL_EXTRAS", "SPOOL_SKIP_EVAL", "SPOOL_WHEEL_CACHE"}
CLI_VARS |= {"SPOOL_CUDA_DRY_RUN", "SPOOL_TORCH_INDEX"}  # ops/docker/cuda-install.sh, ops/test.sh


def test_every_spool_variable_compose_passes_is_a_setting():
    for name, svc in S.items():
        for var in svc.get("environment", {}) or {}:
            if var.startswith("SPOOL_"):
                assert var in SETTINGS, f"{name} passes {var}, which no setting reads"


def test_every_variable_compose_interpolates_is_documented_in_env_example_or_a_setting():
    text = (ROOT / "docker-compose.yml").read_text()
    used = set(re.findall(r"\$\{(SPOOL_[A-Z0-9_]+)", text))
    env = env_example()
    for var in used:
        assert var in COMPOSE_VARS | SETTINGS, f"compose interpolates {var}, which nothing documents"
        assert var in env or var in SETTINGS or f"{var}=" in (ROOT / "docs/gpu.md").read_text(), var


def test_script_variables_are_read_by_the_scripts():
    names = ("bootstrap.sh", "test.sh", "llama_wheel.sh", "docker/cuda-install.sh")
    scripts = "".join((ROOT / "ops" / f).read_text() for f in names)
    for var in ("SPOOL_EXTRAS", "SPOOL_SKIP_EVAL", "SPOOL_WHEEL_CACHE", "SPOOL_CUDA_DRY_RUN", "SPOOL_TORCH_INDEX"):
        assert var in scripts, var


# Read by the test harness and the proof kit (ops/harness.py, ops/test.sh, tests/costs.py, ops/gpu_proof/).
TEST_VARS = {"SPOOL_SERIAL", "SPOOL_TEST_SHARD", "SPOOL_TEST_SHARDS", "SPOOL_TEST_DATABASE_URL", "SPOOL_TEST_REDIS_URL"}
TEST_VARS |= {"SPOOL_GPU_PROOF_DRY"}
# SPOOL_TEST_SHARD's name before issue 52, still read (ops/harness.py), and named by dated commands.
TEST_VARS |= {"SPOOL_TEST_LANE"}


def test_test_variables_are_read_by_the_harness():
    sources = [*ROOT.glob("ops/**/*.py"), *ROOT.glob("ops/*.sh"), ROOT / "tests/conftest.py", ROOT / "tests/costs.py"]
    text = "".join(f.read_text() for f in sources)
    assert not [v for v in TEST_VARS if v not in text]


def unknown_settings(text: str) -> list[str]:
    named = set(re.findall(r"\bSPOOL_[A-Z0-9_]*[A-Z0-9]\b", text))
    return sorted(named - SETTINGS - COMPOSE_VARS - CLI_VARS - TEST_VARS)


def test_docs_name_only_settings_that_exist():
    """Every Markdown page but the dated history (HISTORY.md names what existed then)."""
    for doc in sorted([*ROOT.glob("*.md"), *ROOT.glob("docs/*.md")]):
        if doc.name == "HISTORY.md":
            continue
        unknown = unknown_settings(doc.read_text())
        assert not unknown, f"{doc.relative_to(ROOT)} names {unknown}, which no setting reads"


def test_a_planted_setting_that_does_not_exist_is_found():
    planted = (ROOT / "README.md").read_text() + "\nSet `SPOOL_EXL2_CACHE_QUANT` and `SPOOL_QUEUE_TURBO=1`.\n"
    assert unknown_settings(planted) == ["SPOOL_QUEUE_TURBO"]


def test_the_gpu_default_is_an_entry_an_engine_serves():
    registry = tomllib.loads((ROOT / "ops/models.example.toml").read_text())["models"]
    by_id = {m["id"]: m for m in registry}
    gpu_default = env_example()["SPOOL_GPU_MODEL"]
    compose_default = re.search(r"\$\{SPOOL_GPU_MODEL:-([^}]+)\}", (ROOT / "docker-compose.yml").read_text())
    assert compose_default and compose_default.group(1) == gpu_default
    entry = by_id[gpu_default]
    assert entry["engine"] in ("exllamav2", "exllamav3") and entry["engine"] in ENGINES
    assert entry["path"].startswith("/models/")  # under the folder compose mounts
    # The example registry carries one entry per GPU engine, each with a real `hf download` line.
    assert {m["engine"] for m in registry} >= {"exllamav2", "exllamav3"}
    text = (ROOT / "ops/models.example.toml").read_text()
    for m in registry:
        if m["engine"].startswith("exllama"):
            folder = m["path"].removeprefix("/models/")
            assert f"--local-dir models/{folder}" in text, m["id"]


def test_the_cpu_default_is_the_bundled_model():
    assert S["worker"]["environment"]["SPOOL_WORKER_MODELS"] == "${SPOOL_CPU_MODELS:-smollm2-135m-instruct}"
    assert env_example()["SPOOL_CPU_MODELS"] == "smollm2-135m-instruct"


def test_redis_is_bounded_and_never_evicts():
    """Queues and event streams must never be evicted: past `maxmemory` Redis refuses writes (OOM),
    which Spool answers with a 503 and waits out (core/infra/transient.py), rather than losing jobs."""
    command = [str(part) for part in S["redis"]["command"]]
    assert command[0] == "redis-server"
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert flags["--maxmemory-policy"] == "noeviction"
    bound = re.fullmatch(r"\$\{REDIS_MAXMEMORY:-(\d+)(gb|mb)\}", flags["--maxmemory"])
    assert bound, flags["--maxmemory"]  # a default, overridable from the environment (.env)
    assert env_example()["REDIS_MAXMEMORY"] == bound.group(1) + bound.group(2)
    assert flags["--appendonly"] == "yes"
    local = (ROOT / "ops/services.sh").read_text()  # the development Redis ops/services.sh starts: the same
    assert "--maxmemory-policy noeviction" in local and "--maxmemory" in local


# -- the GPU image per engine, and the bare-host registry (issue 34) --------------------------------------

COMPOSE_VARS |= {"SPOOL_GPU_TARGET"}  # the worker-gpu image's target: exl2 (default) or exl3


def test_the_gpu_worker_builds_the_exl2_target_unless_told_otherwise():
    build = S["worker-gpu"]["build"]
    assert build["dockerfile"] == "ops/docker/Dockerfile.cuda"
    assert build["target"] == "${SPOOL_GPU_TARGET:-exl2}"
    assert S["worker-gpu"]["image"] == "spool-cuda:${SPOOL_GPU_TARGET:-exl2}"
    stages = re.findall(r"^FROM \S+ AS (\S+)", (ROOT / "ops/docker/Dockerfile.cuda").read_text(), re.M)
    assert {"exl2", "exl3"} <= set(stages)
    assert "SPOOL_GPU_TARGET=exl3" in (ROOT / "docs/gpu.md").read_text()  # the documented way to EXL3


def _entries(text: str) -> list[dict]:
    return tomllib.loads(text)["models"]


def test_the_host_registry_is_the_example_registry_with_host_paths():
    """ops/models.host.example.toml (bare host, `spool up --registry`) serves what the container registry
    serves, at paths relative to the checkout where the docs' `hf download` puts the folders."""
    from core.registry import _from_file

    host_file = ROOT / "ops/models.host.example.toml"
    host = _entries(host_file.read_text())
    assert list(_from_file(str(host_file))) == [m["id"] for m in host]  # Spool reads it
    # Its commented alternative: uncommented, a registry too.
    alt = "\n".join(ln[2:] for ln in host_file.read_text().splitlines() if ln.startswith("# ") and "=" in ln)
    alt_entries = _entries("[[models]]\n" + "\n".join(ln for ln in alt.splitlines() if not ln.startswith("hf ")))
    by_id = {m["id"]: m for m in _entries((ROOT / "ops/models.example.toml").read_text())}
    engines = set()
    for m in host + alt_entries:
        assert m["path"] == "models/" + by_id[m["id"]]["path"].removeprefix("/models/"), m
        assert {k: v for k, v in m.items() if k != "path"} == {
            k: v for k, v in by_id[m["id"]].items() if k in m and k != "path"
        }
        assert f"--local-dir {m['path']}" in host_file.read_text()
        engines.add(m["engine"])
    assert engines == {"exllamav2", "exllamav3"}
    assert len(host) == 1  # the one worker `spool up` starts loads every entry: one GPU model
