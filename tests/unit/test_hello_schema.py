"""One hello schema (``markers.hello``): start_run and the sidecar refuse and default the
same way."""

from __future__ import annotations

import inspect

import pytest

from markers import hello, wire
from markers.start import start_run
from sidecar.daemon import schema
from sidecar.ingest.hello_check import settings_from_hello
from sidecar.model.aggregator import Settings


def sidecar_accepts(name: str, value: object) -> bool:
    """What the sidecar's message check says of a hello holding ``name: value``."""
    _required, nullable, check = schema.FIELDS[wire.HELLO][name]
    return nullable if value is None else check(value)


@pytest.mark.parametrize(
    ("name", "refused", "accepted"),
    [
        ("num_measurements", 0, 1),
        ("warmup_iterations", -1, 0),
        ("accumulation_steps", 0, 1),
        ("train_batch_size", 0, 1),
        ("split", -1, 0),
    ],
)
def test_both_sides_draw_the_same_line(name: str, refused: int, accepted: int) -> None:
    with pytest.raises(ValueError, match=name):
        start_run(**{name: refused})  # refused before any connection is tried
    assert not sidecar_accepts(name, refused)
    assert sidecar_accepts(name, accepted)
    if name in hello.SETTINGS:  # read again when the split's aggregation starts
        with pytest.raises(wire.WireError, match=name):
            settings_from_hello({name: refused})
        assert getattr(settings_from_hello({name: accepted}), name) == accepted


def test_a_bool_is_not_a_count_on_either_side() -> None:
    with pytest.raises(ValueError, match="num_measurements"):
        start_run(num_measurements=True)
    assert not sidecar_accepts("num_measurements", True)


def test_defaults_are_one_set() -> None:
    defaults = {name: p.default for name, p in inspect.signature(start_run).parameters.items()}
    from_hello = settings_from_hello({})
    for name in hello.SETTINGS:
        assert defaults[name] == getattr(from_hello, name) == getattr(Settings(), name)
    assert from_hello.warmup_iterations == 10 and from_hello.num_measurements == 100
