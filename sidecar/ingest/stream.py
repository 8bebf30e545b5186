"""One training process (one ``start_run``) as the sidecar knows it: its run id, the split
it feeds, its sequence and record counts, its custom phases and the payload it is sending
in parts."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from sidecar.ingest.peers import Peer
from sidecar.model.aggregator import RankAggregator
from sidecar.model.split import Split

HOSTNAME = socket.gethostname()


@dataclass
class Stream:
    """One training process (one ``start_run``) sending to this sidecar."""

    run_id: bytes
    split: Split
    rank: int
    pid: int
    host: str
    start_unix: float = 0.0
    start_ns: int = 0
    previous_end_unix: float | None = None  # last activity of the split's previous process
    last_seq: int = -1
    received: int = 0
    finished: bool = False
    custom_names: dict[int, str] = field(default_factory=dict)  # declared: wire id -> name
    owner: Peer | None = None  # the kernel's word on who started it (ipc), else unknown
    payload: bytearray = field(default_factory=bytearray)  # parts received for a request
    # wire id -> key in the aggregator ``_keys_of`` (names map to keys, ids are per process)
    _keys: dict[int, int] = field(default_factory=dict)
    _keys_of: object = None

    @property
    def key(self) -> str:
        """The run id as hex, used in files and the status view."""
        return self.run_id.hex()

    def is_local(self) -> bool:
        """True when the process runs on this host, so its pid can be watched."""
        return self.host == HOSTNAME

    def custom_keys(self, agg: RankAggregator) -> dict[int, int]:
        """This process's custom phase ids mapped to ``agg``'s keys, by name."""
        if self._keys_of is not agg or len(self._keys) != len(self.custom_names):
            self._keys = {i: agg.custom_key(name) for i, name in self.custom_names.items()}
            self._keys_of = agg
        return self._keys
