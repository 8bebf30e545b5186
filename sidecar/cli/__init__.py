"""The ``sidecar`` command line (docs/contract.md, Command line): run, serve, status, finish,
report. ``main`` (entry.py) is the console script's entry point; parsers.py reads the
command line, the handlers are clients.py (status, finish), reports.py (report) and
serving.py (serve, run)."""

from sidecar.cli.entry import main

__all__ = ["main"]
