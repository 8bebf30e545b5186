"""Run ids bound to their user and token (``sidecar.daemon.ownership``), kept in a file a
restarted daemon reads, and the /metrics viewers (``sidecar.daemon.viewers``)."""

from __future__ import annotations

from pathlib import Path

from sidecar.daemon.ownership import FILE_NAME, Owners
from sidecar.daemon.viewers import ALL, Viewers
from sidecar.ingest.peers import Peer

ALICE, BOB = Peer(1001, 1001, 10), Peer(1002, 1002, 20)
RUN = bytes(range(16))


def test_a_bound_run_refuses_others_and_survives_a_restart(tmp_path: Path) -> None:
    owners = Owners(tmp_path)
    assert owners.refusal(RUN, BOB, {"token": "x"}) is None  # not bound yet
    owners.bind(RUN, ALICE, {"token": "alice's"})
    assert (tmp_path / FILE_NAME).stat().st_mode & 0o777 == 0o600
    again = Owners(tmp_path)  # a fresh daemon process
    for where in (owners, again):
        assert where.refusal(RUN, ALICE, {"token": "alice's"}) is None
        assert where.refusal(RUN, ALICE, None) is None  # records: the uid is enough
        kind, why = where.refusal(RUN, BOB, {"token": "alice's"}) or ("", "")
        assert kind == "foreign_user" and "not" in why
        assert (where.refusal(RUN, BOB, None) or ("",))[0] == "foreign_user"
        assert (where.refusal(RUN, ALICE, {"token": "guess"}) or ("",))[0] == "foreign_run"
    again.forget([RUN], now_unix=1e12, keep_s=1.0)  # still held in memory: kept
    assert again.refusal(RUN, BOB, None) is not None
    again.forget([], now_unix=1e12, keep_s=1.0)
    assert again.refusal(RUN, BOB, None) is None
    assert Owners(tmp_path).refusal(RUN, BOB, None) is None  # the drop was saved


def test_no_hello_may_take_the_run_id_of_requests_about_no_run(tmp_path: Path) -> None:
    owners = Owners(tmp_path)
    assert (owners.refusal(bytes(16), BOB, {"token": "x"}) or ("",))[0] == "malformed"
    assert owners.refusal(bytes(16), ALICE, None) is None  # alice's status request


def test_a_scrape_sees_what_its_token_allows(tmp_path: Path) -> None:
    assert Viewers(shared=False).viewer(None) == ALL
    viewers = Viewers(shared=True, admin_token="adm")
    assert viewers.viewer(None) is None
    assert viewers.viewer("Bearer adm") == ALL
    assert viewers.viewer("Basic adm") is None
    assert viewers.viewer("Bearer nope") is None
