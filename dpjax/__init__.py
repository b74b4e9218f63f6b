"""dpjax: differential privacy in JAX that learns low-dimensional structure privately.

Subpackages load on first use (PEP 562), so ``import dpjax`` imports neither JAX nor
``dp_accounting``: ``dpjax.sgd`` (or ``from dpjax import sgd``) imports that subpackage then.
``dpjax.estimators`` (scikit-learn-style ``PrivatePCA``, ``PrivateLogisticRegression``; the
``sklearn`` extra) and ``dpjax.experiments`` (research harnesses, not public API) are imported
explicitly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_SUBPACKAGES = ("accounting", "ashtiani_liaw", "audit", "classic", "coinpress", "data", "features",
                "ledger", "linalg", "mechanisms", "metrics", "results", "robust_stats", "sgd",
                "subspace", "synthetic")
# Names re-exported at the top level: {name: the subpackage that defines it}.
_NAMES = {"DPResult": "results", "ERMResult": "results", "EstimateResult": "results",
          "GaussianResult": "results", "SubspaceResult": "results",
          "SyntheticDataResult": "results", "UnderpoweredWarning": "results",
          "calibrate_cell_length": "subspace",
          "dpase": "subspace", "dpase_parameters": "subspace"}

__all__ = [*_SUBPACKAGES, *_NAMES]


def __getattr__(name: str):
  if name in _SUBPACKAGES:
    return importlib.import_module(f"dpjax.{name}")
  if name in _NAMES:
    value = getattr(importlib.import_module(f"dpjax.{_NAMES[name]}"), name)
    globals()[name] = value                      # later lookups skip __getattr__
    return value
  raise AttributeError(f"module 'dpjax' has no attribute {name!r}")


def __dir__():
  return sorted({*globals(), *__all__})


if TYPE_CHECKING:       # what static tools see: the eager imports this module stands for
  from dpjax import (accounting, ashtiani_liaw, audit, classic, coinpress, data, features, ledger,
                     linalg, mechanisms, metrics, results, robust_stats, sgd, subspace, synthetic)
  from dpjax.results import (DPResult, ERMResult, EstimateResult, GaussianResult,
                             SubspaceResult, SyntheticDataResult, UnderpoweredWarning)
  from dpjax.subspace import calibrate_cell_length, dpase, dpase_parameters
