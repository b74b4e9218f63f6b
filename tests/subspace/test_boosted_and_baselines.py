"""DPASEB (docs/algorithms.md §2.3) and the Analyze Gauss / non-private PCA baselines."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import NeighboringRelation

from dpjax import data, metrics
from dpjax.mechanisms import analytic_gaussian_sigma, rdp_gaussian_sigma
from dpjax.subspace import analyze_gauss, dpaseb, num_blocks_for, pca_subspace
from helpers import normal


def _exact_subspace_data(seed, n, d, k):
  """data.exact_subspace_data's law (rows B z, z ~ N(0, I_k)) drawn by NumPy: eagerly the
  generator compiles each of its JAX operations per shape."""
  rng = np.random.default_rng(seed)
  B = np.linalg.qr(rng.standard_normal((d, k)))[0]
  return (rng.standard_normal((n, k)) @ B.T).astype(np.float32), B


def test_num_blocks_rule():
  assert num_blocks_for(0.1) == math.ceil(45 * math.log(10))
  with pytest.raises(ValueError, match="beta"):
    num_blocks_for(0.0)


@pytest.mark.slow(reason="DPASEB recovers the subspace (12 blocks); the default run audits its "
                         "privacy")
def test_dpaseb_succeeds_where_single_dpase_does():
  # Per block (n/T rows): the configuration of tests/subspace/test_approximate.py, where a
  # single DPASE succeeds with probability ≥ 0.7 (measured: 50/50).
  X, model = data.approximate_subspace_data(jax.random.key(0), 12 * 1_000, 20, 2, gamma=1e-5)
  res = dpaseb(jax.random.key(1), X, epsilon=1.0, delta=1e-6, k=2, alpha=0.1, num_blocks=12,
               gamma=1e-5)
  assert bool(res.ok) and float(metrics.projection_distance(res.basis, model.basis)) <= 0.1
  assert int(res.released["agreeing"]) >= 0.6 * 12 - 1 and res.neighboring == NeighboringRelation.REPLACE_ONE
  np.testing.assert_allclose(np.asarray(res.basis.T @ res.basis), np.eye(2), atol=1e-4)


@pytest.mark.slow(reason="DPASEB's ⊥ when its runs disagree; the default run audits its privacy")
def test_dpaseb_bottom_when_blocks_disagree():
  """Isotropic data and huge cells: every run answers, each with a random subspace: ⊥."""
  X = normal(2, (12 * 1_000, 20))
  res = dpaseb(jax.random.key(3), X, epsilon=1.0, delta=1e-6, k=2, alpha=0.1, num_blocks=12,
               cell_length=1e3)
  assert int(res.released["runs_ok"]) == 12
  assert not bool(res.ok) and bool(jnp.all(res.basis == 0))


@pytest.mark.slow(reason="DPASEB passes top_k_method to its runs; the default run checks a bad "
                         "value is refused")
def test_dpaseb_passes_the_top_k_method_to_its_runs():
  X, _ = data.approximate_subspace_data(jax.random.key(0), 2 * 1_200, 10, 2, gamma=1e-6)
  kw = dict(epsilon=2.0, delta=1e-6, k=2, alpha=0.3, num_blocks=2, gamma=1e-6)
  exact = dpaseb(jax.random.key(1), X, top_k_method="exact", **kw)
  iterated = dpaseb(jax.random.key(1), X, top_k_method="subspace_iteration", **kw)
  assert (exact.info["top_k_method"], iterated.info["top_k_method"]) == (
      "exact", "subspace_iteration")
  assert bool(exact.ok) == bool(iterated.ok)
  assert int(exact.released["runs_ok"]) == int(iterated.released["runs_ok"]) >= 2
  np.testing.assert_allclose(np.asarray(exact.basis), np.asarray(iterated.basis), atol=1e-5)


def test_dpaseb_bad_input():
  X = normal(2, (100, 5))
  with pytest.raises(ValueError, match="top_k_method"):
    dpaseb(jax.random.key(0), X, epsilon=1.0, delta=1e-6, k=1, alpha=0.1, gamma=0.1,
           num_blocks=1, top_k_method="svd")
  with pytest.raises(ValueError, match="alpha"):
    dpaseb(jax.random.key(0), X, epsilon=1.0, delta=1e-6, k=1, alpha=0.0, gamma=0.1)
  with pytest.raises(ValueError, match="n is too small"):
    dpaseb(jax.random.key(0), X, epsilon=1.0, delta=1e-6, k=1, alpha=0.1, gamma=0.1)


def test_analyze_gauss_noise_calibration_and_utility():
  X, B = _exact_subspace_data(4, 20_000, 30, 2)
  raw = analyze_gauss(jax.random.key(5), X, epsilon=1.0, delta=1e-6, k=2, clip_norm=3.0,
                      secure=False)
  # Computed in units of C² (scale safety): σ/C² is the analytic σ at sensitivity 2.
  assert raw.info["unit_sigma"] == analytic_gaussian_sigma(1.0, 1e-6, sensitivity=2.0)
  assert raw.info["sigma"] == pytest.approx(
      analytic_gaussian_sigma(1.0, 1e-6, sensitivity=2 * 3.0**2), rel=1e-12)
  assert float(metrics.projection_distance(raw.basis, B)) < 0.1
  # The float-safe default: the Rényi σ at the grid sensitivity (≤ (1 + 2^-10)·2).
  res = analyze_gauss(jax.random.key(5), X, epsilon=1.0, delta=1e-6, k=2, clip_norm=3.0)
  assert res.info["secure"] and res.basis.dtype == X.dtype
  assert res.info["unit_sigma"] == pytest.approx(rdp_gaussian_sigma(1.0, 1e-6, 2.0), rel=2e-3)
  assert float(metrics.projection_distance(res.basis, B)) < 0.1
  # More noise than signal: a tiny dataset gives a poor subspace (the noise is real).
  small = analyze_gauss(jax.random.key(5), X[:20], epsilon=0.1, delta=1e-6, k=2, clip_norm=3.0)
  assert float(metrics.projection_distance(small.basis, B)) > 0.5


def test_analyze_gauss_noise_is_symmetric_with_the_stated_std():
  from dpjax.subspace.baselines import _analyze_gauss_core
  # With zero data the output spans eigenvectors of E alone; check E itself via the same key.
  # (C = 1, so the std in units of C² is σ itself.)
  d, sigma = 40, 2.5
  noise = jax.random.normal(jax.random.key(6), (d, d)) * sigma     # the core's own draw
  noise = np.asarray(noise)                 # the checks in NumPy: no JAX program each
  upper = noise[np.triu_indices(d)]
  assert abs(upper.std() / sigma - 1) < 0.1
  V = _analyze_gauss_core(jax.random.key(6), jnp.zeros((5, d)), 3, 0.5, 1, sigma)   # C = 0.5·2^1
  E = np.triu(noise) + np.triu(noise, 1).T
  top = np.linalg.eigh(E)[1][:, ::-1][:, :3]
  # float32 eigenvectors against a float64 reference: error ≈ ulp·‖E‖/eigengap (1.1e-3 on
  # jax 0.10's CPU eigh here), so the tolerance is 1e-2 — still far below a wrong key's ~1.
  assert float(metrics.projection_distance(V, jnp.asarray(top, jnp.float32))) < 1e-2


def test_pca_subspace_is_exact_and_labelled_non_private():
  X, B = _exact_subspace_data(7, 50, 12, 3)
  res = pca_subspace(X, k=3)
  assert res.neighboring is None and math.isinf(res.epsilon)
  assert float(metrics.projection_distance(res.basis, B)) < 1e-3
