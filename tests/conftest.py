"""Shared pytest options.

* Default (``python -m pytest``): the fast suite. Tests marked ``slow`` are deselected and the
  privacy audits run at reduced trial counts; every module and every audit still runs.
* ``--run-slow``: the full suite (run before resolving an issue the slow tests cover): the slow
  tests too, and the audits at full trial counts.
* ``--audit-full``: full audit trial counts only (e.g. ``pytest -m audit --audit-full``, which
  CI runs after the default run).
* An explicit ``-m`` expression (e.g. ``-m slow``) selects by marker as usual and is not
  overridden.
* The fast suite compiles with XLA's backend optimisation off
  (``--xla_backend_optimization_level=0``): compiling, not running, is most of its time, and this
  cuts it by about a fifth. The program (HLO) is the same; only the generated machine code, hence
  float rounding at the last bits (fused multiply-adds, reduction order), differs, so the tests
  hold at both levels (checked: one that did not exposed an inaccurate small-angle
  ``projection_distance``, since fixed). ``--run-slow``, ``--audit-full`` (whose full-count
  audits spend their time running, ~3x faster optimised) and ``--xla-default-opt`` keep XLA's
  default level, what users run; a level already set in ``XLA_FLAGS`` is left alone.
* A worker frees JAX's compiled programs (``jax.clear_caches()``) when its memory mappings pass
  half of Linux's ``vm.max_map_count``: XLA:CPU holds each compiled executable in three
  mappings, JAX's caches keep up to ~16k executables alive, and at the limit (65,530 by default,
  about 21,800 executables) XLA's compiler crashes ("LLVM compilation error: Cannot allocate
  memory", then a segfault in ``backend_compile_and_load``). A long-lived worker of the full
  suite compiles more programs than that; ``docs/development.md`` has the reduction.
"""

import gc
import os
import sys

import pytest

_FAST_COMPILE = "--xla_backend_optimization_level=0"


def pytest_addoption(parser):
  parser.addoption("--run-slow", action="store_true", default=False,
                   help="the full suite: run the tests marked slow, and the privacy audits at "
                        "full trial counts (implies --audit-full)")
  parser.addoption("--audit-full", action="store_true", default=False,
                   help="run the privacy audits (tests/audit) with full trial counts")
  parser.addoption("--xla-default-opt", action="store_true", default=False,
                   help="compile at XLA's default optimisation level in the fast suite too "
                        "(the full suite always does)")


def pytest_configure(config):
  # Before any test module starts JAX's backend (XLA_FLAGS is read then); xdist workers run this
  # too, and subprocess tests inherit the environment (helpers.run_on_devices appends to it).
  flags = os.environ.get("XLA_FLAGS", "")
  # Full-count audits are run time, not compile time: the optimised code is ~3x faster there.
  if (_full(config) or config.getoption("--xla-default-opt")
      or "xla_backend_optimization_level" in flags):
    return
  os.environ["XLA_FLAGS"] = f"{flags} {_FAST_COMPILE}".strip()


def _full(config) -> bool:
  return config.getoption("--run-slow") or config.getoption("--audit-full")


def pytest_collection_modifyitems(config, items):
  # Every slow mark says what it covers that the default run does not.
  unexplained = [item.nodeid for item in items
                 if any(not str(mark.kwargs.get("reason", "")).strip()
                        for mark in item.iter_markers("slow"))]
  if unexplained:
    raise pytest.UsageError("slow marks without a reason (use pytest.mark.slow(reason=...)): "
                            + ", ".join(unexplained[:10]))
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
  return ("dpjax: fast suite (slow tests deselected, audits at reduced trial counts, XLA_FLAGS="
          f"{os.environ.get('XLA_FLAGS', '')!r}; --run-slow for the full suite)")


def _map_limit() -> int | None:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return None                                 # not Linux: no such limit to guard


_MAP_LIMIT = _map_limit()


def _mappings() -> int:
  with open("/proc/self/maps", "rb") as f:
    return f.read().count(b"\n")


def pytest_runtest_teardown(item):
  if _MAP_LIMIT is not None and "jax" in sys.modules and _mappings() > _MAP_LIMIT // 2:
    sys.modules["jax"].clear_caches()
    gc.collect()


@pytest.fixture
def audit_trials(request):
  """``audit_trials(reduced, full)`` picks the trial count for this run."""
  full = _full(request.config)
  return lambda reduced, full_count: full_count if full else reduced
