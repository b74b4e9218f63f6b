"""He, Vershynin & Zhu: private low-dimensional synthetic data (docs/algorithms.md §4).

``low_dimensional_synthetic_data`` is the pipeline (Algorithm 1); ``projection`` holds its
private covariance, mean, projection and choice of d'; ``pmm`` and ``psmm`` the two synthetic
measure mechanisms.
"""

from dpjax.synthetic import pmm, projection, psmm
from dpjax.synthetic.pipeline import METHODS, low_dimensional_synthetic_data, synthetic_required_n
from dpjax.synthetic.pmm import pmm_core, pmm_parameters
from dpjax.synthetic.projection import choose_dim, private_centered_covariance, private_mean
from dpjax.synthetic.psmm import bounded_lipschitz_projection

# The names a user meets; the modules' own __all__ hold the rest (PMM and PSMM themselves:
# dpjax.synthetic.pmm.pmm, dpjax.synthetic.psmm.psmm; docs/reference/map.rst).
__all__ = ["choose_dim", "low_dimensional_synthetic_data", "private_centered_covariance",
           "private_mean", "synthetic_required_n"]

