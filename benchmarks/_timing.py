"""Timing helpers shared by the speed benchmarks: interleaved paired timings and BLAS threads.

Why interleave: on a shared machine the load drifts over seconds, so timing all of one side and
then all of the other biases the ratio; alternating calls and taking the per-pair ratio
``baseline_r / dpjax_r`` exposes both sides to the same load.

Why limit BLAS threads: NumPy's LAPACK and jax's CPU LAPACK kernels (SciPy's OpenBLAS) spin up a
thread per core; on a loaded 2-core machine that oversubscription made a batched ``eigh`` 10–20×
slower on both sides (measured), which swamps what the benchmarks compare.
"""

from __future__ import annotations

import contextlib
import os
import time

import jax
import numpy as np


def timed(fn):
  """``(seconds, result)`` of one call, waiting for jax's asynchronous results."""
  start = time.perf_counter()
  out = fn()
  jax.block_until_ready(out)
  return time.perf_counter() - start, out


def interleaved(dpjax_fn, baseline_fn, repeats: int):
  """Alternates ``dpjax_fn(r)`` and ``baseline_fn(r)``; returns their times and outputs."""
  t_j, t_b, out_j, out_b = [], [], [], []
  for r in range(repeats):
    t, o = timed(lambda: dpjax_fn(r))
    t_j.append(t)
    out_j.append(o)
    t, o = timed(lambda: baseline_fn(r))
    t_b.append(t)
    out_b.append(o)
  return t_j, t_b, out_j, out_b


def paired(dpjax_times, baseline_times) -> dict:
  """Medians and the per-pair ratio ``baseline / dpjax`` (median, min, all)."""
  ratios = np.asarray(baseline_times) / np.asarray(dpjax_times)
  return {"speedup_median": float(np.median(ratios)), "speedup_min": float(np.min(ratios)),
          "paired_ratios": ratios.tolist(),
          "dpjax_median_s": float(np.median(dpjax_times)),
          "baseline_median_s": float(np.median(baseline_times))}


def blas_threads(num: int | None):
  """A context limiting every loaded BLAS/LAPACK to ``num`` threads (None: unchanged).

  Needs ``threadpoolctl``. SciPy's LAPACK (which jax's CPU kernels call) is imported first so
  that the limit covers it as well as NumPy's.
  """
  if num is None:
    return contextlib.nullcontext()
  import scipy.linalg  # noqa: F401
  from threadpoolctl import threadpool_limits
  return threadpool_limits(limits=int(num))


def blas_info() -> list | str:
  """The loaded BLAS libraries and their thread counts (for the JSON record)."""
  try:
    from threadpoolctl import threadpool_info
  except ImportError:
    return f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}"
  return [{"library": os.path.basename(i["filepath"]), "num_threads": i["num_threads"]}
          for i in threadpool_info() if i["user_api"] == "blas"]
