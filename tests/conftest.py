"""Shared pytest options.

* Default (``python -m pytest``): the fast suite. Tests marked ``slow`` are deselected and the
  privacy audits run at reduced trial counts; every module and every audit still runs.
* ``--run-slow``: the full suite (what CI runs): the slow tests too, and the audits at full
  trial counts.
* ``--audit-full``: full audit trial counts only (e.g. ``pytest -m audit --audit-full``).
* An explicit ``-m`` expression (e.g. ``-m slow``) selects by marker as usual and is not
  overridden.
"""

import os
import shutil
import tempfile

import pytest

_CACHE_ENV = "DPJAX_TEST_COMPILATION_CACHE"


def pytest_addoption(parser):
  parser.addoption("--run-slow", action="store_true", default=False,
                   help="the full suite: run the tests marked slow, and the privacy audits at "
                        "full trial counts (implies --audit-full)")
  parser.addoption("--audit-full", action="store_true", default=False,
                   help="run the privacy audits (tests/audit) with full trial counts")


def pytest_configure(config):
  """One JAX compilation cache for this run, shared by its pytest-xdist workers.

  Each worker would otherwise compile the programs the other has already compiled (the jitted
  cores many tests share). The cache lives in a fresh temporary folder made by the controlling
  process and removed at its end: every run starts cold, so the suite's time is what a clean
  checkout costs, and nothing persists between runs.
  """
  if not hasattr(config, "workerinput"):                 # the controller (or a run with -n0)
    config._dpjax_cache = tempfile.mkdtemp(prefix="dpjax-test-jax-cache-")
    os.environ[_CACHE_ENV] = config._dpjax_cache
  import jax
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def pytest_unconfigure(config):
  path = getattr(config, "_dpjax_cache", None)
  if path:
    shutil.rmtree(path, ignore_errors=True)


def _full(config) -> bool:
  return config.getoption("--run-slow") or config.getoption("--audit-full")


def pytest_collection_modifyitems(config, items):
  if config.getoption("--run-slow") or config.getoption("markexpr"):
    return
  kept, slow = [], []
  for item in items:
    (slow if item.get_closest_marker("slow") else kept).append(item)
  if slow:
    config.hook.pytest_deselected(items=slow)
    items[:] = kept


def pytest_report_header(config):
  if config.getoption("--run-slow"):
    return "dpjax: full suite (slow tests included, audits at full trial counts)"
  return ("dpjax: fast suite (slow tests deselected, audits at reduced trial counts; "
          "--run-slow for the full suite)")


@pytest.fixture
def audit_trials(request):
  """``audit_trials(reduced, full)`` picks the trial count for this run."""
  full = _full(request.config)
  return lambda reduced, full_count: full_count if full else reduced
