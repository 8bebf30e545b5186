"""The run-folder layout: file names, the phase table behind ``computational.tsv`` and
the summary block, and the text width of summary.log.

Every writer and reader of a run folder (the writers here, ``sidecar report``) takes the
file names from this module; the columns are defined beside the text they head
(``tables.COLUMNS`` from the phase table, ``rowtext.PHASES_CELLS``,
``resources_text.RESOURCES_COLUMNS``).

    <out_dir>/run.json
    <out_dir>/.run.json.lock                                 (sidecar.sinks.locks)
    <out_dir>/training/split-<k>/sidecar.lock                (sidecar.sinks.locks)
    <out_dir>/training/split-<k>/summary.log
    <out_dir>/training/split-<k>/sidecar-state.json      (sidecar.model.state)
    <out_dir>/training/split-<k>/logs/computational[-rank<r>].tsv
    <out_dir>/training/split-<k>/logs/phases[-rank<r>].tsv
    <out_dir>/training/split-<k>/logs/resources.tsv
"""

from __future__ import annotations

from markers import wire
from sidecar.model.split import logs_dir as logs_dir  # the folder paths: re-exported
from sidecar.model.split import split_dir as split_dir

RUN_FILE = "run.json"
RUN_LOCK_FILE = ".run.json.lock"  # held while run.json is read, merged and replaced
SPLIT_LOCK_FILE = "sidecar.lock"  # held by the sidecar that writes the split
SUMMARY_FILE = "summary.log"
RESOURCES_FILE = "resources.tsv"
WIDTH = 106  # characters of the reference's summary block (its star and dash lines)
INDEX_LABEL = "measurement #"  # the first column of computational.tsv


def rank_suffix(rank: int) -> str:
    """'' for rank 0 (the standard files), ``-rank<r>`` beside them for the others."""
    return "" if rank == 0 else f"-rank{rank}"


def computational_file(rank: int) -> str:
    """File name of a rank's wide table."""
    return f"computational{rank_suffix(rank)}.tsv"


def phases_file(rank: int) -> str:
    """File name of a rank's long table."""
    return f"phases{rank_suffix(rank)}.tsv"


# One standard phase: its wire id, column, summary line, GPU columns (``markers.wire``).
PhaseRow = wire.PhaseDef
# The standard phases in the order of computational.tsv and of the summary block.
PHASE_ROWS: tuple[PhaseRow, ...] = wire.PHASES
TRAIN_ROWS = tuple(r for r in PHASE_ROWS if not r.validation)
VAL_ROWS = tuple(r for r in PHASE_ROWS if r.validation)
# The phases whose GPU seconds make a loop's GPU throughput.
TRAIN_GPU_PHASES = tuple(r.phase for r in TRAIN_ROWS if r.network)
VAL_GPU_PHASES = tuple(r.phase for r in VAL_ROWS if r.network)
