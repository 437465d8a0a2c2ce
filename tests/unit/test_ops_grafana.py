"""ops/grafana/: the dashboard JSON is generated, provisioning-ready, one row per stage in order."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml

GRAFANA = Path(__file__).resolve().parents[2] / "ops" / "grafana"


def generator():
    spec = importlib.util.spec_from_file_location("odbd_dashboard", GRAFANA / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard() -> dict:
    return json.loads((GRAFANA / "odbd-dashboard.json").read_text())


def test_the_committed_json_is_what_generate_py_writes():
    assert (GRAFANA / "odbd-dashboard.json").read_text() == generator().render(), (
        "run python ops/grafana/generate.py"
    )


def test_rows_follow_the_data_path():
    rows = [p["title"] for p in dashboard()["panels"] if p["type"] == "row"]
    assert rows[0].startswith("Overview")
    stages = ["Ingest", "Planning", "Alignment rounds", "Serving", "Quota"]
    assert [r.split(". ", 1)[1].split(":")[0] for r in rows[1:]] == [
        "Ingest",
        "Planning",
        "Alignment rounds and stragglers",
        "Serving and trainer overlap",
        "Quota and coverage",
    ]
    assert all(stage in row for stage, row in zip(stages, rows[1:], strict=True))


def test_every_panel_has_a_unit_a_description_and_the_datasource_variable():
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        assert panel["description"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"] and all('job=~"$job"' in t["expr"] for t in panel["targets"])


def test_panels_do_not_overlap_on_the_grid():
    taken: set[tuple[int, int]] = set()
    for panel in dashboard()["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        cells = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_the_overview_shows_padding_overlap_and_quota_with_thresholds():
    stats = {p["title"]: p for p in dashboard()["panels"] if p["type"] == "stat"}
    module = generator()
    assert stats["Padding (job)"]["targets"][0]["expr"] == module.PADDING
    assert stats["Pipeline overlap (job)"]["targets"][0]["expr"] == module.OVERLAP
    assert stats["Sample quota (job)"]["targets"][0]["expr"] == module.QUOTA
    overlap_steps = stats["Pipeline overlap (job)"]["fieldConfig"]["defaults"]["thresholds"]
    assert [s["value"] for s in overlap_steps["steps"]] == [None, 0.95, 0.99]


def test_provisioning_files_point_grafana_at_the_dashboard():
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/odbd.yaml").read_text())
    assert provider["apiVersion"] == 1
    assert provider["providers"][0]["type"] == "file"
    assert provider["providers"][0]["options"]["path"]
    sources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    assert sources["datasources"][0]["type"] == "prometheus"
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["allValue"] == ".*"
