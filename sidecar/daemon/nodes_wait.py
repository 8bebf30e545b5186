"""The bounded wait, at the end of a split served by several sidecars, of the sidecar that
serves rank 0 for the other nodes' final figures (docs/multi-node.md).

When its own ranks ended, it waits up to ``--nodes-wait`` seconds (counted from that end)
for every expected rank (0 … world size − 1) to be covered by a final node file; then the
summary is written once more, for good. A node whose file is still not final is written
``incomplete`` with the cause, and so is the split; ranks that never sent any figures are
named. The seconds the wait added are kept (``Split.nodes_waited_s``) and shown in the
summary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from sidecar.model.split import NEVER_WROTE, LateNode, Split
from sidecar.sinks import nodes

log = logging.getLogger("sidecar")

DEFAULT_NODES_WAIT_S = 30.0
NODE_FILE_S = 2.0  # a split shared with other sidecars: its node file is refreshed this often


def waiting(split: Split) -> bool:
    """Whether ``split`` ended here, is led from here (rank 0) and its wait is not over."""
    return (
        split.end_unix is not None
        and 0 in split.ranks
        and split.multi_node
        and split.nodes_waited_s is None
    )


def settle(split: Split, now_unix: float, wait_s: float) -> bool:
    """Check a waiting split's other nodes at ``now_unix``: True when its wait is over
    (every expected rank covered, or ``wait_s`` passed since its ranks ended), after
    which the split carries what the summary says of the late nodes; False to wait on."""
    if not waiting(split):
        return True
    assert split.end_unix is not None  # waiting() says so
    found = nodes.read_nodes(split.split_dir)
    since_unix = min(
        (agg.sessions[-1].start_unix for agg in split.ranks.values() if agg.sessions), default=0.0
    )
    missing = nodes.uncovered(range(split.world_size), set(split.ranks), found, since_unix)
    if missing and now_unix < split.end_unix + wait_s:
        return False
    split.nodes_waited_s = max(0.0, now_unix - split.end_unix)
    reported: set[int] = set()
    for node in found:
        if any(f.rank in missing for f in node.ranks) and node.node_id not in split.late_nodes:
            cause = (
                f"node {node.host} sent no final figures within {wait_s:g} s (its "
                "sidecar or job stopped)"
            )
            split.late_nodes[node.node_id] = LateNode(
                node.host, tuple(sorted(f.rank for f in node.ranks)), cause, node.written_unix
            )
            split.set_status("incomplete", cause)
            reported.update(f.rank for f in node.ranks)
    never = [rank for rank in missing if rank not in reported]
    if never:
        cause = (
            f"ranks {', '.join(map(str, never))} sent no "
            f"figures within {wait_s:g} s (their node never wrote)"
        )
        # run.json gives them a node entry of their own (or marks the one their node
        # wrote before it died), incomplete, ended when the wait did
        split.late_nodes[NEVER_WROTE] = LateNode(None, tuple(never), cause, now_unix)
        split.set_status("incomplete", cause)
    log.info(
        "split %d of %s: waited %.2f s for the other nodes%s",
        split.split,
        split.out_dir,
        split.nodes_waited_s,
        f"; ranks {', '.join(map(str, missing))} not final" if missing else "",
    )
    split.dirty = True
    return True


class NodesWork:
    """The server's periodic multi-node work: ``write(split)`` writes a split's files,
    ``write_node_file(split)`` only this sidecar's node file of it."""

    def __init__(
        self,
        wait_s: float,
        write: Callable[[Split], object],
        write_node_file: Callable[[Split], None],
    ) -> None:
        self.wait_s = wait_s
        self._write = write
        self._write_node_file = write_node_file
        self._next_node_files = 0.0

    def tick(self, splits: Iterable[Split], now_unix: float) -> None:
        """At ``now_unix``: write the splits whose wait ended; every ``NODE_FILE_S``,
        refresh the node file of each live split that changed and that other sidecars
        serve too."""
        splits = list(splits)
        for split in splits:
            if waiting(split) and settle(split, now_unix, self.wait_s):
                self._write(split)
        if now_unix >= self._next_node_files:
            self._next_node_files = now_unix + NODE_FILE_S
            for split in splits:
                if split.end_unix is None and split.dirty and split.multi_node:
                    self._write_node_file(split)

    def wait(self, splits: list[Split], poll_s: float) -> None:
        """Block until the wait of every split led from here ended (the sidecar's end)."""
        while not all(settle(split, time.time(), self.wait_s) for split in splits):
            time.sleep(poll_s)
