"""dpjax: differential privacy in JAX that learns low-dimensional structure privately."""

from dpjax import accounting, audit, covariance, data, linalg, mechanisms, metrics, sgd, subspace
from dpjax.subspace import SubspaceResult, calibrate_cell_length, dpase, dpase_parameters

__version__ = "0.1.0"
