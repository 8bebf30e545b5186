"""One rank's session clock: its training processes (sessions, one more per resume) in
order, each on its own ``perf_counter_ns`` clock tied to Unix time at its start; the
split's Training and wall time across them; what the resumes cost (redone work,
downtime); and the goodput counters of each session with the account made of them
(``sidecar.model.goodput``).

``RankAggregator`` is a ``SessionClock``: the records it aggregates advance the current
session (``Session.last_ns``) and its counters, and the resume state
(``sidecar.model.state``) saves and restores these fields by the same names.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.model import goodput
from sidecar.model.units import NS_PER_S


@dataclass
class Session:
    """One training process of this rank: session 0 first, +1 per resume."""

    number: int
    start_unix: float
    start_ns: int
    last_ns: int
    end_ns: int | None = None
    run_id: str = ""  # the markers' run id (hex) of the process
    worker_phases: int = 0  # phases timed in its DataLoader workers: not measured
    gpu_unfinished: int = 0  # phases whose GPU time the GPU had not reached at the finish wait
    # the process's start (a later run of it: its own start_run call) to its hello, s
    pre_run_s: float = 0.0
    sidecar_wait_s: float = 0.0  # of which start_run waited for a private sidecar
    # The optimizer step axis across resumes: the steps done before this session (those
    # of the state it resumed from) and the training iterations it has begun so far (its
    # highest iteration number + 1). Iteration i of the session is step first_step + i.
    first_step: int = 0
    steps: int = 0
    # The framework's own training loop in this process (the Trainer's train_runtime),
    # when its callback sent it with the finish: perf_counter_ns, None when not known.
    loop_start_ns: int | None = None
    loop_end_ns: int | None = None

    def unix_at(self, ns: int) -> float:
        """Wall-clock time (Unix seconds) of the process's ``perf_counter_ns`` value ``ns``."""
        return self.start_unix + (ns - self.start_ns) / NS_PER_S

    def ns_at(self, unix: float) -> int:
        """The process's ``perf_counter_ns`` value at wall-clock time ``unix`` (Unix s):
        the inverse of ``unix_at``."""
        return self.start_ns + round((unix - self.start_unix) * NS_PER_S)

    @property
    def last_unix(self) -> float:
        """When this session was last heard of (end, else its latest record), Unix s."""
        return self.unix_at(self.end_ns if self.end_ns is not None else self.last_ns)


class SessionClock:
    """The sessions of one rank, their times and their goodput counters."""

    def __init__(self, run_start_unix: float) -> None:
        self.run_start_unix = run_start_unix
        self.sessions: list[Session] = []
        self.training_before_s = 0.0  # effective Training time of earlier sessions
        self.downtime_s = 0.0  # between a process's end and the next one's start
        self.redone_s = 0.0  # training after a checkpoint, lost by a resume from it
        # The goodput counters of each session (None: a state too old to hold them).
        self.goodput: list[goodput.Counters | None] = []

    def begin_session(self, start_unix: float, start_ns: int, run_id: str = "") -> int:
        """Start a process session (after ``load_state`` when resuming); returns its
        number. The first session's start is the run's start."""
        number = self.sessions[-1].number + 1 if self.sessions else 0
        if not self.sessions:
            self.run_start_unix = start_unix
        previous = self.sessions[-1] if self.sessions else None
        first_step = previous.first_step + previous.steps if previous is not None else 0
        self.sessions.append(
            Session(number, start_unix, start_ns, start_ns, run_id=run_id, first_step=first_step)
        )
        self.goodput.append(goodput.Counters())
        return number

    def end_session(self, end_ns: int | None) -> None:
        """Close the current session at ``end_ns`` (or its last record when unknown); a
        validation pass still open counts up to its last record."""
        if not self.sessions:
            return
        current = self.sessions[-1]
        current.end_ns = end_ns if end_ns is not None else current.last_ns
        if self.goodput[-1] is not None:
            goodput.end_session(self.goodput[-1], current.last_ns)

    def since_run_start_s(self, ns: int) -> float:
        """Seconds from the run's start (its first session's) to the current session's
        ``perf_counter_ns`` value ``ns``."""
        session = self.sessions[-1]
        return session.start_unix - self.run_start_unix + (ns - session.start_ns) / NS_PER_S

    def step(self) -> int:
        """The optimizer steps begun so far, counted from the run's start across resumes
        (the step of the iteration in progress, or of the next one)."""
        last = self.sessions[-1] if self.sessions else None
        return 0 if last is None else last.first_step + last.steps

    def training_s(self) -> float:
        """Effective Training time in seconds: earlier sessions plus the current one."""
        if not self.sessions:
            return self.training_before_s
        current = self.sessions[-1]
        end_ns = current.end_ns if current.end_ns is not None else current.last_ns
        return self.training_before_s + (end_ns - current.start_ns) / NS_PER_S

    def framework_loop_s(self) -> tuple[float, float, float, float, int] | None:
        """The framework's own training loop against Training, summed over the sessions
        whose callback sent it (``Session.loop_start_ns``): their Training, the loop's
        time, Training before the loop began and after it ended (seconds), and how many
        sessions that is; None when none sent it."""
        known = [s for s in self.sessions if s.loop_start_ns is not None]
        if not known:
            return None
        training = inside = before = after = 0
        for session in known:
            start, end = session.loop_start_ns or 0, session.loop_end_ns or 0
            finish = session.end_ns if session.end_ns is not None else session.last_ns
            training += finish - session.start_ns
            inside += end - start
            before += max(0, start - session.start_ns)
            after += max(0, finish - end)
        return (
            training / NS_PER_S,
            inside / NS_PER_S,
            before / NS_PER_S,
            after / NS_PER_S,
            len(known),
        )

    @property
    def process_start_unix(self) -> float:
        """When the split's first process started (Unix s): its ``start_run`` less its time
        before it (``Session.pre_run_s``, 0 when unknown)."""
        return self.run_start_unix - (self.sessions[0].pre_run_s if self.sessions else 0.0)

    def wall_s(self) -> float:
        """Wall time of the split in seconds, from the first process's start to the latest
        activity (the goodput account's wall): the effective Training time plus downtime
        and redone work between sessions and the processes' time before ``start_run``.
        """
        if not self.sessions:
            return 0.0
        return self.sessions[-1].last_unix - self.process_start_unix

    def account_resume(
        self, saved_unix: float, previous_end_unix: float | None, start_unix: float
    ) -> None:
        """Add one resume's cost: the training done after the checkpoint taken at
        ``saved_unix`` up to the previous process's end (redone), and the time from that
        end to the new process's start (downtime). Unix seconds; an unknown end counts the
        whole interval as downtime.
        """
        end = saved_unix if previous_end_unix is None else max(previous_end_unix, saved_unix)
        self.redone_s += end - saved_unix
        self.downtime_s += max(0.0, start_unix - end)

    def goodput_account(self, straggler_per_iteration_s: float = 0.0) -> goodput.Account:
        """This rank's goodput account (``sidecar.model.goodput``), given the time it
        waited for the slowest rank per measured iteration (seconds)."""
        times = [
            goodput.SessionTimes(
                s.start_ns,
                s.end_ns if s.end_ns is not None else s.last_ns,
                s.pre_run_s,
                s.sidecar_wait_s,
            )
            for s in self.sessions
        ]
        return goodput.account(
            times, self.goodput, self.downtime_s, self.redone_s, straggler_per_iteration_s
        )
