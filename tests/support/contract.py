"""Headers the contract (docs/contract.md) spells out, written here once for the tests
that check the files against them."""

from __future__ import annotations

# computational.tsv's header, in the contract's order (custom phases follow): the
# reference's 22 columns, no index column.
STANDARD_COLUMNS = [
    "Training (s)",
    "Epoch (s)",
    "Training loop (s)",
    "Training data loading (s)",
    "Forward (s)",
    "Forward GPU (s)",
    "Forward GPU max memory (MB)",
    "Backward (s)",
    "Backward GPU (s)",
    "Backward GPU max memory (MB)",
    "Optimization (s)",
    "Optimization GPU (s)",
    "Optimization GPU max memory (MB)",
    "Validation (s)",
    "Validation loop (s)",
    "Validation data loading (s)",
    "Evaluation (s)",
    "Evaluation GPU (s)",
    "Evaluation GPU max memory (MB)",
    "Metrics computation (s)",
    "Metrics computation GPU (s)",
    "Metrics computation GPU max memory (MB)",
]
