"""Every query of deploy/grafana/trainmon.json, and of its template variables, run against
a real Prometheus scraping a real job (``sidecar run --metrics-port`` over a marked loop,
GPUs from the NVML stand-in): each returns data. Grafana's own variables are given the
values Grafana would ($__rate_interval a minute, $run and $user every value)."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

from tests.support.helpers import wait_for
from tests.support.prometheus import http, prometheus, promql, start_loop_job

__all__ = ["prometheus"]  # the fixture, used by name

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "trainmon.json"
GRAFANA = {"$__rate_interval": "1m", "$run": ".+", "$user": ".+"}


def _expand(expr: str) -> str:
    for name, value in GRAFANA.items():
        expr = expr.replace(name, value)
    return expr


def test_every_dashboard_query_returns_data(prometheus: tuple[str, int], tmp_path: Path) -> None:
    url, port = prometheus
    board = json.loads(DASHBOARD.read_text())
    queries = [
        (panel["title"], _expand(target["expr"]))
        for panel in board["panels"]
        for target in panel.get("targets", [])
    ]
    job, stop = start_loop_job(tmp_path, port)
    try:
        wait_for(
            lambda: promql(url, "count_over_time(trainmon_goodput_wall_seconds[1m]) >= 10"),
            90,
            "10 scrapes of the goodput",
            0.5,
        )
        empty = [title for title, expr in queries if not promql(url, expr)]
        variables = {}
        for variable in board["templating"]["list"]:
            if variable["type"] != "query":
                continue
            match = _expand(variable["query"]["query"])  # label_values(SELECTOR, LABEL)
            selector, label = match[len("label_values(") : -1].rsplit(",", 1)
            reply = json.loads(
                http(
                    f"{url}/api/v1/label/{label.strip()}/values?"
                    + urllib.parse.urlencode({"match[]": selector})
                )
            )
            variables[variable["name"]] = reply["data"]
    finally:
        stop.touch()
        _, stderr = job.communicate(timeout=60)
    assert job.returncode == 0, stderr
    assert not empty, f"panels whose query returned nothing: {empty}"
    assert len(queries) >= 12
    assert variables["user"] and len(variables["run"]) == 1
