"""DP primitives (docs/algorithms.md §1)."""

from dpjax.mechanisms.discrete import (discrete_gaussian, discrete_laplace,
                                       discrete_laplace_mechanism, discrete_laplace_tail,
                                       truncated_discrete_laplace)
from dpjax.mechanisms.exponential import exponential_mechanism
from dpjax.mechanisms.gap_max import (GapMaxParameters, GapMaxResult, gap_max, gap_max_core,
                                      gap_max_parameters)
from dpjax.mechanisms.gaussian import (analytic_gaussian_sigma, classic_gaussian_sigma,
                                       discretized_gaussian_mechanism, gaussian_mechanism,
                                       gaussian_noise, rdp_gaussian_sigma)
from dpjax.mechanisms.grid import Discretization, discretization
from dpjax.mechanisms.l2_laplace import (l2_laplace_beta, l2_laplace_mechanism,
                                         l2_laplace_noise)
from dpjax.mechanisms.histogram import (HistogramScalars, StableHistogram, histogram_scalars,
                                        histogram_threshold, stable_histogram,
                                        stable_histogram_core, top_bin)
from dpjax.mechanisms.laplace import laplace_mechanism, laplace_noise, laplace_scale
from dpjax.mechanisms.snapping import (snapping_l1_mechanism, snapping_mechanism,
                                       snapping_parameters)
from dpjax.mechanisms.truncated_laplace import (TruncatedLaplaceParams,
                                                discrete_truncated_laplace_bound,
                                                truncated_laplace, truncated_laplace_mechanism,
                                                truncated_laplace_params,
                                                truncated_laplace_survival)

# The names a user meets; each module's own __all__ holds the rest (docs/reference/map.rst).
__all__ = ["discrete_gaussian", "discrete_laplace", "discretization",
           "discretized_gaussian_mechanism", "exponential_mechanism", "gap_max",
           "gaussian_mechanism", "l2_laplace_mechanism", "laplace_mechanism", "snapping_mechanism",
           "stable_histogram", "truncated_laplace_mechanism"]
