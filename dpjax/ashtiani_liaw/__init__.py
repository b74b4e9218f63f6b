"""Ashtiani & Liaw (COLT 2022): private covariances, subspaces and Gaussians with no bound on the
scale or the condition number (docs/algorithms.md §3), and their robust variants."""

from dpjax.ashtiani_liaw.calibration import (COVARIANCE_RADIUS, COVARIANCE_TEST_FRACTION,
                                             COVARIANCE_THRESHOLDS, SPEC_CHOICES,
                                             CovarianceCalibration, covariance_calibration,
                                             required_n)
from dpjax.ashtiani_liaw.covariance import (LearnCovariancePlan, al_covariance,
                                            learn_covariance, learn_covariance_plan,
                                            learn_covariance_required_n, pair_differences,
                                            second_moment)
from dpjax.ashtiani_liaw.exact_subspace import (ALSubspaceParameters, al_subspace,
                                                al_subspace_parameters, released_basis)
from dpjax.ashtiani_liaw.gaussian import (gaussian_batch_sizes, learn_gaussian,
                                          learn_gaussian_required_n)
from dpjax.ashtiani_liaw.masking import (MaskingCalibration, calibrate_masking, covariance_mask,
                                         masking_concentration, masking_epsilon,
                                         masking_privacy_loss, masking_rdp,
                                         simulated_masking_accuracy, simulated_masking_eta)
from dpjax.ashtiani_liaw.populous_mean import (PopulousThresholds, min_groups_for_test,
                                               ppme_calibration, ppme_mean)
from dpjax.ashtiani_liaw.robust import robust_covariance, robust_mean
from dpjax.ashtiani_liaw.semimetric import (closeness_matrix, euclidean_neighbour_counts,
                                            neighbour_counts, psd_distance)

# The names a user meets; each module's own __all__ holds the rest (docs/reference/map.rst).
__all__ = ["al_covariance", "al_subspace", "covariance_mask", "learn_covariance",
           "learn_covariance_required_n", "learn_gaussian", "learn_gaussian_required_n",
           "min_groups_for_test", "ppme_mean", "psd_distance", "required_n", "robust_covariance",
           "robust_mean"]
