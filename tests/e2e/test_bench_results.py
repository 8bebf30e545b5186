"""bench/results.py: each benchmark replaces only its own section of RESULTS.md."""

from __future__ import annotations

from pathlib import Path

from bench.results import write_section


def test_write_section_creates_then_replaces_only_its_own(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    write_section("## GPU overhead\n\nfirst\n", path)
    assert path.read_text() == "# Benchmark results\n\n## GPU overhead\n\nfirst\n"
    page = "# R\n\n## Markers\n\nm\n\n## GPU overhead\n\n{}\n\n## Sidecar\n\ns\n"
    path.write_text(page.format("old"))
    write_section("## GPU overhead\n\nnew\n", path)
    assert path.read_text() == page.format("new")
    write_section("## Last\n\nz\n", path)
    assert path.read_text() == page.format("new") + "\n## Last\n\nz\n"
