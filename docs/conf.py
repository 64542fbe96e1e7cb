"""Sphinx configuration for tdhook."""

project = "tdhook"
author = "tdhook developers"
copyright = "2026, tdhook developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
html_theme = "alabaster"
nitpicky = False
suppress_warnings = ["myst.header"]
