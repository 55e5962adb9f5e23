"""ops/k8s, read as data (no cluster, no network): every manifest of both kustomizations (`base`, the CPU
deployment, and `gpu`, which adds a GPU worker) is valid against Kubernetes 1.31's schemas (the package
kubernetes-validate, strict: an unknown field fails) and KEDA 2.16's ScaledObject and TriggerAuthentication
(our subset of them: ops/k8s/schemas/), and what the manifests say about Spool is true of Spool: probes on
paths and ports it serves, env vars that are its settings, a registry it can read, ScaledObjects and
PodDisruptionBudgets that find their Deployment, a scaler query on the real `jobs` table's names.

The kustomizations are built here by a small builder (resources, patches merged by name, namespace,
images): what kubectl does, checked against `kubectl kustomize` where kubectl is installed."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from core.config import Settings
from core.infra.orm import Job
from core.states import TERMINAL_STATES, JobState

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "ops/k8s"
KUBERNETES = "1.31"  # the oldest Kubernetes release the manifests promise (docs/scaling.md)
BUILDS = ("base", "gpu")
KEDA_SCHEMAS = {
    "ScaledObject": K8S / "schemas/keda-2.16-scaledobject.json",
    "TriggerAuthentication": K8S / "schemas/keda-2.16-triggerauthentication.json",
}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"}
SETTINGS = {f"SPOOL_{name.upper()}": name for name in Settings.model_fields}
UNENDED = {s.value for s in JobState} - {s.value for s in TERMINAL_STATES}
# KEDA's postgresql trigger, in the one shape ops/k8s/base/keda.yaml explains.
QUERY = re.compile(
    r"SELECT count\(\*\) FROM \(SELECT 1 FROM (?P<table>\w+) WHERE (?P<model_col>\w+) = '(?P<model>[^']+)' "
    r"AND (?P<state_col>\w+) IN \((?P<states>[^)]*)\) LIMIT \d+\) AS \w+"
)


# -- the builder -------------------------------------------------------------------------------------------


def _merge(base: Any, patch: Any) -> Any:
    """A strategic merge patch as far as ops/k8s uses one: maps merge key by key, lists of named items
    (containers, volumes, volumeMounts, env) merge item by item on `name`, anything else is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        if any(k.startswith("$") for k in patch):
            raise ValueError(f"patch directives are not supported here: {sorted(patch)}")
        return {**base, **{k: _merge(base[k], v) if k in base else v for k, v in patch.items()}}
    named = isinstance(base, list) and isinstance(patch, list)
    if named and all(isinstance(i, dict) and "name" in i for i in [*base, *patch]):
        out = {i["name"]: i for i in base}
        for item in patch:
            out[item["name"]] = _merge(out[item["name"]], item) if item["name"] in out else item
        return list(out.values())
    return patch


def build(folder: Path) -> list[dict]:
    """The documents `kubectl kustomize folder` prints (up to the order of named list items)."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unsupported = set(k) - {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
    assert not unsupported, f"{folder}: the test's builder does not know {sorted(unsupported)}: teach it"
    docs: list[dict] = []
    for entry in k.get("resources", []):
        path = (folder / entry).resolve()
        docs += build(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for entry in k.get("patches", []):
        for patch in yaml.safe_load_all((folder / entry["path"]).read_text()):
            at = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) == _key(patch)]
            assert len(at) == 1, f"{folder / entry['path']}: patches {_key(patch)}, which the build has {len(at)} of"
            docs[at[0]] = _merge(docs[at[0]], patch)
    for d in docs:
        if "namespace" in k and d["kind"] not in CLUSTER_SCOPED:
            d["metadata"]["namespace"] = k["namespace"]
        for c in _containers(d):
            for image in k.get("images", []):
                name, _, tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    return docs


def _key(doc: dict) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


@cache
def built(name: str) -> tuple[dict, ...]:
    return tuple(build(K8S / name))


def docs_of(name: str) -> list[dict]:
    return copy.deepcopy(list(built(name)))


# -- what a manifest must be ---------------------------------------------------------------------------------


def _pod_spec(doc: dict) -> dict | None:
    return doc["spec"]["template"]["spec"] if doc["kind"] in ("Deployment", "Job") else None


def _containers(doc: dict) -> list[dict]:
    spec = _pod_spec(doc)
    return [*spec.get("initContainers", []), *spec["containers"]] if spec else []


def _matches(selector: dict, labels: dict) -> bool:
    return set(selector.get("matchLabels", {}).items()) <= set(labels.items())


def schema_problems(doc: dict) -> list[str]:
    where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    if doc.get("kind") in KEDA_SCHEMAS:
        schema = json.loads(KEDA_SCHEMAS[doc["kind"]].read_text())
        errors = jsonschema.Draft202012Validator(schema).iter_errors(doc)
        out = [f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
        if out or doc["kind"] != "ScaledObject":
            return out
        spec = doc["spec"]
        if spec.get("minReplicaCount", 0) > spec.get("maxReplicaCount", 100):
            out.append(f"{where}: minReplicaCount exceeds maxReplicaCount")
        # KEDA hands `behavior` to the HPA it makes: Kubernetes' own schema judges it.
        behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
        if behavior is not None:
            hpa = {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": doc["metadata"]["name"]},
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
                    "maxReplicas": spec.get("maxReplicaCount", 100),
                    "behavior": behavior,
                },
            }
            out += [f"{where}: advanced.horizontalPodAutoscalerConfig.{p}" for p in schema_problems(hpa)]
        return out
    try:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{where}: {e.message}"]
    except kubernetes_validate.ValidationError as e:
        return [f"{where}: {'.'.join(map(str, e.path))}: {e.message}"]
    return []


@cache
def api_routes() -> frozenset[str]:
    from api.app import create_app

    return frozenset(getattr(r, "path", "") for r in create_app().routes)


@cache
def spool_commands() -> frozenset[str]:
    import typer

    from core.cli.main import app

    return frozenset(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def uvicorn_grace_s() -> int:
    """How long `spool api` lets uvicorn finish open requests after SIGTERM (core/cli/main.py)."""
    found = re.search(r'"--timeout-graceful-shutdown",\s*"(\d+)"', (ROOT / "core/cli/main.py").read_text())
    assert found, "core/cli/main.py no longer passes --timeout-graceful-shutdown: say what the API's drain is"
    return int(found.group(1))


def served_models(toml: str) -> dict:
    from core.registry import RegistryError, registry

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "models.toml"
        path.write_text(toml)
        try:
            return registry(Settings.model_validate({"models_file": str(path)}))
        except RegistryError as e:
            raise AssertionError(str(e)) from None


def problems(docs: list[dict]) -> list[str]:
    """Every way the documents are invalid, or disagree with each other or with Spool."""
    out = [p for d in docs for p in schema_problems(d)]
    if out:
        return out
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    if len(by) != len(docs):
        out.append("two documents share a kind and a name")
    config_maps = {n: d.get("data", {}) for (k, n), d in by.items() if k == "ConfigMap"}
    deployments = {n: d for (k, n), d in by.items() if k == "Deployment"}
    claims = {n for k, n in by if k == "PersistentVolumeClaim"}
    worker_models: dict[str, str | None] = {}  # Deployment -> the model its `spool worker` serves
    migrations = 0
    for d in docs:
        where = f"{d['kind']}/{d['metadata']['name']}"
        if d["metadata"].get("namespace", "spool") != "spool" and d["kind"] not in CLUSTER_SCOPED:
            out.append(f"{where}: namespace {d['metadata']['namespace']!r}, not spool")
        spec = _pod_spec(d)
        if spec is None:
            continue
        labels = d["spec"]["template"]["metadata"].get("labels", {})
        if d["kind"] == "Deployment" and not _matches(d["spec"]["selector"], labels):
            out.append(f"{where}: its selector does not select its own pods")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v and v["configMap"]["name"] not in config_maps:
                out.append(f"{where}: volume {v['name']} names no ConfigMap of the build")
            if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] not in claims:
                out.append(f"{where}: volume {v['name']} names no PersistentVolumeClaim of the build")
        for c in _containers(d):
            if c.get("command", [""])[0] == "spool":
                out += _spool_container(f"{where} {c['name']}", c, spec, volumes, config_maps, worker_models, d)
                migrations += d["kind"] == "Job" and c["command"] == ["spool", "migrate"]
    if migrations != 1:
        out.append(f"{migrations} Jobs run `spool migrate` (one should)")
    for (kind, name), d in by.items():
        where = f"{kind}/{name}"
        if kind in ("Service", "PodDisruptionBudget"):
            selector = d["spec"]["selector"]
            selector = selector if kind == "PodDisruptionBudget" else {"matchLabels": selector}
            hits = [
                n for n, dep in deployments.items() if _matches(selector, dep["spec"]["template"]["metadata"]["labels"])
            ]
            if len(hits) != 1:
                out.append(f"{where}: its selector matches {len(hits)} Deployments ({hits}), not one")
            elif kind == "Service":
                ports = {p.get("name") for c in _containers(deployments[hits[0]]) for p in c.get("ports", [])}
                ports |= {p["containerPort"] for c in _containers(deployments[hits[0]]) for p in c.get("ports", [])}
                out += [
                    f"{where}: targetPort {p['targetPort']!r} is no port of {hits[0]}"
                    for p in d["spec"]["ports"]
                    if p["targetPort"] not in ports
                ]
        if kind == "ScaledObject":
            out += _scaled_object(where, d["spec"], deployments, worker_models, by)
    scaled = [d["spec"]["scaleTargetRef"]["name"] for d in docs if d["kind"] == "ScaledObject"]
    for name in worker_models:
        if scaled.count(name) != 1:
            out.append(f"Deployment/{name}: a worker Deployment has {scaled.count(name)} ScaledObjects, not one")
    return out


def _spool_container(
    where: str, c: dict, spec: dict, volumes: dict, config_maps: dict, worker_models: dict, d: dict
) -> list[str]:
    out: list[str] = []
    command = c["command"][1] if len(c["command"]) > 1 else ""
    if command not in spool_commands():
        return [f"{where}: `spool {command}` is no command of the spool CLI"]
    env: dict[str, str | None] = {}  # literal values; None: from a Secret
    for ref in c.get("envFrom", []):
        name = ref.get("configMapRef", {}).get("name")
        if name not in config_maps:
            out.append(f"{where}: envFrom names no ConfigMap of the build ({ref})")
        env |= config_maps.get(name, {})
    for e in c.get("env", []):
        env[e["name"]] = e.get("value")
    out += [f"{where}: {n} is not a Spool setting (core/config.py)" for n in env if n not in SETTINGS]
    literal = {SETTINGS[n]: v for n, v in env.items() if n in SETTINGS and v is not None}
    try:  # the values alone, as Spool would read them (model_validate: not this machine's environment)
        settings = Settings.model_validate(literal)
    except ValueError as e:
        return [*out, f"{where}: Spool refuses its settings: {e}"]
    for secret in ("SPOOL_DATABASE_URL", "SPOOL_REDIS_URL"):
        if env.get(secret) is not None:
            out.append(f"{where}: {secret} is written here; it belongs in the Secret")
        elif secret not in env and (command != "migrate" or secret == "SPOOL_DATABASE_URL"):
            out.append(f"{where}: {secret} is not set (the default is this host's)")
    # The registry: the ConfigMap mounted where SPOOL_MODELS_FILE points, readable by core/registry.py.
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    models: dict = {}
    if command != "migrate":
        file = Path(settings.models_file or "")
        mount = mounts.get(str(file.parent))
        source = volumes.get(mount["name"], {}).get("configMap", {}).get("name") if mount else None
        if source is None or file.name not in config_maps.get(source, {}):
            return [*out, f"{where}: SPOOL_MODELS_FILE={settings.models_file} is not a mounted ConfigMap key"]
        models = served_models(config_maps[source][file.name])
        for m in models.values():  # a model folder on a volume: the worker loads it, API and dispatcher tokenize
            if m.path and m.path.startswith("/") and command in ("api", "dispatcher", "worker"):
                reads = command != "worker" or m.id in settings.worker_model_ids
                if reads and not any(m.path.startswith(p.rstrip("/") + "/") for p in mounts):
                    out.append(f"{where}: model {m.id!r} is at {m.path}, which no volume mounts here")
    probes = {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c}
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    for kind, probe in probes.items():
        if "httpGet" not in probe:
            out.append(f"{where}: {kind} is not an HTTP probe")
            continue
        port = probe["httpGet"]["port"]
        port = ports.get(port) if isinstance(port, str) else port
        path = probe["httpGet"]["path"]
        if port not in ports.values():
            out.append(f"{where}: {kind} port {probe['httpGet']['port']!r} is no port of the container")
        if command == "api":
            served = (
                int(c["command"][c["command"].index("--port") + 1]) if "--port" in c["command"] else settings.api_port
            )
            if port != served or path not in api_routes():
                out.append(f"{where}: {kind} asks :{port}{path}; the API listens on :{served}, serving no other path")
        elif command in ("worker", "dispatcher"):
            if port != settings.metrics_port or path != "/metrics":
                out.append(
                    f"{where}: {kind} asks :{port}{path}, not SPOOL_METRICS_PORT={settings.metrics_port} /metrics"
                )
    if command == "api":
        if not {"readinessProbe", "livenessProbe"} <= set(probes):
            out.append(f"{where}: the API needs readiness and liveness probes")
        sleep = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
        drain = int(sleep[-1]) + uvicorn_grace_s()
        if drain >= spec.get("terminationGracePeriodSeconds", 30):
            out.append(f"{where}: preStop {sleep} + the API's {uvicorn_grace_s()} s drain exceed the grace period")
    if command == "worker":
        if "readinessProbe" not in probes:
            out.append(f"{where}: a worker needs a readiness probe")
        model = settings.worker_model_ids[0] if len(settings.worker_model_ids) == 1 else None
        if model not in models:
            out.append(
                f"{where}: SPOOL_WORKER_MODELS={env.get('SPOOL_WORKER_MODELS')} is not one model of the registry"
            )
        if d["kind"] == "Deployment":
            worker_models[d["metadata"]["name"]] = model
    return out


def _scaled_object(where: str, spec: dict, deployments: dict, worker_models: dict, by: dict) -> list[str]:
    target = spec["scaleTargetRef"]
    if (target.get("apiVersion", "apps/v1"), target.get("kind", "Deployment")) != ("apps/v1", "Deployment"):
        return [f"{where}: scales a {target.get('kind')}, not a Deployment"]
    if target["name"] not in deployments:
        return [f"{where}: scaleTargetRef names no Deployment of the build ({target['name']})"]
    if target["name"] not in worker_models:
        return [f"{where}: scales {target['name']}, which runs no `spool worker`"]
    out = []
    for t in spec["triggers"]:
        auth = t.get("authenticationRef", {}).get("name")
        if auth is not None and ("TriggerAuthentication", auth) not in by:
            out.append(f"{where}: authenticationRef names no TriggerAuthentication of the build ({auth})")
        if t["type"] != "postgresql":
            out.append(f"{where}: trigger {t['type']}: the ledger (Postgres) is the backlog; keda.yaml says why")
            continue
        q = QUERY.fullmatch(" ".join(t["metadata"]["query"].split()))
        if q is None:
            out.append(f"{where}: the query is not in the shape ops/k8s/base/keda.yaml gives")
            continue
        columns = set(Job.__table__.columns.keys())
        if q["table"] != Job.__tablename__ or not {q["model_col"], q["state_col"]} <= columns:
            out.append(f"{where}: the query reads {q['table']}.{q['model_col']}/{q['state_col']}, not the jobs table's")
        states = {s.strip().strip("'") for s in q["states"].split(",")}
        if states != UNENDED:
            out.append(f"{where}: the query counts states {sorted(states)}, not every unended one {sorted(UNENDED)}")
        serves = worker_models[target["name"]]
        if serves is not None and q["model"] != serves:
            out.append(f"{where}: the query counts model {q['model']!r}; {target['name']} serves {serves!r}")
    return out


# -- the manifests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILDS)
def test_every_manifest_is_valid_and_true_to_spool(name: str):
    docs = docs_of(name)
    assert problems(docs) == []
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "Job", "PodDisruptionBudget", "ScaledObject", "ConfigMap"} <= kinds


def test_the_gpu_worker_asks_for_a_gpu_and_scales_from_zero():
    docs = {_key(d): d for d in docs_of("gpu")}
    gpu = docs["Deployment", "spool-worker-llama-3-1-8b"]["spec"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1 and gpu["image"].startswith("spool-cuda")
    assert docs["ScaledObject", "spool-worker-llama-3-1-8b"]["spec"]["minReplicaCount"] == 0
    cpu = docs["Deployment", "spool-worker-smollm2"]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    # The interactive model keeps a worker: a waiting request for a model without one is a 503.
    assert docs["ScaledObject", "spool-worker-smollm2"]["spec"]["minReplicaCount"] >= 1
    # KEDA owns the worker counts: a `replicas` in the manifest would reset them on every apply.
    assert all(
        "replicas" not in docs["Deployment", n]["spec"] for n in ("spool-worker-llama-3-1-8b", "spool-worker-smollm2")
    )


def test_every_yaml_file_under_ops_k8s_is_in_a_build():
    listed = set()
    for k in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(k.read_text())
        listed |= {(k.parent / r).resolve() for r in spec.get("resources", [])}
        listed |= {(k.parent / p["path"]).resolve() for p in spec.get("patches", [])}
    files = {p.resolve() for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert files - listed == set(), "a manifest no kustomization applies (and so nothing validates)"
    assert {p.parent.name for p in K8S.rglob("kustomization.yaml")} == set(BUILDS)


def test_the_docs_create_every_secret_key_the_manifests_read():
    read = set()
    for name in BUILDS:
        for d in docs_of(name):
            for c in _containers(d):
                read |= {
                    (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                    for e in c.get("env", [])
                    if "secretKeyRef" in e.get("valueFrom", {})
                }
            if d["kind"] == "TriggerAuthentication":
                read |= {(r["name"], r["key"]) for r in d["spec"].get("secretTargetRef", [])}
    docs = (ROOT / "docs/scaling.md").read_text()
    created = set()
    for command in re.findall(r"kubectl [^\n]*create secret generic ([\w-]+)((?:[^\n]*\\\n)*[^\n]*)", docs):
        created |= {(command[0], key) for key in re.findall(r"--from-literal=([\w-]+)=", command[1])}
    assert read and read == created, "docs/scaling.md's `kubectl create secret` and the manifests disagree"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: the builder is unchecked")
@pytest.mark.parametrize("name", BUILDS)
def test_the_builder_builds_what_kubectl_kustomize_builds(name: str):
    def normal(x: Any) -> Any:  # named list items in name order: strategic merge places new ones first
        if isinstance(x, dict):
            return {k: normal(v) for k, v in x.items()}
        if isinstance(x, list) and all(isinstance(i, dict) and "name" in i for i in x):
            return sorted((normal(i) for i in x), key=lambda i: i["name"])
        return [normal(i) for i in x] if isinstance(x, list) else x

    printed = subprocess.run(
        ["kubectl", "kustomize", str(K8S / name)], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    theirs = sorted((normal(d) for d in yaml.safe_load_all(printed) if d), key=_key)
    assert theirs == sorted((normal(d) for d in docs_of(name)), key=_key)


# -- the validator fails on what it must catch -----------------------------------------------------------------


def _doc(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if _key(d) == (kind, name))


def _container(docs: list[dict], name: str) -> dict:
    return _doc(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


def _trigger(docs: list[dict]) -> dict:
    return _doc(docs, "ScaledObject", "spool-worker-smollm2")["spec"]["triggers"][0]


PLANTED = {
    "a removed apiVersion": (
        lambda docs: _doc(docs, "Deployment", "spool-api").update(apiVersion="apps/v1beta1"),
        "Couldn't find schema for kind Deployment with api version apps/v1beta1",
    ),
    "an unknown field": (
        lambda docs: _container(docs, "spool-api").update(readinesProbe={}),
        "'readinesProbe' was unexpected",
    ),
    "a field of the wrong type": (
        lambda docs: _doc(docs, "Deployment", "spool-api")["spec"].update(replicas="two"),
        "'two' is not of type",
    ),
    "a ScaledObject naming a missing Deployment": (
        lambda docs: _doc(docs, "ScaledObject", "spool-worker-smollm2")["spec"]["scaleTargetRef"].update(
            name="spool-worker-gone"
        ),
        "scaleTargetRef names no Deployment of the build (spool-worker-gone)",
    ),
    "an unknown ScaledObject field": (
        lambda docs: _doc(docs, "ScaledObject", "spool-worker-smollm2")["spec"].update(minReplicas=1),
        "'minReplicas' was unexpected",
    ),
    "a trigger value that is not a string": (
        lambda docs: _trigger(docs)["metadata"].update(targetQueryValue=16),
        "16 is not of type 'string'",
    ),
    "an HPA behavior Kubernetes refuses": (
        lambda docs: _doc(docs, "ScaledObject", "spool-worker-smollm2")["spec"]["advanced"][
            "horizontalPodAutoscalerConfig"
        ]["behavior"]["scaleDown"].update(window=1),
        "advanced.horizontalPodAutoscalerConfig.HorizontalPodAutoscaler",
    ),
    "a query for another model": (
        lambda docs: _trigger(docs)["metadata"].update(
            query=_trigger(docs)["metadata"]["query"].replace("smollm2-135m-instruct", "llama-3.1-8b-instruct")
        ),
        "the query counts model 'llama-3.1-8b-instruct'",
    ),
    "a query that misses running jobs": (
        lambda docs: _trigger(docs)["metadata"].update(
            query=_trigger(docs)["metadata"]["query"].replace(", 'running'", "")
        ),
        "the query counts states ['dispatched', 'queued']",
    ),
    "a PodDisruptionBudget selecting nothing": (
        lambda docs: _doc(docs, "PodDisruptionBudget", "spool-worker-smollm2")["spec"]["selector"][
            "matchLabels"
        ].update({"spool/model": "smollm2"}),
        "its selector matches 0 Deployments",
    ),
    "an env var Spool does not read": (
        lambda docs: _container(docs, "spool-worker-smollm2")["env"].append(
            {"name": "SPOOL_METRIC_PORT", "value": "1"}
        ),
        "SPOOL_METRIC_PORT is not a Spool setting",
    ),
    "a setting Spool refuses": (
        lambda docs: _doc(docs, "ConfigMap", "spool-config")["data"].update(SPOOL_LOG_FORMAT="xml"),
        "Spool refuses its settings",
    ),
    "a readiness path the API does not serve": (
        lambda docs: _container(docs, "spool-api")["readinessProbe"]["httpGet"].update(path="/readyz"),
        "readinessProbe asks :8000/readyz",
    ),
    "a worker probe off its metrics port": (
        lambda docs: _container(docs, "spool-worker-smollm2")["ports"][0].update(containerPort=9102),
        "not SPOOL_METRICS_PORT=9101 /metrics",
    ),
    "a worker for a model the registry lacks": (
        lambda docs: _container(docs, "spool-worker-smollm2")["env"][0].update(value="smollm3"),
        "SPOOL_WORKER_MODELS=smollm3 is not one model of the registry",
    ),
    "a migrations Job that does not migrate": (
        lambda docs: _doc(docs, "Job", "spool-migrate")["spec"]["template"]["spec"]["containers"][0].update(
            command=["spool", "init"]
        ),
        "0 Jobs run `spool migrate`",
    ),
    "a drain longer than the grace period": (
        lambda docs: _doc(docs, "Deployment", "spool-api")["spec"]["template"]["spec"].update(
            terminationGracePeriodSeconds=12
        ),
        "exceed the grace period",
    ),
}


@pytest.mark.parametrize("planted", PLANTED)
def test_a_planted_error_is_found(planted: str):
    plant, expected = PLANTED[planted]
    docs = docs_of("base")
    plant(docs)
    found = problems(docs)
    assert any(expected in p for p in found), found


def test_a_gpu_model_folder_no_api_pod_mounts_is_found():
    docs = docs_of("gpu")
    spec = _doc(docs, "Deployment", "spool-api")["spec"]["template"]["spec"]
    spec["containers"][0]["volumeMounts"] = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] != "models"]
    assert any("model 'llama-3.1-8b-instruct' is at /models/" in p for p in problems(docs))
