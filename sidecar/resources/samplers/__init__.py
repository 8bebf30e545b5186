"""The sidecar's samplers: NVML GPU telemetry, the job's process tree, a drift-free
schedule, and the summaries of what they sampled. ``docs/samplers.md`` explains them.

The sampling interval: NVML utilization is the share of a driver window (1/6 s to 1 s,
by product) during which a kernel ran, so polling faster than about once per window
repeats values. One second matches the slowest window, keeps a sampling round (~25 µs
per NVML call, about a dozen calls per GPU) far below 1 % of a core, and still resolves
phases of a few seconds. 0.2 s is the floor: below it most GPUs return repeated values
and the sidecar's own cost grows with no new information.
"""

DEFAULT_INTERVAL_S = 1.0
MIN_INTERVAL_S = 0.2
