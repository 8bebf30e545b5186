"""Training parts with known costs: a forward, a backward, an optimizer step and a loader
that each spin on the clock for a set time and write down how long they really took.

Spinning (not sleeping) keeps the process busy, as real compute does; the truth each part
records is its own wall time, so a test compares the monitor's figures with what really
happened, whatever the load on the machine.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

FEATURES = 8


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread: with two, an OpenMP barrier waits for a descheduled worker on
    this busy machine and milliseconds land outside the parts' own clocks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Truth:
    """Wall seconds each part really took, per part ('forward', 'backward', ...), in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)
        # the script's clock at the end of the last SpinSGD step's own work, before the
        # step hooks that end the iteration run: where the next data loading may start
        self.stepped_at = time.perf_counter()
        # the script's clock at the start of the last SpinNet forward's body, after the
        # forward hooks that end the data loading ran: where that data loading ends at most
        self.forward_began_at = time.perf_counter()

    def cost(self, part: str, base_s: float) -> float:
        """The cost of the next call of ``part``: 1, 2 or 3 times ``base_s`` in turn, so
        that a row given another iteration's time cannot pass for its own."""
        return base_s * (1 + len(self.seconds[part]) % 3)

    @contextlib.contextmanager
    def around(self, part: str) -> Iterator[None]:
        """The script's own clock around a whole call, recorded under ``outer_<part>``:
        what a row of ``part`` may hold at most (see ``assert_between``)."""
        start = time.perf_counter()
        yield
        self.seconds[f"outer_{part}"].append(time.perf_counter() - start)

    def since(self, part: str, start: float) -> None:
        """Record the script's clock from ``start`` (perf_counter) to now under
        ``outer_<part>``."""
        self.seconds[f"outer_{part}"].append(time.perf_counter() - start)

    def spin(self, part: str, seconds: float) -> None:
        """Busy-wait ``seconds`` and record the time it really took under ``part``."""
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            pass
        self.seconds[part].append(time.perf_counter() - start)


class _SpinBackward(torch.autograd.Function):
    """Identity forward; its backward spins (the Backward phase has a known cost)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, truth: Truth, seconds: float) -> torch.Tensor:
        ctx.truth, ctx.seconds = truth, seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.truth.spin("backward", ctx.truth.cost("backward", ctx.seconds))
        return grad, None, None


class SpinNet(nn.Module):
    """A linear model whose forward spins ``forward_s`` and whose backward spins
    ``backward_s``; the truth of a forward is its whole body."""

    def __init__(self, truth: Truth, forward_s: float = 0.0, backward_s: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, 1)
        self.truth, self.forward_s, self.backward_s = truth, forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = "forward" if self.training and torch.is_grad_enabled() else "evaluation"
        cost_s = self.truth.cost(part, self.forward_s)
        start = self.truth.forward_began_at = time.perf_counter()
        out = self.linear(x)
        while time.perf_counter() - start < cost_s:
            pass
        if self.backward_s and torch.is_grad_enabled():
            out = _SpinBackward.apply(out, self.truth, self.backward_s)
        self.truth.seconds[part].append(time.perf_counter() - start)
        return out


class SpinSGD(torch.optim.SGD):
    """SGD whose step spins ``step_s`` more; the truth is the whole step."""

    def __init__(self, params: Any, truth: Truth, step_s: float = 0.0, lr: float = 0.01) -> None:
        super().__init__(params, lr=lr)
        self.truth, self.step_s = truth, step_s

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # Lightning's forward and backward: not the step's cost
            with torch.enable_grad():
                loss = closure()
        cost_s = self.truth.cost("optimization", self.step_s)
        start = time.perf_counter()
        super().step()
        while time.perf_counter() - start < cost_s:
            pass
        self.truth.stepped_at = time.perf_counter()
        self.truth.seconds["optimization"].append(self.truth.stepped_at - start)
        return loss


class SpinBatches:
    """A re-iterable loader of ``batches`` spinning batches (``spin_loader`` per pass)."""

    def __init__(
        self, truth: Truth, batches: int, seconds: float, part: str = "loading", size: int = 4
    ) -> None:
        self.truth, self.batches, self.seconds, self.part, self.size = (
            truth,
            batches,
            seconds,
            part,
            size,
        )

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return spin_loader(self.truth, self.batches, self.seconds, self.size, self.part)


def spin_loader(
    truth: Truth, batches: int, seconds: float = 0.0, size: int = 4, part: str = "loading"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``batches`` batches of ``size`` samples, each spinning 1-3 x ``seconds`` to arrive."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(batches):
        truth.spin(part, truth.cost(part, seconds))
        yield (
            torch.randn(size, FEATURES, generator=generator),
            torch.randn(size, 1, generator=generator),
        )


def assert_close(
    measured: list[float], truth: list[float], what: str, rel: float = 0.15, abs_s: float = 0.4e-3
) -> None:
    """Measured values against their truths, row by row, within ``rel`` or ``abs_s``
    seconds: none below (a row missing a batch, or shifted to another iteration, whose
    costs differ, fails here), and at least two rows in three not above. The others may
    be above by any amount: on this busy machine a process is often descheduled between a
    hook and the part it times (waking the sidecar or its own I/O thread), and the
    monitor rightly counts that time.
    """
    assert len(measured) == len(truth), f"{what}: {len(measured)} rows for {len(truth)} true"
    rows = list(zip(measured, truth, strict=True))
    text = [f"{got * 1e3:.3f}/{want * 1e3:.3f}" for got, want in rows]
    slack = [max(rel * want, abs_s) for _got, want in rows]
    below = [
        i
        for i, ((got, want), allowed) in enumerate(zip(rows, slack, strict=True))
        if got < want - allowed
    ]
    above = [
        i
        for i, ((got, want), allowed) in enumerate(zip(rows, slack, strict=True))
        if got > want + allowed
    ]
    assert not below, f"{what}: rows {below} below their truth (measured/true ms: {text})"
    assert 3 * len(above) <= len(rows), (
        f"{what}: rows {above} above their truth (measured/true ms: {text})"
    )


def assert_between(
    measured: list[float],
    inner: list[float],
    outer: list[float],
    what: str,
    rel: float = 0.15,
    slack_s: float = 0.4e-3,
) -> None:
    """Each stored row between the script's clock inside the work (``inner``: the part's
    own spin, less ``rel`` or ``slack_s``) and around the whole window the row should
    hold (``outer``, plus ``slack_s``). A pause anywhere inside the window (the scheduler,
    the garbage collector) widens both the row and its outer bound, so this holds on a
    busy machine; a row missing a batch, or holding another iteration's (whose costs
    differ by a third or more), falls outside.
    """
    assert len(measured) == len(inner) == len(outer), (
        f"{what}: {len(measured)} rows for {len(inner)} inner, {len(outer)} outer times"
    )
    rows = list(zip(measured, inner, outer, strict=True))
    text = [f"{got * 1e3:.3f} in [{low * 1e3:.3f}, {high * 1e3:.3f}]" for got, low, high in rows]
    wrong = [
        i
        for i, (got, low, high) in enumerate(rows)
        if not low - max(rel * low, slack_s) <= got <= high + slack_s
    ]
    assert not wrong, f"{what}: rows {wrong} outside their bounds (ms: {text})"
