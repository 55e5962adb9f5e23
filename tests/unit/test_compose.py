"""docker-compose.yml, read as data (no Docker engine on CI machines): the GPU path for one host."""

from __future__ import annotations

from pathlib import Path

import yaml

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
