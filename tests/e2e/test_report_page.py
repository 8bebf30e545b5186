"""report.html read in a real headless Chromium at 3, 30 and 2 000 jobs: the page's own
layout check (``#layout-check``, written by its script after drawing) must find no text
box over another, no plot or section with nothing drawn and no note saying why, and no
label cut short without its full text on hover. The folders come from
``bench/report_scale.py``'s generator, some renamed with very long names and commands.
The check itself is shown to find an overlap and a silent empty plot when the page is
broken on purpose.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.report_scale import generate
from tests.support.helpers import env
from tests.support.tools import require_tool

CHROMIUM = "chromium-headless-shell"
LONG = "a-very-long-experiment-name-" * 4


def _folders(root: Path, jobs: int, gpus: int) -> Path:
    """``jobs`` generated run folders with ``gpus`` GPUs each, every third one renamed with
    a long path and given a long command."""
    runs = root / "runs"
    generate(runs, jobs, gpus, 60)
    for i, folder in enumerate(sorted(runs.glob("*/*"))):
        if i % 3:
            continue
        meta = json.loads((folder / "run.json").read_text())
        meta["command"] = ["python", "train.py", *(f"--option-{k}=value-{k}" for k in range(30))]
        (folder / "run.json").write_text(json.dumps(meta))
        folder.rename(folder.with_name(f"{LONG}{i}"))
    return runs


def _report(root: Path, runs: Path) -> Path:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "report", str(runs), "--out", str(root / "out")],
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return root / "out" / "report.html"


def _check(page: Path) -> dict[str, Any]:
    """The page's layout check as Chromium's DOM holds it after the scripts ran."""
    require_tool(CHROMIUM)
    dom = subprocess.run(
        [
            CHROMIUM,
            "--no-sandbox",
            "--headless",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1400,1000",
            "--virtual-time-budget=30000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    assert 'data-drawn="yes"' in dom, dom[-2000:]
    match = re.search(
        r'<div id="layout-check" hidden="" data-texts="(\d+)" '
        r'data-overlaps="(\d+)" data-empty="(\d+)" data-cut="(\d+)">(.*?)</div>',
        dom,
    )
    assert match, "no layout check in the page"
    texts, overlaps, empty, cut = (int(g) for g in match.groups()[:4])
    found = json.loads(
        match[5]
        .replace("&amp;", "&")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", '"')
    )
    return {
        **found,
        "texts": texts,
        "n_overlaps": overlaps,
        "n_empty": empty,
        "n_cut": cut,
        "gpu_notes": dom.count('class="no-data">No GPU data'),
        "dom": dom,
    }


@pytest.mark.parametrize(("jobs", "gpus"), [(3, 0), (30, 2), (2000, 2)])
def test_the_page_reads_well_from_a_few_jobs_to_thousands(
    tmp_path: Path, jobs: int, gpus: int
) -> None:
    check = _check(_report(tmp_path, _folders(tmp_path, jobs, gpus)))
    assert check["texts"] > 100  # the check saw the page's text
    assert (check["n_overlaps"], check["n_empty"], check["n_cut"]) == (0, 0, 0), (
        check["overlaps"],
        check["empty"],
        check["cut"],
    )
    if gpus == 0:  # GPU-hours per user and per model, utilization, the GPUs table
        assert check["gpu_notes"] == 4
    else:
        assert check["gpu_notes"] == 0
        assert check["dom"].count('<div class="uplot') == min(jobs, 20)
    # status, wall time and flags beside the job's name, the long command folded
    head = re.search(r'id="jobs".*?<thead><tr>(.*?)</tr>', check["dom"], re.S)
    assert head and re.findall(r"<th[^>]*>([^<]*)</th>", head[1])[:4] == [
        "job",
        "status",
        "wall (s)",
        "flags",
    ]
    assert 'class="text fold" title="python train.py --option-0' in check["dom"]


def test_the_check_finds_an_overlap_and_a_silent_empty_plot(tmp_path: Path) -> None:
    page = _report(tmp_path, _folders(tmp_path, 3, 0))
    text = page.read_text()
    # rows drawn over each other, and notes that say nothing
    broken = text.replace("</style>", ".hbar-row { margin-top: -1.3em; }</style>", 1)
    broken = broken.replace("function note(host, text) {", "function note(host, text) {return;")
    page.write_text(broken)
    check = _check(page)
    assert check["n_empty"] >= 3, check["empty"]
    page.write_text(
        text.replace(
            "</style>", "td { margin-left: -3em; display: block; float: left; }</style>", 1
        )
    )
    assert _check(page)["n_overlaps"] > 0
