"""``compare.render``: every line within 80 columns whatever the names and values, units
in the headers, and a figure of one row says so instead of a zero-width interval."""

from __future__ import annotations

from sidecar.report.compare import ComparedFigure, gate_lines, render


def _result(phases: list[ComparedFigure], figures: list[ComparedFigure]) -> dict:
    return {
        "base": {
            "folder": "/a/very/long/folder/" + "x" * 90,
            "split": 0,
            "runs": 1,
            "unit": "windows",
            "units": 8,
        },
        "new": {"folder": "new", "split": 0, "runs": 3, "unit": "runs", "units": 3},
        "method": "medians of the stored rows; 95 % percentile bootstrap intervals",
        "phases": phases,
        "figures": figures,
        "unlike": ["batch size differs (16 vs 32): phase and step times are per step " * 2],
    }


def test_lines_fit_80_columns_with_units_in_headers_and_one_row_said() -> None:
    phases = [
        ComparedFigure(
            "Forward",
            "s",
            0.0102,
            0.0123,
            (0.0101, 0.0104),
            (0.0121, 0.0125),
            20.6,
            (19.1, 22.0),
            (38, 38),
        ),
        ComparedFigure(
            "Epoch", "s", 0.229, 0.241, (0.229, 0.229), (0.241, 0.241), 5.2, (5.2, 5.2), (1, 1)
        ),
        ComparedFigure(
            "a custom phase with a very long name",
            "s",
            123456.0,
            0.0000012,
            (0.00000012, 999999.0),
            (0.0, 1e9),
            -999.9,
            (-1234.5, 12345.6),
            (5, 5),
        ),
    ]
    figures = [
        ComparedFigure(
            "throughput",
            "samples/s",
            8580.0,
            5840.0,
            (8510.0, 8660.0),
            (5790.0, 5900.0),
            -31.9,
            (-32.5, -31.2),
            (38, 38),
        ),
        ComparedFigure("goodput productive", "share", 0.649, 0.666, change_pct=1.7),
    ]
    lines = render(_result(phases, figures))
    lines += gate_lines(
        "FAIL: step time +11.1 % [+11.1, +11.2] is worse than the 5 % "
        "allowed, its interval above 0; most of it Forward +20.0 %"
    )
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    text = "\n".join(lines)
    assert "phase median (ms)" in text and "throughput (samples/s)" in text
    assert "NEW vs BASE (%)" in text and "goodput (% of the run" in text
    assert "(1 run, 8 windows as units)" in text and "NEW new split 0 (3 runs)" in text
    assert "a custom phase with a very long name" in lines  # on a line of its own
    forward = next(line for line in lines if line.startswith("Forward"))
    assert forward.split() == [
        "Forward",
        "10.2",
        "[10.1,",
        "10.4]",
        "12.3",
        "[12.1,",
        "12.5]",
        "+20.6",
        "[+19.1,",
        "+22.0]",
    ]
    epoch = next(line for line in lines if line.startswith("Epoch"))
    assert "229 (1 row)" in epoch and "[229, 229]" not in epoch, epoch
    rate = lines[lines.index("throughput (samples/s)") + 1]
    assert rate.split()[:2] == ["8580", "[8510,"], rate  # BASE and NEW never run together
