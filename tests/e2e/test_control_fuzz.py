"""Whatever a control message contains, the sidecar counts it as rejected and goes on
(docs/contract.md, Faults and bad input "a message the sidecar cannot parse"): JSON nested 100 000
levels deep, NaN and infinities, integers beyond 64 bits or with thousands of digits,
and a wrong type in every field of every control type. Each frame goes through a real
socket into a real sidecar process while a real job trains into it; every record of that
job is kept. And a saved state damaged anywhere (``load_state``) is loaded or refused with
a reason, never an internal error.
"""

from __future__ import annotations

import json
import random
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from markers import wire
from tests.support.frames import Client
from tests.support.helpers import progress, read_tsv, run_json, split_dir, start_job, wait_for

DEEP = 100_000


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    """JSON text nested ``depth`` levels deep (built as text: no recursion here)."""
    return open_ * depth + close * depth


# Bad values, as JSON text (NaN, Infinity and 10^4000 cannot be written by json.dumps).
NOT_FINITE = ["NaN", "Infinity", "-Infinity", "1e999"]
HUGE = [str(2**63), str(-(2**64)), "9" * 5000, "1" + "0" * 40]
DEEPLY = st.integers(1_000, DEEP).map(nested) | st.integers(1_000, 50_000).map(
    lambda n: nested(n, '{"a":', "}").replace("{}", "1")
)
WRONG_TYPES = ['"7"', "[]", "{}", "true", "1.5", '{"a": [1, 2]}']
BAD_INT = st.sampled_from([*WRONG_TYPES, *NOT_FINITE, *HUGE, "-1"]) | DEEPLY
BAD_TEXT = st.sampled_from(["5", "[]", "{}", "true", '["a"]', *NOT_FINITE]) | DEEPLY
BAD_FLAG = st.sampled_from(["1", '"yes"', "[]", "{}", "NaN"])
BAD_CHOICE = st.sampled_from(['"other"', "5", "[]", "null", "NaN"])
BAD_NUMBER = st.sampled_from(['"x"', "[]", "true", *NOT_FINITE, *HUGE[:2]])
BAD_WORDS = st.sampled_from(['"python train.py"', "[1, 2]", "{}", '[["a"]]', "[NaN]"])
BAD_NAMES = st.sampled_from(["[]", '{"torch": 2}', '"x"', '{"a": {"b": "c"}}'])
BAD_REPLY_TO = st.sampled_from(["5", "[]", "{}", '"' + "x" * 100 + '"']) | DEEPLY
REQUIRED = ["null"]  # a required or non-nullable field given null

HELLO = {
    "type": "hello",
    "out_dir": "fuzzed",
    "cwd": "/",
    "split": 0,
    "warmup_iterations": 0,
    "num_measurements": 5,
    "train_batch_size": 8,
    "val_batch_size": 8,
    "accumulation_steps": 1,
    "resume": False,
    "host": "h",
    "pid": 1,
    "user": "u",
    "job_id": "7",
    "start_unix": 1.0,
    "start_ns": 0,
    "command": ["python"],
    "versions": {"python": "3.11"},
}
# control type -> a good body, and field -> strategy of bad values
CASES: dict[str, tuple[dict[str, Any], dict[str, st.SearchStrategy[str]]]] = {
    "hello": (
        HELLO,
        {
            "out_dir": BAD_TEXT | st.sampled_from(REQUIRED),
            "cwd": BAD_TEXT,
            "split": BAD_INT,
            "warmup_iterations": BAD_INT,
            "num_measurements": BAD_INT,
            "train_batch_size": BAD_INT | st.just("0"),
            "val_batch_size": BAD_INT,
            "accumulation_steps": BAD_INT | st.just("0"),
            "resume": BAD_FLAG,
            "host": BAD_TEXT,
            "user": BAD_TEXT,
            "job_id": BAD_TEXT,
            "pid": BAD_INT | st.just(str(2**40)),
            "start_unix": BAD_NUMBER,
            "start_ns": BAD_INT,
            "command": BAD_WORDS,
            "versions": BAD_NAMES,
            "reply_to": BAD_REPLY_TO,
        },
    ),
    "phase": (
        {"type": "phase", "id": 64, "name": "fz"},
        {
            "id": BAD_INT | st.sampled_from(["63", "65534", "null"]),
            "name": BAD_TEXT | st.sampled_from(['""', '"' + "n" * 201 + '"', "null"]),
        },
    ),
    "gpu": (
        {"type": "gpu", "uuid": "GPU-1", "name": "A"},
        {"uuid": BAD_TEXT, "name": BAD_TEXT | st.sampled_from(REQUIRED)},
    ),
    "batch_size": (
        {"type": "batch_size", "kind": "train", "value": 8, "iteration": 0},
        {
            "kind": BAD_CHOICE,
            "value": BAD_INT | st.just("0"),
            "iteration": BAD_INT | st.sampled_from(REQUIRED),
        },
    ),
    "part": ({"type": "part", "data": "aGk="}, {"data": BAD_TEXT | st.sampled_from(REQUIRED)}),
    "finish": (
        {"type": "finish", "status": "completed", "error": None, "end_ns": 5},
        {"status": BAD_CHOICE, "error": BAD_TEXT, "end_ns": BAD_INT},
    ),
    "load_state": (
        {"type": "load_state", "state": {"schema": 2}},
        {
            "state": st.sampled_from(['{"schema": NaN}', '{"x": 1e999}', f"[{HUGE[2]}]"]),
            "payload_bytes": BAD_INT,
        },
    ),
    "checkpoint": ({"type": "checkpoint"}, {"reply_to": BAD_REPLY_TO}),
    "state": ({"type": "state"}, {"reply_to": BAD_REPLY_TO}),
    "status": ({"type": "status"}, {"reply_to": BAD_REPLY_TO}),
    "finish_job": (
        {"type": "finish_job", "job_id": "7"},
        {"job_id": BAD_TEXT | st.sampled_from(['""', *REQUIRED])},
    ),
}


@st.composite
def bad_bodies(draw: st.DrawFn) -> tuple[str, str]:
    """(control type, body text): a good body of that type with one field made bad."""
    kind = draw(st.sampled_from(sorted(CASES)))
    good, fields = CASES[kind]
    field = draw(st.sampled_from(sorted(fields)))
    value = draw(fields[field])
    body = {k: v for k, v in good.items() if k != field}
    text = json.dumps(body)[:-1] + f', "{field}": {value}}}'
    return kind, text


def _status(socket: zmq.Socket, client: Client, tag: str) -> dict[str, Any]:
    """The status view, asked on ``socket`` after what it sent before (same connection:
    the sidecar reads them in order)."""
    socket.send(client.control({"type": "status", "reply_to": tag}))
    assert socket.poll(20_000), "the sidecar did not answer"
    reply = json.loads(socket.recv())
    assert reply["reply_to"] == tag
    return reply


def test_any_control_message_is_counted_and_a_concurrent_run_keeps_every_record(
    serve, short_tmp: Path
) -> None:
    sidecar = serve()
    stop = short_tmp / "stop"
    job = start_job(
        sidecar.endpoint,
        short_tmp,
        "--out-dir",
        "real",
        "--iters",
        "50",
        "--warmup",
        "0",
        "--cap",
        "1000000",
        "--stop-file",
        str(stop),
        "--progress",
        str(short_tmp / "p.json"),
        stderr=subprocess.PIPE,
    )
    wait_for(
        lambda: progress(short_tmp / "p.json").get("epochs", 0) >= 1, 60, "the real job to train"
    )
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(sidecar.endpoint)
    fuzz = Client()
    socket.send(fuzz.hello("fuzz"))
    assert json.loads(socket.recv())["ok"]
    header = wire.pack_header(wire.KIND_CONTROL, 0, 0, 0, 0, fuzz.run_id)
    sent = [0]

    # First the frame of the report: one control nested 100 000 levels deep.
    socket.send(header + f'{{"type": "phase", "x": {nested(DEEP)}}}'.encode())
    socket.send(header + nested(DEEP).encode())
    view = _status(socket, fuzz, "deep")
    assert view["rejected_by_kind"]["malformed"] == 2

    @settings(
        max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(bad_bodies())
    def one_bad_message(case: tuple[str, str]) -> None:
        kind, text = case
        sent[0] += 1
        before = _status(socket, fuzz, f"b{sent[0]}")
        # a hello comes from a run of its own; the rest from the fuzzing run
        sender = Client() if kind == "hello" else fuzz
        socket.send(sender.control({"type": "x"})[: wire.HEADER.size] + text.encode())
        after = _status(socket, fuzz, f"a{sent[0]}")
        grew = {
            k: v - before["rejected_by_kind"].get(k, 0)
            for k, v in after["rejected_by_kind"].items()
            if v != before["rejected_by_kind"].get(k, 0)
        }
        assert grew == {"malformed": 1}, (kind, text[:200], grew)
        assert sidecar.process.poll() is None

    one_bad_message()
    view = _status(socket, fuzz, "end")
    assert "internal_error" not in view["rejected_by_kind"]
    assert not any(r["out_dir"].endswith("/fuzzed") for r in view["runs"])  # no bad hello
    stop.touch()
    assert job.wait(60) == 0, job.stderr.read() if job.stderr else ""
    done = progress(short_tmp / "p.json")
    document = run_json(short_tmp / "root" / "real")
    assert document["status"] == "completed"
    phases = read_tsv(split_dir(short_tmp / "root" / "real") / "logs" / "phases.tsv")
    assert done["dropped"] == 0
    assert (phases["phase"] == "Forward").sum() == done["iterations"]
    assert sidecar.process.poll() is None
    socket.close()


JUNK = [
    None,
    True,
    -1,
    0,
    2**63 - 1,
    -(2**63),
    1.5,
    -1e300,
    "x",
    "",
    [],
    {},
    [1],
    {"a": 1},
    [[1, 2]],
    ["a", "b"],
    [1, "a"],
]


def _mutated(document: Any, rng: random.Random) -> Any:
    """A copy of ``document`` with one value somewhere inside replaced by junk."""
    copy = json.loads(json.dumps(document))
    node = copy
    for _ in range(6):
        keys = sorted(node) if isinstance(node, dict) else range(len(node))
        if not keys:
            break
        key = rng.choice(list(keys))
        if isinstance(node[key], (dict, list)) and node[key] and rng.random() < 0.7:
            node = node[key]
            continue
        node[key] = rng.choice(JUNK)
        break
    return copy


def test_any_saved_state_is_loaded_or_refused_with_a_reason(serve) -> None:
    sidecar = serve()
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(sidecar.endpoint)
    client = Client()

    def ask(body: dict[str, Any]) -> dict[str, Any]:
        socket.send(client.control({**body, "reply_to": "r"}))
        assert socket.poll(20_000), "the sidecar did not answer"
        return json.loads(socket.recv())

    socket.send(client.hello("states"))
    assert json.loads(socket.recv())["ok"]
    socket.send(client.records(20))
    document = ask({"type": "state"})["state"]
    rng = random.Random(7)
    answers = Counter()
    for _ in range(300):
        reply = ask({"type": "load_state", "state": _mutated(document, rng)})
        answers[reply["ok"]] += 1
        assert reply["ok"] or reply["error"], reply
    print(f"300 damaged states: {answers[True]} loaded, {answers[False]} refused with a reason")
    assert answers[False] > 0
    assert ask({"type": "load_state", "state": document})["ok"]  # the sound one still loads
    view = sidecar.status()
    assert "internal_error" not in view["rejected_by_kind"]
    assert sidecar.process.poll() is None
    socket.close()
