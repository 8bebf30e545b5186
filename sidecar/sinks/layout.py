"""The run-folder layout, defined once: file names, the phase table behind
``computational.tsv`` and the summary block, and the text width of summary.log.

Every writer and reader of a run folder (the writers here, ``sidecar report`` later) takes
names and columns from this module.

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

from dataclasses import dataclass

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


@dataclass(frozen=True)
class PhaseRow:
    """One standard phase: its wire id, its line in the summary block (label, indent,
    validation table or not) and whether it has GPU columns."""

    phase: int
    summary_label: str
    indent: int
    validation: bool
    gpu: bool

    @property
    def column(self) -> str:
        """Its label in computational.tsv (``<label> (s)``; the GPU columns add to it)."""
        return wire.PHASE_LABELS[self.phase]


# The standard phases in the order of computational.tsv and of the summary block.
PHASE_ROWS: tuple[PhaseRow, ...] = (
    PhaseRow(wire.TRAINING, "Training", 0, False, False),
    PhaseRow(wire.EPOCH, "Epoch", 1, False, False),
    PhaseRow(wire.TRAINING_LOOP, "Iteration", 2, False, False),
    PhaseRow(wire.TRAINING_DATA_LOADING, "Data loading", 3, False, False),
    PhaseRow(wire.FORWARD, "Forward", 3, False, True),
    PhaseRow(wire.BACKWARD, "Backward", 3, False, True),
    PhaseRow(wire.OPTIMIZATION, "Optimization", 3, False, True),
    PhaseRow(wire.VALIDATION, "Validation", 0, True, False),
    PhaseRow(wire.VALIDATION_LOOP, "Iteration", 1, True, False),
    PhaseRow(wire.VALIDATION_DATA_LOADING, "Data loading", 2, True, False),
    PhaseRow(wire.EVALUATION, "Evaluation", 2, True, True),
    PhaseRow(wire.METRICS, "Metrics computation", 2, True, True),
)
TRAIN_ROWS = tuple(r for r in PHASE_ROWS if not r.validation)
VAL_ROWS = tuple(r for r in PHASE_ROWS if r.validation)
# The phases whose GPU seconds make a loop's GPU throughput (SPEC §3).
TRAIN_GPU_PHASES = (wire.FORWARD, wire.BACKWARD, wire.OPTIMIZATION)
VAL_GPU_PHASES = (wire.EVALUATION,)
