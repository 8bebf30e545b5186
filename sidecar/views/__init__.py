"""Views of runs for a person at a terminal or in CI: ``sidecar top`` (live), ``sidecar
trace`` (a timeline file) and ``sidecar compare`` (two runs, and a gate)."""
