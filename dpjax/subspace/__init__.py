"""Singhal & Steinke (NeurIPS 2021): private subspace learners, baselines and tuning (§2)."""

from dpjax.subspace.approximate import (DPASEParameters, dpase, dpase_parameters,
                                        dpase_required_n, num_subsets_for)
from dpjax.subspace.baselines import analyze_gauss, pca_subspace
from dpjax.subspace.boosted import dpaseb, num_blocks_for
from dpjax.subspace.exact import dpese
from dpjax.subspace.tuning import CellLengthCalibration, calibrate_cell_length

# The names a user meets; each module's own __all__ holds the rest (README, "API map").
__all__ = ["analyze_gauss", "calibrate_cell_length", "dpase", "dpase_parameters",
           "dpase_required_n", "dpaseb", "dpese", "pca_subspace"]
