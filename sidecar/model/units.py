"""Unit conversions shared by every stage of the sidecar (docs/contract.md, Files: "MB" is MiB)."""

BYTES_PER_MIB = 1024.0 * 1024.0  # the MB of every column and summary line
NS_PER_S = 1e9  # perf_counter_ns and monotonic_ns readings to seconds
