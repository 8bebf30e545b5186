"""Which failed MLflow requests may have been applied (their points "not confirmed"),
with MLflow's own client against real sockets: one that accepts and never answers (a
server that stopped answering) and a port nobody listens on."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("mlflow")

from sidecar.exports.mlflow import maybe_applied


def _error(uri: str) -> BaseException:
    from mlflow.tracking import MlflowClient

    with pytest.raises(Exception) as caught:
        MlflowClient(tracking_uri=uri).get_experiment_by_name("x")
    return caught.value


@pytest.mark.timeout(60)
def test_a_request_without_an_answer_may_be_applied_a_refused_one_not() -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections are accepted by the kernel, never answered
    try:
        unanswered = _error(f"http://127.0.0.1:{silent.getsockname()[1]}")
    finally:
        silent.close()
    assert maybe_applied(unanswered), repr(unanswered)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nobody listens there now: refused
    assert not maybe_applied(_error(f"http://127.0.0.1:{port}"))
