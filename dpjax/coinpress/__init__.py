"""CoinPress (Biswas, Dong, Kamath & Ullman 2020): iterative private mean and covariance."""

from dpjax.coinpress.covariance import (choose_covariance_steps, coinpress_covariance,
                                       covariance_required_n)
from dpjax.coinpress.mean import coinpress_mean, mean_required_n
from dpjax.coinpress.schedule import calibrate_noise_scale, default_fractions, gaussian_norm_radius

# The names a user meets; each module's own __all__ holds the rest (docs/reference/map.rst).
__all__ = ["coinpress_covariance", "coinpress_mean", "covariance_required_n", "mean_required_n"]
