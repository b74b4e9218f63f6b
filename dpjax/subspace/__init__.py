"""Private subspace learners (ALGORITHMS.md §2)."""

from dpjax.subspace.approximate import (CellLengthCalibration, DPASEParameters,
                                        calibrate_cell_length, dpase, dpase_parameters,
                                        num_subsets_for)
from dpjax.subspace.baselines import analyze_gauss, pca_subspace
from dpjax.subspace.boosted import dpaseb, num_blocks_for
from dpjax.subspace.exact import al_subspace, al_subspace_parameters, dpese
from dpjax.subspace.result import SubspaceResult
