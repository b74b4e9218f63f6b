"""Private subspace learners (ALGORITHMS.md §2)."""

from dpjax.subspace.approximate import (CellLengthCalibration, DPASEParameters,
                                        calibrate_cell_length, dpase, dpase_parameters,
                                        num_subsets_for)
from dpjax.subspace.result import SubspaceResult
