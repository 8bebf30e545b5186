"""deploy/grafana/trainmon.json against the fields Grafana's dashboard schema requires of
a dashboard, its template variables and its panels (checked without a Grafana)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "trainmon.json"
PANEL_TYPES = {"timeseries", "stat", "bargauge", "table", "row", "piechart", "gauge"}


def _load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_fields() -> None:
    board = _load()
    for key, kind in (
        ("uid", str),
        ("title", str),
        ("schemaVersion", int),
        ("version", int),
        ("panels", list),
        ("templating", dict),
        ("time", dict),
        ("editable", bool),
        ("tags", list),
    ):
        assert isinstance(board.get(key), kind), key
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", board["uid"])
    assert board["schemaVersion"] >= 36  # the panel types used need Grafana 9+
    assert set(board["time"]) == {"from", "to"}
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "user", "run"]
    for variable in board["templating"]["list"]:
        assert variable["type"] in {"datasource", "query"}
        if variable["type"] == "query":
            assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert variable["definition"] == variable["query"]["query"]


def test_panels_fields_ids_and_layout() -> None:
    panels = _load()["panels"]
    ids = [p["id"] for p in panels]
    assert len(set(ids)) == len(ids) and all(isinstance(i, int) for i in ids)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        assert panel["type"] in PANEL_TYPES and panel["title"]
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and grid["x"] + grid["w"] <= 24
        for y in range(grid["y"], grid["y"] + grid["h"]):  # no two panels overlap
            for x in range(grid["x"], grid["x"] + grid["w"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs)
        for target in panel["targets"]:
            assert target["expr"].strip() and "trainmon_" in target["expr"]
