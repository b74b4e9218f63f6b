"""Ashtiani–Liaw: private covariances and Gaussians with no bound on the scale or the condition
number (ALGORITHMS.md §3), with CoinPress refinement and robust variants."""

from dpjax.covariance import filtering
from dpjax.covariance.coinpress import CoinPressResult, coinpress_covariance, coinpress_mean
from dpjax.covariance.covariance import (CovarianceCalibration, al_covariance,
                                         covariance_calibration, learn_covariance,
                                         pair_differences, required_n, second_moment)
from dpjax.covariance.gaussian import GaussianResult, gaussian_batch_sizes, learn_gaussian
from dpjax.covariance.masking import (MaskingCalibration, calibrate_masking, covariance_mask,
                                      masking_concentration, masking_privacy_loss)
from dpjax.covariance.populous_mean import (PopulousThresholds, min_groups_for_test,
                                            ppme_calibration, ppme_mean)
from dpjax.covariance.result import PrivateEstimate
from dpjax.covariance.robust import robust_covariance, robust_mean
from dpjax.covariance.semimetric import (closeness_matrix, euclidean_neighbour_counts,
                                         neighbour_counts, psd_distance)
