"""Singhal & Steinke (NeurIPS 2021): private subspace learners, baselines and tuning (§2)."""

from dpjax.subspace.approximate import (DPASEParameters, dpase, dpase_core, dpase_gathered,
                                        dpase_parameters, num_subsets_for)
from dpjax.subspace.baselines import analyze_gauss, pca_subspace
from dpjax.subspace.boosted import dpaseb, num_blocks_for
from dpjax.subspace.exact import dpese
from dpjax.subspace.streaming import dpase_streaming
from dpjax.subspace.tuning import CellLengthCalibration, calibrate_cell_length
