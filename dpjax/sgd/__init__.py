"""DP-SGD as one engine (docs/algorithms.md §6): a plan that binds a sensitivity-bearing
clipped-gradient function, Poisson batch selection, one noise transform and the accountant.

A user meets these names; the modules hold the rest (``dpjax.sgd.per_example``, ``.ghost``,
``.flax_layers``, ``.gep``, ``.noise``, ``.correlation``, ``.bases``, ``.sampling``, ``.sources``,
``.distributed``, ``.denoise``, ``.filters``, ``.averaging``, ``.config``, ``.plan``, ``.training``, ``.aggregate``).
"""

from dpjax.sgd.aggregate import dp_aggregate
from dpjax.sgd.averaging import averaged_params, iterate_average
from dpjax.sgd.bases import TwoSidedBasis, bases_like, trajectory_bases
from dpjax.sgd.config import DPSGDConfig
from dpjax.sgd.correlation import (BandedToeplitz, BufferedToeplitz, banded_toeplitz,
                                   buffered_toeplitz, lambda_cgd, optimal_banded_toeplitz,
                                   optimal_buffered_toeplitz)
from dpjax.sgd.denoise import low_rank_denoise
from dpjax.sgd.distributed import data_mesh
from dpjax.sgd.filters import kalman_filter, kalman_filter_iterate, low_pass
from dpjax.sgd.flax_layers import linen_apply, nnx_apply, nnx_model
from dpjax.sgd.gep import embedding_residual_grad_sum
from dpjax.sgd.ghost import dense, ghost_clipped_grad_sum
from dpjax.sgd.noise import dp_noise, update_bases
from dpjax.sgd.per_example import clipped_grad_sum
from dpjax.sgd.plan import DPSGDPlan, dp_sgd_plan
from dpjax.sgd.quantile_clipping import (ghost_quantile_clipped_grad_sum, quantile_clip_state,
                                          quantile_clipped_grad_sum)
from dpjax.sgd.sources import (private_gradient_subspace, private_input_basis,
                               public_gradient_subspace, public_input_basis)
from dpjax.sgd.training import train_dp_sgd

__all__ = ["BandedToeplitz", "BufferedToeplitz", "DPSGDConfig", "DPSGDPlan", "TwoSidedBasis", "averaged_params",
           "banded_toeplitz", "bases_like", "buffered_toeplitz", "clipped_grad_sum",
           "data_mesh", "dense", "dp_aggregate", "dp_noise", "dp_sgd_plan",
           "embedding_residual_grad_sum", "ghost_clipped_grad_sum", "ghost_quantile_clipped_grad_sum",
           "iterate_average", "kalman_filter", "kalman_filter_iterate", "lambda_cgd",
           "linen_apply", "low_pass", "low_rank_denoise",
           "nnx_apply", "nnx_model", "optimal_banded_toeplitz", "optimal_buffered_toeplitz",
           "private_gradient_subspace", "private_input_basis", "public_gradient_subspace",
           "public_input_basis", "quantile_clip_state", "quantile_clipped_grad_sum",
           "train_dp_sgd", "trajectory_bases", "update_bases"]
