"""dpjax's internal shared layer: what several packages use, in one place (issue 36 §2).

One concept per module, no public API: the subpackages import these modules, and no subpackage
imports another subpackage's private names (``tests/test_layering.py`` checks the import graph).
Together with :mod:`dpjax._validation` (argument checks before tracing), :mod:`dpjax._host`
(host calls, float64 stages) and :mod:`dpjax._data` (bundled data), this is what may be shared.

* :mod:`dpjax._core.noise` — unvalidated, traceable samplers (truncated Laplace, ℓ2-Laplace).
* :mod:`dpjax._core.second_moment` — the clipped unit second moment ``Σ u uᵀ`` and its
  continuous and float-safe (discretized Gaussian) noisy top-k eigenvector releases.
"""
