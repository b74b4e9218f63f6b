"""Shared pytest options: ``--audit-full`` runs the privacy audits at full trial counts."""

import pytest


def pytest_addoption(parser):
  parser.addoption("--audit-full", action="store_true", default=False,
                   help="run the privacy audits (tests/audit) with full trial counts")


@pytest.fixture
def audit_trials(request):
  """``audit_trials(reduced, full)`` picks the trial count for this run."""
  full = request.config.getoption("--audit-full")
  return lambda reduced, full_count: full_count if full else reduced
