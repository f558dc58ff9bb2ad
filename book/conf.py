"""Sphinx configuration of the course website (``make site``; docs/site.md).

The sources are staged by ``book/build.py`` in ``_build/book/``; this folder only holds the
configuration and the hand-written pages (``index.md``, ``run.md``).
"""
project = "dtlib"
author = "dtlib contributors"
copyright = "dtlib contributors, MIT licence"

extensions = [
    "myst_nb",                  # MyST Markdown pages and executed notebooks
    "sphinx.ext.autodoc",       # the API reference from docstrings
    "sphinx.ext.napoleon",
    "sphinx-mathjax-offline",   # MathJax 3 copied into _static/: math renders with no network
]
root_doc = "index"
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

# Notebooks arrive executed (book/build.py): never run them again here.
nb_execution_mode = "off"
# Widgets need a live kernel: no widget JavaScript (it would come from a CDN); their outputs show
# the PNG the widget carries beside its view (dtlib/widgets/base.py).
nb_ipywidgets_js = {}
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
nb_merge_streams = True
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "undoc-members": False}
autodoc_typehints = "description"

html_theme = "sphinx_book_theme"
html_title = "dtlib: learn distributed training by running it"
html_theme_options = {"show_toc_level": 2, "use_download_button": False}
html_copy_source = False  # the pages are the product; the notebooks are in the repository
html_show_sourcelink = False
# The theme's light/dark switch logs a console error when no mode is set ("invalid theme mode").
html_context = {"default_mode": "light"}
html_last_updated_fmt = None
# A docstring's reST slip is a warning, not a failed build; a missing page is caught by the browser test.
suppress_warnings = ["myst.header", "misc.highlighting_failure"]
