"""A run in a Jupyter notebook, executed cell by cell in a real ipykernel (nbclient)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.helpers import REPO, run_json, split_dir, wait_for

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")


def test_a_run_left_open_at_kernel_exit_is_incomplete_not_an_earlier_cells_error(
    serve, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "notebook"
    monkeypatch.setenv("SIDECAR_ENDPOINT", sidecar.endpoint)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    cells = [
        f"import markers\nrun = markers.start_run(out_dir={str(out)!r}, warmup_iterations=0)",
        "not_defined_anywhere",  # a typo in one cell: the session goes on
        "for _ in run.train_batches([[1, 2]] * 3):\n    pass",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(
        notebook, timeout=120, allow_errors=True, resources={"metadata": {"path": str(short_tmp)}}
    )
    client.execute()  # runs every cell, then shuts the kernel down with the run open
    errors = [o for o in notebook.cells[1].outputs if o.get("output_type") == "error"]
    assert errors and errors[0]["ename"] == "NameError"
    # The kernel's shutdown request returns before its process has ended.
    document = wait_for(lambda: run_json(out), 60, "run.json")
    assert document["status"] == "incomplete"
    assert document["cause"] == "the interactive session ended with the run open (no finish())"
    assert (split_dir(out) / "logs" / "computational.tsv").exists()
