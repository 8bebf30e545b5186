"""The run-folder layout: file names, the phase table behind ``computational.tsv`` and
the summary block, and the text width of summary.log.

Every writer and reader of a run folder (the writers here, ``sidecar report``) takes the
file names from this module; the columns are defined beside the text they head
(``tables.COLUMNS`` from the phase table, ``rowtext.PHASES_CELLS``,
``resources.fields.columns()``).

    <out_dir>/run.json
    <out_dir>/.run.json.lock                                 (sidecar.sinks.locks)
    <out_dir>/training/split-<k>/claims/rank-<r>.lock         (sidecar.sinks.locks)
    <out_dir>/training/split-<k>/sidecar.lock  (older versions' claim: read, never written)
    <out_dir>/training/split-<k>/nodes/<node-id>.json         (sidecar.sinks.nodes)
    <out_dir>/training/split-<k>/summary.log
    <out_dir>/training/split-<k>/sidecar-state.json      (sidecar.model.state)
    <out_dir>/training/split-<k>/logs/computational[-rank<r>].tsv
    <out_dir>/training/split-<k>/logs/phases[-rank<r>].tsv
    <out_dir>/training/split-<k>/logs/sample[-rank<r>].tsv  (past the cap)
    <out_dir>/training/split-<k>/logs/resources.tsv      (rank 0's node)
    <out_dir>/training/split-<k>/logs/resources-<node-id>.tsv  (every other node)
    <out_dir>/training/split-<k>/logs/ranks.tsv          (rank 0's node, several ranks)
    <out_dir>/training/split-<k>/state/<node-id>.json    (resume state of another node)
"""

from __future__ import annotations

from markers import wire

RUN_FILE = "run.json"
RUN_LOCK_FILE = ".run.json.lock"  # held while run.json is read, merged and replaced
CLAIMS_DIR = "claims"  # claims/rank-<r>.lock: held by the sidecar that writes rank r
# The one claim of a whole split that versions before per-rank claims held: a folder they
# wrote names its last run of each rank there (read for the lineage of a resume).
OLD_SPLIT_CLAIM_FILE = "sidecar.lock"
NODES_DIR = "nodes"  # nodes/<node-id>.json: each sidecar's figures of its ranks
RANKS_FILE = "ranks.tsv"
SUMMARY_FILE = "summary.log"
RESOURCES_FILE = "resources.tsv"
WIDTH = 106  # characters of the reference's summary block (its star and dash lines)
# The index column that computational.tsv of earlier versions started with (the reference
# writes none): readers still accept it.
INDEX_LABEL = "measurement #"


def rank_suffix(rank: int) -> str:
    """'' for rank 0 (the standard files), ``-rank<r>`` beside them for the others."""
    return "" if rank == 0 else f"-rank{rank}"


def claim_file(rank: int) -> str:
    """Path, relative to the split folder, of the lock file that claims ``rank``."""
    return f"{CLAIMS_DIR}/rank-{rank}.lock"


def node_resources_file(node_id: str) -> str:
    """File name of the resource samples of a node that does not serve rank 0."""
    return f"resources-{node_id}.tsv"


def computational_file(rank: int) -> str:
    """File name of a rank's wide table."""
    return f"computational{rank_suffix(rank)}.tsv"


def phases_file(rank: int) -> str:
    """File name of a rank's long table."""
    return f"phases{rank_suffix(rank)}.tsv"


def sample_file(rank: int) -> str:
    """File name of a rank's whole-run sample (phases.tsv's columns)."""
    return f"sample{rank_suffix(rank)}.tsv"


# The standard phases (``wire.PHASES``) of each table of the summary block.
TRAIN_ROWS = tuple(r for r in wire.PHASES if not r.validation)
VAL_ROWS = tuple(r for r in wire.PHASES if r.validation)
# The phases whose GPU seconds make a loop's GPU throughput.
TRAIN_GPU_PHASES = tuple(r.phase for r in TRAIN_ROWS if r.network)
VAL_GPU_PHASES = tuple(r.phase for r in VAL_ROWS if r.network)
