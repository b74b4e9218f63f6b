"""Shared pytest options.

* Default (``python -m pytest``): the fast suite. Tests marked ``slow`` are deselected and the
  privacy audits run at reduced trial counts; every module and every audit still runs.
* ``--run-slow``: the full suite (run before resolving an issue the slow tests cover): the slow
  tests too, and the audits at full trial counts.
* ``--audit-full``: full audit trial counts only (e.g. ``pytest -m audit --audit-full``, which
  CI runs after the default run).
* An explicit ``-m`` expression (e.g. ``-m slow``) selects by marker as usual and is not
  overridden.
* Most of the fast suite's time is XLA compiling many small programs, so it compiles fast:
  JAX's ``jax_disable_most_optimizations`` (XLA's backend optimisation level 0, no expensive
  LLVM passes) and ``XLA_FLAGS=--xla_cpu_use_fusion_emitters=false`` (XLA:CPU's older
  elemental code generator for fusions, which compiles a small program in about half the time;
  no run-time difference measured). On 2 cores the fast suite took 360 s with the first alone,
  266 s with both (2026-11-28; 381 s at XLA's level 0 alone). The program
  (HLO) is the same; only the generated machine code, hence float rounding at the last bits
  (fused multiply-adds, reduction order), differs, so the tests hold both ways (checked: one that
  did not exposed an inaccurate small-angle ``projection_distance``, since fixed). The
  environment carries both to subprocess tests. ``--run-slow`` keeps them for every test but
  the audits, which run at full trial counts optimised (``jax_disable_most_optimizations`` off:
  run time, not compile time, ~3x faster optimised; JAX's caches are cleared when a worker
  switches, since the option is not part of JAX's cache key; XLA_FLAGS cannot change within a
  process, so their fusions use the older emitters there). ``--audit-full`` and
  ``--xla-default-opt`` compile everything at XLA's defaults, what users run. Values already set
  in ``JAX_DISABLE_MOST_OPTIMIZATIONS`` or for the emitters in ``XLA_FLAGS`` are left alone.
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

_FAST_COMPILE = "JAX_DISABLE_MOST_OPTIMIZATIONS"
_LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def pytest_addoption(parser):
  parser.addoption("--run-slow", action="store_true", default=False,
                   help="the full suite: run the tests marked slow, and the privacy audits at "
                        "full trial counts (implies --audit-full)")
  parser.addoption("--audit-full", action="store_true", default=False,
                   help="run the privacy audits (tests/audit) with full trial counts")
  parser.addoption("--xla-default-opt", action="store_true", default=False,
                   help="compile every test at XLA's default optimisation level (the audits of "
                        "--run-slow and --audit-full always do)")


_FAST = pytest.StashKey[bool]()


def pytest_configure(config):
  # Before any test module imports JAX (the flag's default is read from the environment then);
  # xdist workers run this too, and subprocess tests inherit the environment.
  if (config.getoption("--audit-full") or config.getoption("--xla-default-opt")
      or os.environ.get(_FAST_COMPILE, "1") != "1"):
    return
  os.environ[_FAST_COMPILE] = "1"
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_use_fusion_emitters" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_LEGACY_EMITTERS}".strip()
  config.stash[_FAST] = True


@pytest.fixture(autouse=True)
def _full_count_audits_compile_optimised(request):
  """Under --run-slow, the audits (full trial counts) compile at XLA's defaults, the rest fast."""
  config = request.config
  if not (config.getoption("--run-slow") and config.stash.get(_FAST, False)):
    yield
    return
  import jax
  optimise = request.node.get_closest_marker("audit") is not None
  if jax.config.read("jax_disable_most_optimizations") == optimise:   # a switch: drop the
    jax.clear_caches()                                               # other mode's programs
    jax.config.update("jax_disable_most_optimizations", not optimise)
  os.environ[_FAST_COMPILE] = "0" if optimise else "1"
  yield


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
  if not config.stash.get(_FAST, False):
    return ("dpjax: XLA's default compilation" + (", audits at full trial counts"
                                                   if _full(config) else ""))
  return ("dpjax: fast suite (slow tests deselected, audits at reduced trial counts, "
          f"{_FAST_COMPILE}={os.environ.get(_FAST_COMPILE, '')!r}; --run-slow for the full suite)")


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
