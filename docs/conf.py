"""Sphinx configuration: MyST Markdown guides, an API reference from the docstrings, MathJax vendored.

Build (offline, warnings as errors)::

    sphinx-build -W --keep-going -b html docs docs/_build/html
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "ext"))

import optax_adascale  # noqa: E402

project = "optax_adascale"
author = "The optax_adascale authors"
copyright = "2026, the optax_adascale authors"  # noqa: A001 - Sphinx's name
release = optax_adascale.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "api_entries",  # docs/ext/api_entries.py: API pages from __all__ and the coverage check
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "screenshots", "README.md", "Thumbs.db", ".DS_Store"]

# MyST: $...$ and $$...$$ maths, ::: fences, heading anchors for cross-page links.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# Google-style docstrings (Args / Returns / Examples / References).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as a field list: the members are documented once, by autodoc
# The docstrings say what each argument takes; expanded aliases (ScalarOrSchedule) read badly.
autodoc_typehints = "none"
autodoc_member_order = "bysource"
autodoc_default_options = {"show-inheritance": False}

# Maths without a CDN: MathJax 3 (tex-svg, one file, no fonts to fetch) under _static/mathjax.
mathjax_path = "mathjax/tex-svg.js"

html_theme = "furo"
html_title = f"optax_adascale {release}"
html_static_path = ["_static"]
html_theme_options = {"navigation_with_keys": True}
html_show_sourcelink = False
