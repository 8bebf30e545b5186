"""Records in = records counted: the registry's records of reads of every kind mixed
(iterations of both kinds, accumulation, epochs, validation, iterations cut short,
phases outside iterations, a custom phase, bad records) are each aggregated or refused
and counted, none lost, whatever the reads' sizes; and the ingest guard's in-process
stages count every record they send."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from bench.ingest_stages import stages
from markers import wire
from sidecar.ingest.streams import Registry
from tests.support.frames import Client
from tests.unit.test_aggregator_arrays import CUSTOM, stream


@pytest.mark.parametrize("seed", range(8))
def test_every_record_of_mixed_kinds_is_aggregated_or_refused(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    registry = Registry(lambda out_dir, cwd, owner: tmp_path / out_dir)
    client = Client()
    hello = client.hello("job", num_measurements=rng.choice([5, 1000]))
    registry.hello(wire.decode_header(hello), wire.decode_control(hello), now_unix=100.0)
    run = registry.streams[client.run_id]
    for number, name in ((CUSTOM, "augment"), (CUSTOM + 1, "mixup")):  # the stream's two
        registry.declare_phase(run, {"id": number, "name": name})
    records = np.array(stream(rng), dtype=np.int64)
    bad = rng.sample(range(len(records)), 3)
    records[bad, wire.P_END] = records[bad, wire.P_START] - 1  # ends before it starts
    sent, seq = 0, 1
    while sent < len(records):  # reads of random sizes, each of several messages
        read = []
        for _ in range(rng.randint(1, 4)):
            part = records[sent : sent + rng.choice([1, 7, 70, 700])]
            header = wire.pack_header(wire.KIND_RECORDS, 0, seq, sent, 0, client.run_id)
            read.append((wire.decode_header(header), part))
            sent, seq = sent + len(part), seq + 1
        registry.records_batch(read, now_unix=101.0)
    status = registry.status()
    assert status["records"] == len(records) - len(bad)
    assert status["rejected_by_kind"] == {"bad_record": len(bad)}
    assert status["lost"] == 0 and status["runs"][0]["records"] == len(records)


def test_the_guard_stages_aggregate_every_record_they_decode() -> None:
    figures = stages(records=20_000, repeats=1)
    assert figures["counted"] == figures["records"] >= 20_000
    assert figures["decode_rate"] > 0 and figures["whole_rate"] > 0
