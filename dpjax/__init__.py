"""dpjax: differential privacy in JAX that learns low-dimensional structure privately."""

from dpjax import (accounting, ashtiani_liaw, audit, coinpress, data, ledger, linalg, mechanisms,
                   metrics, results, robust_stats, sgd, subspace, synthetic)
from dpjax.results import (DPResult, EstimateResult, GaussianResult, SubspaceResult,
                           SyntheticDataResult)
from dpjax.subspace import calibrate_cell_length, dpase, dpase_parameters

__version__ = "0.1.0"
