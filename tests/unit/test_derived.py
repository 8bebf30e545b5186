"""A split's derived figures (``sidecar.model.derived``): the straggler rule runs once per
derivation, its waits feed the goodput accounts, and the split is left as it was."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from sidecar.model import derived, merge
from sidecar.model.aggregator import Settings
from sidecar.model.derived import derive
from sidecar.model.split import Split
from sidecar.model.stragglers import RankIterations, Stragglers, stragglers
from tests.unit.test_multi_node_units import _ranks_records


def _split(tmp_path: Path, ranks: range) -> Split:
    split = Split(tmp_path, 0, Settings(warmup_iterations=0), {"world_size": len(ranks)})
    for rank in ranks:
        _ranks_records(split.rank(rank))  # rank 2's forward is the longest
    return split


@pytest.mark.parametrize("ranks", [range(3), range(1, 3)], ids=["rank 0 here", "rank 0 elsewhere"])
def test_the_straggler_rule_runs_once_and_its_waits_make_the_accounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranks: range
) -> None:
    runs: list[int] = []

    def counted(found: Mapping[int, RankIterations]) -> Stragglers:
        runs.append(len(found))
        return stragglers(found)

    monkeypatch.setattr(merge, "stragglers", counted)
    monkeypatch.setattr(derived, "stragglers", counted)
    split = _split(tmp_path, ranks)
    before = dict(vars(split))
    figures = derive(split, "node", "host")
    assert runs == [len(ranks)]
    assert vars(split) == before  # nothing cached on the split
    assert set(figures.accounts) == set(ranks)
    for rank in ranks:
        waited_s = figures.accounts[rank].badput_s["straggler"]
        assert (waited_s > 0) == (rank != 2), rank
        assert figures.waits_s[rank] > 0 or rank == 2
    if 0 in split.ranks:  # the sidecar serving rank 0 compares and names the straggler
        assert figures.stragglers is not None and figures.stragglers.verdict.rank == 2
        assert [s.rank for s in figures.standings] == [0, 1, 2]
    else:
        assert figures.view is None and figures.standings == ()


def test_a_lone_rank_is_compared_with_nobody(tmp_path: Path) -> None:
    figures = derive(_split(tmp_path, range(1)))
    assert figures.own == () and figures.stragglers is None
    assert figures.waits_s == {0: 0.0}
    assert figures.accounts[0].badput_s["straggler"] == 0.0
