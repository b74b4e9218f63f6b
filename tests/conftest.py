"""Shared pytest options.

* Default (``python -m pytest``): the fast suite. Tests marked ``slow`` are deselected and the
  privacy audits run at reduced trial counts; every module and every audit still runs.
* ``--run-slow``: the full suite (what CI runs): the slow tests too, and the audits at full
  trial counts.
* ``--audit-full``: full audit trial counts only (e.g. ``pytest -m audit --audit-full``).
* An explicit ``-m`` expression (e.g. ``-m slow``) selects by marker as usual and is not
  overridden.
"""

import pytest


def pytest_addoption(parser):
  parser.addoption("--run-slow", action="store_true", default=False,
                   help="the full suite: run the tests marked slow, and the privacy audits at "
                        "full trial counts (implies --audit-full)")
  parser.addoption("--audit-full", action="store_true", default=False,
                   help="run the privacy audits (tests/audit) with full trial counts")


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
