"""The phase vocabulary is one table (``markers.wire.PHASES``): the lists the files,
summary, metrics and report use agree with the contract's headers (docs/contract.md)."""

from __future__ import annotations

import json
import re
from array import array
from pathlib import Path

from markers import wire
from sidecar.daemon import metrics
from sidecar.model import efficiency, goodput, merge, stragglers
from sidecar.model.aggregator import LOOP_PHASES
from sidecar.report import from_prometheus
from sidecar.report.build import PHASE_MEANS
from sidecar.report.figures import PHASE_COLUMNS, STEP_PARTS
from sidecar.sinks import layout, tables
from tests.support.contract import STANDARD_COLUMNS
from tests.unit.test_aggregator import aggregator, iteration
from tests.unit.test_dashboard_json import DASHBOARD

ROOT = Path(__file__).parents[2]
PHASE_REGEX = re.compile(r'phase=~"([^"]*)"')  # a PromQL matcher over phase labels


def test_computational_header_follows_the_table_in_the_contract_order() -> None:
    agg = aggregator()
    agg.add_records(array("q", iteration(0, 0.0, 0)))
    header = tables.computational_text(agg).splitlines()[0].split("\t")
    assert header == STANDARD_COLUMNS
    assert [*layout.TRAIN_ROWS, *layout.VAL_ROWS] == list(wire.PHASES)


def test_every_derived_list_is_a_view_of_the_table() -> None:
    assert list(wire.PHASE_LABELS) == [p.phase for p in wire.PHASES]
    assert wire.CANONICAL_PHASE_NAMES == {
        "forward": wire.FORWARD,
        "backward": wire.BACKWARD,
        "optimization": wire.OPTIMIZATION,
        "evaluation": wire.EVALUATION,
        "metrics": wire.METRICS,
    }
    assert {wire.TRAINING_LOOP, wire.VALIDATION_LOOP} == wire.LOOP_IDS
    assert LOOP_PHASES == {False: wire.TRAINING_LOOP, True: wire.VALIDATION_LOOP}
    assert wire.LAST_STANDARD_ID == wire.METRICS
    assert layout.TRAIN_GPU_PHASES == (wire.FORWARD, wire.BACKWARD, wire.OPTIMIZATION)
    assert layout.VAL_GPU_PHASES == (wire.EVALUATION,)
    assert PHASE_COLUMNS == {
        "loop": "Training loop",
        "loading": "Training data loading",
        "forward": "Forward",
        "backward": "Backward",
        "optimization": "Optimization",
    }
    assert metrics.PHASE_NAMES == {
        wire.TRAINING: "training",
        wire.EPOCH: "epoch",
        wire.TRAINING_LOOP: "train_loop",
        wire.TRAINING_DATA_LOADING: "train_loading",
        wire.FORWARD: "forward",
        wire.BACKWARD: "backward",
        wire.OPTIMIZATION: "optimization",
        wire.VALIDATION: "validation",
        wire.VALIDATION_LOOP: "val_loop",
        wire.VALIDATION_DATA_LOADING: "val_loading",
        wire.EVALUATION: "evaluation",
        wire.METRICS: "metrics",
    }


def test_custom_names_may_not_take_a_standard_column_stem() -> None:
    stems = {c.removesuffix(" (s)").casefold() for c in STANDARD_COLUMNS if c.endswith(" (s)")}
    assert stems == set(wire._RESERVED_NAMES)


def test_every_list_of_step_parts_is_a_view_of_the_table() -> None:
    step = (wire.TRAINING_DATA_LOADING, wire.FORWARD, wire.BACKWARD, wire.OPTIMIZATION)
    assert tuple(p.phase for p in wire.STEP_PHASES) == step
    assert merge.STRAGGLER_PHASES == efficiency._PHASE_IDS == step
    assert stragglers.PHASES == ("data loading", "forward", "backward", "optimization")
    assert stragglers.PRE_SYNC == (0, 1)  # data loading and forward: before the all-reduce
    assert efficiency._NO_ITERATIONS.phase_s.shape == (0, len(step))
    assert goodput._GPU_PHASES == (wire.FORWARD, wire.BACKWARD, wire.OPTIMIZATION)
    assert STEP_PARTS == ("loading", "forward", "backward", "optimization")
    # report --prometheus reads one series per report phase, in PHASE_MEANS' order
    assert [f"{name} mean (s)" for name in from_prometheus._KEYS] == PHASE_MEANS
    assert list(from_prometheus._KEYS.values()) == [
        "train_loop",
        "train_loading",
        "forward",
        "backward",
        "optimization",
    ]


def test_promql_over_the_step_parts_names_the_table_s_step_phases() -> None:
    """The dashboard's, the metrics page's and the README's queries over the step parts
    match exactly the table's step phases, so a new step phase is not left out of them."""
    step = "|".join(p.metric for p in wire.STEP_PHASES)
    exprs = [
        target["expr"]
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        for target in panel.get("targets", [])
    ]
    texts = {
        "dashboard": "\n".join(exprs),
        "docs/metrics.md": (ROOT / "docs" / "metrics.md").read_text(),
        "README.md": (ROOT / "README.md").read_text(),
    }
    for name, text in texts.items():
        found = PHASE_REGEX.findall(text)
        assert found, f"{name} has no query over the step parts"
        assert set(found) == {step}, name
