"""DP-SGD with optional gradient-subspace projection (docs/algorithms.md §6)."""

from dpjax.sgd.denoise import (LowRankDenoiseState, filtered_noise_std, low_rank_denoise,
                                shrink_singular_values)
from dpjax.sgd.ghost import dense, ghost_clipped_grad_sum, ghost_norms, model_loss
from dpjax.sgd.layer_subspaces import (EmbeddingResidualState, LayerSubspaceNoiseState,
                                        TwoSidedBasis, embedding_residual_grad_sum,
                                        embedding_residual_noise, layer_subspace_noise,
                                        trajectory_bases, update_layer_bases)
from dpjax.sgd.distributed import (data_mesh, padded_size, shard_examples,
                                    sharded_poisson_clipped_sum)
from dpjax.sgd.per_example import (ClippedGradSum, clip_per_example, clipped_grad_sum,
                                   global_norms, per_example_grads)
from dpjax.sgd.privatizer import (DPSGDPrivatizer, accumulate_microbatches, dp_sgd_privatizer,
                                  l2_norm_bound, poisson_clipped_sum)
from dpjax.sgd.routes import (DIAGNOSTIC_ROUTES, PUBLIC_ROUTES, ROUTES, RouteRun, RouteSettings,
                               gep_edge_noise_std, route_rank, train_route)
from dpjax.sgd.sampling import poisson_mask, poisson_microbatches
from dpjax.sgd.subspace_sources import (flat_per_example_grads, private_gradient_subspace,
                                        public_gradient_subspace)
from dpjax.sgd.training import TrainResult, train_dp_sgd
from dpjax.sgd.transforms import (DPNoiseState, SubspaceNoiseState, dp_aggregate,
                                  dp_gaussian_noise, subspace_dp_gaussian_noise, update_basis)
