"""The alert rules load in promtool; the Grafana dashboard is well formed; both name only metrics
Spool exports (a renamed metric would leave a panel or an alert silently empty)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from core.infra import metrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "ops/prometheus/alerts.yml"
DASHBOARD = ROOT / "ops/grafana/dashboards/spool.json"


def _exported() -> set[str]:
    names = set()
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            for family in obj.describe():
                base = family.name
                names |= {base, base + "_total", base + "_bucket", base + "_count", base + "_sum"}
    return names


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(spool_[a-z0-9_]+)", expr))


def test_promtool_accepts_the_rules():
    promtool = shutil.which("promtool") or str(ROOT / ".venv/bin/promtool")
    if not Path(promtool).exists():
        pytest.skip("promtool is installed by ops/test-tools.sh")
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 6 rules found" in out.stdout


def test_alerts_name_exported_metrics_and_have_a_runbook():
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    exported = _exported()
    ops = (ROOT / "docs/operations.md").read_text().lower()
    for rule in rules:
        assert _metric_names(rule["expr"]) <= exported, rule["alert"]
        assert rule["annotations"]["runbook"].split("#")[1] in ops.replace("### ", "#").replace(" ", "")


def test_dashboard_is_well_formed_and_names_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    exported = _exported()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for p in dash["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["type"] == "timeseries"
        for t in p["targets"]:
            assert t["expr"] and _metric_names(t["expr"]) <= exported, (p["title"], t["expr"])
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("tokens", "first token", "inter-token", "queue", "workers", "errors", "tenant"):
        assert topic in titles
