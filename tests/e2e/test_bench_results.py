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


def test_write_section_first_goes_before_every_other_section(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("# R\n\nintro\n\n## A\n\na\n")
    write_section("## Summary\n\ns\n", path, first=True)
    assert path.read_text() == "# R\n\nintro\n\n## Summary\n\ns\n\n## A\n\na\n"
    write_section("## Summary\n\nt\n", path, first=True)  # replaced where it is
    assert path.read_text() == "# R\n\nintro\n\n## Summary\n\nt\n\n## A\n\na\n"
