"""Singhal & Steinke (NeurIPS 2021): private subspace learners, baselines and tuning (§2)."""

from dpjax.subspace.approximate import (DPASEParameters, dpase, dpase_max_gamma,
                                        dpase_parameters, dpase_required_n, num_subsets_for)
from dpjax.subspace.baselines import analyze_gauss, analyze_gauss_required_n, pca_subspace
from dpjax.subspace.boosted import dpaseb, num_blocks_for
from dpjax.subspace.exact import dpese, dpese_required_n
from dpjax.subspace.tuning import CellLengthCalibration, calibrate_cell_length

# The names a user meets; each module's own __all__ holds the rest (docs/reference/map.rst).
__all__ = ["analyze_gauss", "analyze_gauss_required_n", "calibrate_cell_length", "dpase",
           "dpase_max_gamma", "dpase_parameters", "dpase_required_n", "dpaseb", "dpese",
           "dpese_required_n", "pca_subspace"]
