"""Sphinx configuration of the course site (``make site``; docs/maintainers.md).

The site is built from what the repository stores: the notebooks with their outputs (myst-nb, execution
off: nbval already re-checks those outputs on every ``make test``), the glossary, the pages under docs/,
and the package's docstrings and source (autodoc, viewcode). ``docs/notebooks`` is a link to
``../notebooks``, so the notebooks' own relative links (``glossary.md#peak``, ``02_...ipynb#saves-nothing``)
work on the site as in JupyterLab. The site's own extension, ``docs/_ext/ckpt_site.py``, maps what Jupyter
writes differently (its heading anchors, ``<a id>`` anchors, links to ``../ckpt_lab/*.py``), generates the
exercises page from ``ckpt_lab.exercises``, and holds the allow-list of warnings (the build turns every
other warning into an error).

Build for students (no solutions at all in the HTML): ``make site STUDENT=1`` (``sphinx-build -t students``).
"""

from __future__ import annotations

import glob
import os
import site
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(ROOT))

# autodoc and viewcode import ckpt_lab, which needs torch: take it from the checkout's .venv (make setup),
# appended after this environment's own packages, so Sphinx's pinned versions win where both have one.
_venv = Path(os.environ.get("CKPT_LAB_VENV", ROOT / ".venv"))
_found = sorted(glob.glob(str(_venv / "lib" / "python*" / "site-packages")))
if not _found:
    raise RuntimeError(
        f"the site's API reference imports ckpt_lab and torch from {_venv}, which has no site-packages: "
        "run `make setup` first (or set CKPT_LAB_VENV to a virtual environment that has torch)"
    )
site.addsitedir(_found[0])

project = "ckpt_lab"
author = "the ckpt_lab authors"
copyright = "the ckpt_lab authors"
root_doc = "index"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_exercise",
    "sphinx_togglebutton",
    "sphinx_copybutton",
    "sphinx_design",
    "ckpt_site",
]

exclude_patterns = [
    "_build",
    "**/.ipynb_checkpoints",
    "notebooks/exercises",
    "notebooks/src",
    "results/generated",
    "Thumbs.db",
    ".DS_Store",
]

# -- notebooks: the stored outputs, never re-executed
nb_execution_mode = "off"
nb_merge_streams = True
# A stored traceback is shown as stored (nbval checks it); the notebooks tag such cells raises-exception.
nb_output_stderr = "show"
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
# Heading anchors as GitHub and myst write them; JupyterLab's own ("#9.-Where-...") are mapped by ckpt_site.
myst_heading_anchors = 4
# The stubs' and solutions' listings may be long; the notebooks' pictures are PNG, stored inline.
nb_render_image_options = {}

# -- API reference
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
python_use_unqualified_type_names = True
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_inherit_docstrings = False
napoleon_google_docstring = False
napoleon_numpy_docstring = False
# viewcode: every ckpt_lab module gets a page (ckpt_site adds those autodoc did not document), so the
# notebooks' links to ../ckpt_lab/*.py land on the site.
viewcode_line_numbers = True

# -- exercises: solutions folded ("Click to show") in the default build, absent in the students' build
hide_solutions = tags.has("students")  # noqa: F821 (Sphinx puts `tags` into this file's namespace)

# -- HTML
html_theme = "sphinx_book_theme"
html_title = "ckpt_lab: activation checkpointing from first principles"
html_static_path = ["_static"]
html_css_files = ["ckpt_lab.css"]
html_last_updated_fmt = None
html_copy_source = False
html_show_sourcelink = False
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "navigation_with_keys": False,
    # no repository buttons, no launch buttons, nothing fetched from the network
    "use_repository_button": False,
    "use_source_button": False,
    "use_issues_button": False,
    "use_edit_page_button": False,
}
# The theme's search works offline (searchindex.js); nothing is fetched at build time or by the pages.
html_permalinks_icon = "#"
# The source pages (_modules/, one per module) need no navigation tree: rendering it on each of them was
# a quarter of the build's time.
html_sidebars = {"_modules/**": []}
