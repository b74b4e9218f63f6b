"""Sphinx configuration of dpjax's API reference (built from the docstrings).

Build: ``python -m sphinx -W --keep-going -b html docs/reference build/reference``
(``.ci/run`` builds it with warnings as errors).
"""

project = "dpjax"
author = "the dpjax developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.autosummary", "sphinx.ext.napoleon",
              "sphinx.ext.mathjax"]
autosummary_generate = False
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_typehints = "none"          # the docstrings state shapes and dtypes in words
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True           # "Attributes:" as fields: no duplicate of autodoc's members
default_role = "code"
html_theme = "alabaster"
exclude_patterns = ["_build"]


def _skip_generated(app, what, name, obj, skip, options):
  """scikit-learn's generated ``set_*_request`` methods are not dpjax's API."""
  if name.startswith("set_") and name.endswith("_request"):
    return True
  return skip


def setup(app):
  app.connect("autodoc-skip-member", _skip_generated)
