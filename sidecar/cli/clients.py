"""The commands that ask a running sidecar (status, finish) and the request they
share (also the views'): one line on stderr when none answers."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from markers import endpoints, wire
from markers import secret as shared_secret

STATUS_TIMEOUT_S = 5.0  # a busy daemon answers after the messages queued before


def ask(command: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """Send ``body`` to the sidecar at ``endpoint`` and return its reply (without the
    protocol keys); None, after one line on stderr, when none answers."""
    from markers.transport import Sender  # the client side of the same wire

    socket_file = endpoints.ipc_path(endpoint)
    if socket_file is not None and not socket_file.exists():
        print(
            f"sidecar {command}: no sidecar at {endpoint} (its socket file does not exist)",
            file=sys.stderr,
        )
        return None
    # a job's own sidecar on ipc keeps its secret beside the socket, for its user
    secret = shared_secret.read_beside(socket_file) if socket_file is not None else None
    sender = Sender(
        endpoints.connect_address(endpoint),
        b"\0" * 16,
        0,
        secret or os.environ.get(shared_secret.ENV),
    )
    try:
        reply = sender.request(body, STATUS_TIMEOUT_S, connect_timeout_s=STATUS_TIMEOUT_S)
        refused = sender.refused
    finally:
        sender.close()
    if reply is None:
        print(
            f"sidecar {command}: "
            + (
                f"{refused} ({endpoint})"
                if refused
                else f"no sidecar answered at {endpoint} within {STATUS_TIMEOUT_S:.0f} s"
            ),
            file=sys.stderr,
        )
        return None
    reply.pop("reply_to", None)
    return reply


def _gpu_line(gpu: dict[str, Any]) -> str:
    answers = f"NVML does not answer ({gpu['lost_reason']})" if gpu["lost"] else "NVML answers"
    unsupported = "; ".join(f"{call} ({why})" for call, why in gpu["unsupported"].items())
    return f"  GPU {gpu['index']} {gpu['name']} {gpu['uuid']}: {answers}" + (
        f"; unsupported: {unsupported}" if unsupported else ""
    )


def status_command(endpoint: str, job: str | None, as_json: bool) -> int:
    """``sidecar status``: the sidecar at ``endpoint``, its samplers and runs (of Slurm job
    ``job`` only, when given), as lines or as one JSON object; 1 when none answers."""
    reply = ask("status", endpoint, {"type": wire.STATUS})
    if reply is None:
        return 1
    reply.pop("ok", None)
    if job is not None:
        reply["runs"] = [run for run in reply["runs"] if run.get("job_id") == job]
    if as_json:
        print(json.dumps(reply))
        return 0
    samplers = reply["samplers"]
    print(
        f"sidecar pid {reply['pid']} on {reply['endpoint']}; sampling every "
        f"{samplers['interval_s']:g} s: host {samplers['host']}, GPU {samplers['gpu']}"
    )
    print(
        f"records {reply['records']} ({reply['records_per_s']:.0f}/s, mean over the last "
        f"{reply['rate_window_s']:.1f} s), dropped "
        f"{reply['dropped']}, lost {reply['lost']}, rejected {reply['rejected']} "
        f"{reply['rejected_by_kind'] or ''}".rstrip()
    )
    if reply.get("job_ids_dropped"):
        print(
            f"Slurm job ids dropped (their process belongs to no such job): "
            f"{reply['job_ids_dropped']}"
        )
    for gpu in samplers.get("gpus", []):
        print(_gpu_line(gpu))
    if reply.get("last_error"):
        print(f"last error: {reply['last_error']}")
    for run in reply["runs"]:
        job_id = f" job {run['job_id']}" if run.get("job_id") else ""
        print(
            f"  run {run['run_id'][:8]}{job_id} split {run['split']} rank {run['rank']} "
            f"pid {run['pid']} {run['status']}: {run['records']} records -> {run['out_dir']}"
            + (f" (write error: {run['write_error']})" if run["write_error"] else "")
        )
    return 0


def finish_command(endpoint: str, job: str) -> int:
    """``sidecar finish --job``: the sidecar at ``endpoint`` ends and writes Slurm job
    ``job``'s runs; 1 when none answers or it refuses."""
    reply = ask("finish", endpoint, {"type": wire.FINISH_JOB, "job_id": job})
    if reply is None:
        return 1
    if not reply.get("ok"):
        print(f"sidecar finish: refused: {reply.get('error')}", file=sys.stderr)
        return 1
    print(f"sidecar finish: job {job}: {reply['finished']} runs ended and written")
    return 0
