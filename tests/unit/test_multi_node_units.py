"""The pieces of one split served by several sidecars (docs/multi-node.md): rank figures
through a node file and back, which ranks a final node file covers, the run.json entry
merged over nodes, the report's waiting GPU-hours, and the straggler's GPU figures from
the (fake) NVML samples of each node to the summary, ranks.tsv and the report."""

from __future__ import annotations

import io
import json
from array import array
from functools import partial
from pathlib import Path

import pandas as pd
import pytest

from sidecar.daemon import nodes_wait
from sidecar.model.aggregator import RankAggregator, Settings
from sidecar.model.derived import derive
from sidecar.model.merge import RankFigures, figures_of, merged
from sidecar.model.split import NEVER_WROTE, LateNode, Split
from sidecar.model.stragglers import PHASES
from sidecar.report.read import RunFolder, SplitFiles
from sidecar.report.straggler_columns import straggler_frame
from sidecar.resources.monitor import ResourceFigures
from sidecar.resources.samplers.nvml import NvmlSampler, open_nvml
from sidecar.sinks import nodes, ranks_text, run_file, writer
from tests.support.fake_pynvml import FakeGpu, FakeNvml
from tests.unit.test_aggregator import MS, iteration


def _figures(rank: int, loading_s: float, iterations: int = 10) -> RankFigures:
    keys = [[0, i] for i in range(iterations)]
    # each step part's seconds (a step part not named here takes none)
    steps = {"data loading": loading_s, "forward": 0.01, "backward": 0.02, "optimization": 0.001}
    return RankFigures(
        rank,
        f"host{rank // 2}",
        f"node{rank // 2}",
        "completed",
        None,
        iterations,
        iterations,
        8 * iterations,
        {"Forward": 0.01},
        {"Forward": [iterations, 0.01, 0.0]},
        keys,
        [[steps.get(name, 0.0) for name in PHASES] for _ in keys],
        [loading_s + 0.031] * iterations,
    )


def test_rank_figures_survive_a_node_file_and_name_the_straggler() -> None:
    read = [
        RankFigures.from_json(json.loads(json.dumps(f.to_json())))
        for f in (_figures(2, 0.001), _figures(3, 0.05))
    ]
    view = merged([_figures(0, 0.001), _figures(1, 0.001)], read, world_size=5)
    assert [f.rank for f in view.ranks] == [0, 1, 2, 3]
    assert view.missing == [4]
    assert view.stragglers is not None
    verdict = view.stragglers.verdict
    assert (verdict.rank, verdict.host, verdict.phase) == (3, "host1", "data loading")
    assert verdict.over_median_s == pytest.approx(0.049)


def _node(node_id: str, final: bool, written_unix: float, ranks: list[int]) -> nodes.NodeFile:
    return nodes.NodeFile(
        node_id, "h", final, "completed", None, written_unix, [_figures(r, 0.0) for r in ranks], []
    )


def test_only_final_node_files_of_this_session_cover_their_ranks() -> None:
    found = [_node("old", True, 100.0, [2, 3]), _node("new", False, 200.0, [2, 3])]
    assert nodes.uncovered(range(4), {0, 1}, found, since_unix=150.0) == [2, 3]
    found.append(_node("newer", True, 210.0, [2]))
    assert nodes.uncovered(range(4), {0, 1}, found, since_unix=150.0) == [3]


def test_run_json_keeps_every_node_and_the_worst_status_wins(tmp_path: Path) -> None:
    split = Split(tmp_path, 0, Settings(), {"world_size": 4})
    for rank in (0, 1):
        split.rank(rank).begin_session(1000.0, 0, "r")
    split.status = "completed"
    other = {
        "node_id": "elsewhere",
        "node_host": "b",
        "ranks": [2, 3],
        "status": "incomplete",
        "cause": "its sidecar stopped",
        "start_unix": 999.0,
        "end_unix": 1010.0,
        "hosts": {"b": [2, 3]},
        "gpus": [{"uuid": "GPU-b", "name": "B"}],
    }
    replaced = {"node_id": "restarted", "node_host": "a", "ranks": [1], "status": "running"}
    previous = json.dumps({"splits": {"0": {"nodes": [other, replaced]}}})
    text = run_file.run_json(split, derive(split), split.record_counts(), previous)
    entry = json.loads(text)["splits"]["0"]
    assert entry["ranks"] == [0, 1, 2, 3]
    assert (entry["status"], entry["cause"]) == ("incomplete", "its sidecar stopped")
    assert [n["node_id"] for n in entry["nodes"]] == [nodes.NODE_ID, "elsewhere"]
    assert entry["hosts"]["b"] == [2, 3] and entry["start_unix"] == 999.0
    assert entry["gpus"] == [{"uuid": "GPU-b", "name": "B"}]


def test_the_report_counts_the_gpu_hours_spent_waiting(tmp_path: Path) -> None:
    ranks = (
        "rank\thost\titerations\tmeasured\twaited (s)\n"
        "0\ta\t10\t100\t36\n1\ta\t10\t100\t0\n2\tb\t10\t100\t36\n3\tb\t10\t100\t0\n"
    )
    summary = "Straggler: rank 3 on b, data loading, +1.0e-02 s over the median before the sync\n"
    run = RunFolder(tmp_path, {}, [SplitFiles(0, 1.0, b"", 1, b"", (), summary, ranks)])
    frame = straggler_frame([run], pd.Series([8]))
    row = frame.iloc[0]
    assert (row["straggler rank"], row["straggler host"], row["straggler phase"]) == (
        "3",
        "b",
        "data loading",
    )
    # 2 ranks × 36 s × 10 (measured / stored) × 2 GPUs per rank / 3600
    assert row["waiting GPU-hours"] == pytest.approx(0.4)


def test_the_report_names_the_straggler_run_json_names(tmp_path: Path) -> None:
    """run.json's ``straggler`` of a split is what the report reads; the summary's line
    only for a split entry without it (a folder written before)."""
    summary = "Straggler: rank 3 on b, data loading, +1.0e-02 s over the median before the sync\n"
    stated = {"straggler": {"rank": 1, "host": "a", "phase": "forward"}}
    cases = {"stated": stated, "none named": {"straggler": None}, "older": {}}
    runs = [
        RunFolder(tmp_path, {}, [SplitFiles(0, 1.0, b"", 1, b"", (), summary, "", (), entry)])
        for entry in cases.values()
    ]
    frame = straggler_frame(runs, pd.Series([4, 4, 4]))
    columns = ["straggler rank", "straggler host", "straggler phase"]
    assert frame[columns].values.tolist() == [
        ["1", "a", "forward"],
        ["", "", ""],
        ["3", "b", "data loading"],
    ]


def test_run_json_states_the_straggler_and_keeps_rank_0s_on_other_nodes(tmp_path: Path) -> None:
    split = Split(tmp_path, 0, Settings(warmup_iterations=0), {"world_size": 3})
    for rank in range(3):
        _ranks_records(split.rank(rank))
    entry = json.loads(
        run_file.run_json(
            split, derive(split, nodes.NODE_ID, nodes.HOSTNAME), split.record_counts(), ""
        )
    )["splits"]["0"]
    assert entry["straggler"] == {"rank": 2, "host": nodes.HOSTNAME, "phase": "forward"}
    # a sidecar without rank 0 keeps what rank 0's stated
    other = Split(tmp_path, 0, Settings(warmup_iterations=0), {"world_size": 3})
    _ranks_records(other.rank(1))
    other.dropped["x"] = 5
    merged_entry = json.loads(
        run_file.run_json(
            other, derive(other), other.record_counts(), json.dumps({"splits": {"0": entry}})
        )
    )["splits"]["0"]
    assert merged_entry["straggler"] == entry["straggler"]
    assert merged_entry["throughput"] == entry["throughput"]
    assert merged_entry["records_dropped"] == 5


SLOW_GPU = "GPU-2c2c2c2c"


def _node_samples(fake: FakeNvml) -> ResourceFigures:
    """The node's fake GPUs sampled 2 ms into each of 20 iterations of 10 ms (inside every
    rank's) and 8 ms into it (outside), when the fake GPU SLOW_GPU is back to full clock
    and unthrottled."""
    sampler = open_nvml(None, api=fake)
    assert isinstance(sampler, NvmlSampler), sampler
    slow = next((g for g in fake.gpus if g.uuid == SLOW_GPU), None)
    samples = []
    for i in range(20):
        for offset_ms, throttled in ((2, True), (8, False)):
            if slow is not None:
                slow.sm_clock, slow.throttle_reasons = (900, 0x48) if throttled else (1980, 0)
            samples += sampler.sample(set(), (10 * i + offset_ms) * MS)
    sampler.close()
    return ResourceFigures([], None, None, {}, samples, [], 0)


def _ranks_records(agg: RankAggregator) -> RankAggregator:
    """20 iterations of 10 ms from time 0; rank 2's forward is 4 ms longer."""
    agg.begin_session(1000.0, 0)
    values: list[int] = []
    for i in range(20):
        values += iteration(i, 10.0 * i, batch=i, forward_ms=6.0 if agg.rank == 2 else 2.0)
    agg.add_records(array("q", values))
    return agg


def _node_figures(node: str, ranks: dict[int, str | None], fake: FakeNvml) -> list[RankFigures]:
    """The figures one node's sidecar leaves for ``ranks`` (rank -> the GPU it reported,
    None: a CPU rank)."""
    resources = _node_samples(fake)
    out = []
    for rank, uuid in ranks.items():
        agg = _ranks_records(RankAggregator(rank, Settings(warmup_iterations=0), 1000.0))
        readings = partial(resources.gpu_readings, uuid) if uuid is not None else None
        out.append(figures_of(agg, node, node, "completed", None, uuid, readings))
    return out


def _gpus(*uuids: str) -> FakeNvml:
    """The node's fake GPUs: SM clock 1980 MHz, 60 °C, 300 W (no energy counter: the
    instant power is the reading)."""
    return FakeNvml(
        [
            FakeGpu(
                uuid=u,
                sm_clock=1980,
                power_instant_mw=300_000,
                unsupported={"nvmlDeviceGetTotalEnergyConsumption"},
            )
            for u in uuids
        ]
    )


def test_a_throttled_gpu_of_the_straggler_is_shown_beside_its_line(tmp_path: Path) -> None:
    own = _node_figures(
        "a", {0: "GPU-0a0a0a0a", 1: "GPU-1b1b1b1b"}, _gpus("GPU-0a0a0a0a", "GPU-1b1b1b1b")
    )
    fake = _gpus(SLOW_GPU)
    fake.gpus[0].temperature = 88
    fake.gpus[0].power_instant_mw = 120_000
    # rank 3 runs on the CPU: it reported no GPU, so it has no GPU figures
    theirs = _node_figures("b", {2: SLOW_GPU, 3: None}, fake)
    # through node b's file, as the sidecar serving rank 0 reads it
    text = nodes.node_text(True, "completed", None, 4, theirs, [], {})
    read = [RankFigures.from_json(r) for r in json.loads(text)["ranks"]]
    assert [len(f.gpu) for f in read] == [20, 0]  # the samples inside rank 2's iterations
    view = merged(own, read, world_size=4)
    lines = ranks_text.rank_lines(view, 4, None)
    straggler = next(i for i, line in enumerate(lines) if line.startswith("Straggler:"))
    assert lines[straggler].startswith("Straggler: rank 2 on b, forward, +")
    assert lines[straggler + 1] == (
        "Straggler GPU: rank 2 in its 20 slowest iterations (20 samples): SM clock median "
        "900 MHz (min 900), power mean 120.0 W, temperature max 88 °C, throttle reasons "
        "hw_slowdown (100 %), hw_thermal_slowdown (100 %); the other ranks' GPUs then "
        "(40 samples): SM clock median 1980 MHz (min 1980), power mean 300.0 W, "
        "temperature max 60 °C, throttle reasons none"
    )
    tsv = ranks_text.ranks_tsv(view)
    table = pd.read_csv(io.StringIO(tsv), sep="\t", dtype=str, keep_default_na=False)
    row = table.set_index("rank").loc["2"]
    assert (row["gpu samples"], row["sm clock median (MHz)"], row["temperature max (C)"]) == (
        "20",
        "900",
        "88",
    )
    assert row["throttle reasons"] == "hw_slowdown 1.000, hw_thermal_slowdown 1.000"
    assert table.set_index("rank").loc["3", "gpu samples"] == ""  # the CPU rank
    # the report: the straggler's GPU from its row of ranks.tsv
    summary = "\n".join(lines) + "\n"
    run = RunFolder(tmp_path, {}, [SplitFiles(0, 1.0, b"", 1, b"", (), summary, tsv)])
    frame = straggler_frame([run], pd.Series([4])).iloc[0]
    assert frame["straggler rank"] == "2"
    assert frame["straggler SM clock (MHz)"] == 900.0
    assert frame["straggler power (W)"] == 120.0
    assert frame["straggler temperature (C)"] == 88.0
    assert frame["straggler throttle reasons"] == "hw_slowdown 1.000, hw_thermal_slowdown 1.000"


def test_the_writer_takes_each_rank_the_samples_of_the_gpu_it_reported(tmp_path: Path) -> None:
    split = Split(tmp_path, 0, Settings(warmup_iterations=0), {"world_size": 3})
    for rank, uuid in ((0, "GPU-0a0a0a0a"), (2, SLOW_GPU), (1, None)):
        _ranks_records(split.rank(rank))
        if uuid is not None:  # what the GPU control of the rank's markers leaves
            split.add_gpu(uuid, "NVIDIA Fake")
            split.rank_gpus[rank] = uuid
    resources = _node_samples(_gpus("GPU-0a0a0a0a", SLOW_GPU))
    # one GPU's samples of a span only (both ends in): what a rank's stored rows cover
    span = resources.gpu_readings(SLOW_GPU, 12 * MS, 28 * MS)
    assert span[:, 0].tolist() == [12 * MS, 18 * MS, 22 * MS, 28 * MS]
    assert span[:, 1].tolist() == [900, 1980, 900, 1980]
    figures = derive(split, nodes.NODE_ID, nodes.HOSTNAME, resources.gpu_readings)
    files, block = writer.render(split, figures, resources, split.record_counts(), with_state=False)
    assert block is not None
    [line] = [line for line in block if line.startswith("Straggler GPU:")]
    assert line.startswith(
        "Straggler GPU: rank 2 in its 20 slowest iterations (20 samples): SM clock median "
        "900 MHz (min 900), power mean 300.0 W, temperature max 60 °C, throttle reasons "
        "hw_slowdown (100 %), hw_thermal_slowdown (100 %); the other ranks' GPUs then "
        "(20 samples): SM clock median 1980 MHz"
    )
    table = pd.read_csv(
        io.StringIO(files[split.logs_dir / "ranks.tsv"]), sep="\t", keep_default_na=False
    )
    # over the iterations each rank was the slowest: none for rank 0; rank 1 has no GPU
    assert table["gpu samples"].astype(str).tolist() == ["0", "", "20"]


def _ended_split(tmp_path: Path, end_unix: float) -> Split:
    """A 4-rank split of which this sidecar served ranks 0 and 1, both failed at
    ``end_unix`` (the other node was killed: the all-reduce failed)."""
    split = Split(tmp_path, 0, Settings(), {"world_size": 4})
    for rank in (0, 1):
        split.rank(rank).begin_session(1000.0, 0, "r")
        split.rank(rank).end_session(int((end_unix - 1000.0) * 1e9))
    split.set_status("failed", "RuntimeError: Connection closed by peer")
    split.end_unix = end_unix
    return split


def test_a_late_node_ends_when_last_heard_of_so_the_failed_split_has_an_end(
    tmp_path: Path,
) -> None:
    """The other node wrote run.json and a node file, then was killed: its entry is
    incomplete and ends when its node file was last written; the split ends at the latest
    of its nodes' ends, not ``null``."""
    split = _ended_split(tmp_path, 1012.0)
    late = {"node_id": "b-1", "node_host": "b", "ranks": [2, 3], "status": "running"}
    late |= {"hosts": {"b": [2, 3]}, "start_unix": 1000.0, "last_unix": 1008.0}
    split.late_nodes["b-1"] = LateNode("b", (2, 3), "node b sent no final figures", 1009.0)
    text = json.dumps({"splits": {"0": {"nodes": [late]}}})
    entry = json.loads(run_file.run_json(split, derive(split), split.record_counts(), text))
    entry = entry["splits"]["0"]
    [mine, theirs] = entry["nodes"]
    assert mine["end_unix"] == 1012.0 and mine["status"] == "failed"
    assert theirs["status"] == "incomplete" and theirs["end_unix"] == 1009.0
    assert entry["status"] == "failed" and entry["end_unix"] == 1012.0
    assert entry["end"] is not None


@pytest.mark.parametrize("wrote_run_json", [False, True])
def test_a_node_that_never_wrote_its_node_file_is_incomplete_in_run_json(
    tmp_path: Path, wrote_run_json: bool
) -> None:
    """Killed before its first node file: the wait names its ranks missing, and run.json
    has them in a node entry marked incomplete with that cause (the entry it wrote before
    dying, or one of their own), which ends when the wait did."""
    split = _ended_split(tmp_path, 1012.0)
    split.status, split.cause = "completed", None  # ranks 0 and 1 completed
    assert nodes_wait.settle(split, 1015.0, 2.0)
    never = split.late_nodes[NEVER_WROTE]
    assert (never.ranks, never.end_unix) == ((2, 3), 1015.0)
    written = {"node_id": "b-1", "node_host": "b", "ranks": [2, 3], "status": "running"}
    previous = {"splits": {"0": {"nodes": [written]}}} if wrote_run_json else {}
    text = run_file.run_json(split, derive(split), split.record_counts(), json.dumps(previous))
    entry = json.loads(text)["splits"]["0"]
    [theirs] = [n for n in entry["nodes"] if n["node_id"] != nodes.NODE_ID]
    assert theirs["ranks"] == [2, 3] and theirs["status"] == "incomplete"
    assert theirs["cause"] == "ranks 2, 3 sent no figures within 2 s (their node never wrote)"
    assert theirs["node_id"] == ("b-1" if wrote_run_json else None)
    assert theirs["end_unix"] == 1015.0
    assert entry["ranks"] == [0, 1, 2, 3]
    assert (entry["status"], entry["end_unix"]) == ("incomplete", 1015.0)
