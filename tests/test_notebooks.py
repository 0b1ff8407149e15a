"""The notebooks run top to bottom (they are stored without outputs)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# A notebook's run shrunk by its data and its length alone (the training notebook's took a
# minute of the suite): each setting must be in its notebook, or the test fails.
SHRINK = {
    "accuracy_across_resolutions.ipynb": {
        "num_train=2000": "num_train=192",
        "num_val=300": "num_val=48",
        "num_test=100": "num_test=48",
        "max_epochs=4": "max_epochs=1",
    }
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.get("outputs") for cell in code), "strip outputs"
    for setting, shrunk in SHRINK.get(path.name, {}).items():
        (cell,) = [cell for cell in code if setting in cell.source]
        cell.source = cell.source.replace(setting, shrunk)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    # a figure shows as a picture, not as "<Figure size 1000x530 with 4 Axes>"
    outputs = [output for cell in notebook.cells for output in cell.get("outputs", [])]
    assert any("image/png" in output.get("data", {}) for output in outputs)


def test_there_is_a_notebook():
    assert NOTEBOOKS
