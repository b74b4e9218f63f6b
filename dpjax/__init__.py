"""dpjax: differential privacy in JAX that learns low-dimensional structure privately."""

from dpjax import (accounting, ashtiani_liaw, audit, classic, coinpress, data, ledger, linalg,
                   mechanisms, metrics, results, robust_stats, sgd, subspace, synthetic)
from dpjax.results import (DPResult, ERMResult, EstimateResult, GaussianResult,
                           SubspaceResult, SyntheticDataResult)
from dpjax.subspace import calibrate_cell_length, dpase, dpase_parameters, dpase_streaming

# dpjax.estimators (scikit-learn-style PrivatePCA, PrivateLogisticRegression) needs the sklearn
# extra and is imported explicitly: ``from dpjax.estimators import PrivatePCA``.

__version__ = "0.1.0"
