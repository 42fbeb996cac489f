"""notebooks/conftest.py tells nbval never to compare SVG outputs (torchviz's differ on every run)."""

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

CONFTEST = Path(__file__).resolve().parent.parent / "notebooks" / "conftest.py"


def svg_notebook(path: Path) -> None:
    """One cell whose stored SVG output differs from the one it draws when run again."""
    cell = nbformat.v4.new_code_cell(
        "from IPython.display import SVG\n"
        "SVG('<svg xmlns=\"http://www.w3.org/2000/svg\"><text>drawn now</text></svg>')",
        execution_count=1,
    )
    stored = '<svg xmlns="http://www.w3.org/2000/svg"><text>stored</text></svg>'
    cell.outputs = [
        nbformat.v4.new_output(
            "execute_result",
            data={"image/svg+xml": stored, "text/plain": "<IPython.core.display.SVG object>"},
            execution_count=1,
        )
    ]
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [cell]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, path)


def test_nbval_skips_svg_outputs_where_the_conftest_applies(tmp_path: Path) -> None:
    # The same notebook twice: next to a copy of the conftest, and in a folder without one.
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the rootdir: no configuration from above
    svg_notebook(tmp_path / "notebooks" / "svg.ipynb")
    shutil.copy(CONFTEST, tmp_path / "notebooks" / "conftest.py")
    svg_notebook(tmp_path / "elsewhere" / "svg.ipynb")
    args = ["notebooks/svg.ipynb", "elsewhere/svg.ipynb", "--nbval", "--nbval-current-env", "-rA"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert "PASSED notebooks/svg.ipynb::Cell 0" in run.stdout, run.stdout + run.stderr
    # Without it nbval compares the SVG and fails: the check above is not vacuous.
    assert "FAILED elsewhere/svg.ipynb::Cell 0" in run.stdout, run.stdout + run.stderr
