"""Public feature maps for images: the wavelet scattering transform (no privacy cost).

Tramèr & Boneh ("Differentially private learning needs better features (or much more data)",
ICLR 2021) train a linear model by DP-SGD on ScatterNet features (Bruna & Mallat 2013; Oyallon &
Mallat 2015): a FIXED, data-independent cascade of Morlet wavelet convolutions and moduli
(J = 2 scales, L = 8 angles on 28×28 images: 81 channels of 7×7, 3,969 features), normalised
per example. Each row's features are a function of that row alone with no statistic of the
data set, so the map costs no privacy; DP-SGD on the features is private for the rows as the
plan states. (Tramèr & Boneh's other normalisation, "data" batch normalisation with the
training set's mean and variance, reads the private rows and would need its own DP release and
accounting: it is not offered here; docs/algorithms.md §6.5.2 has what it was measured to gain.)

The transform is kymatio's (``kymatio`` ≥ 0.3.0, its JAX front end, in the ``features`` extra).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v

__all__ = ["scattering_features", "scattering_shape"]


def scattering_shape(height: int, width: int, *, J: int = 2, L: int = 8) -> tuple[int, int, int]:
  """``(channels, height / 2^J, width / 2^J)`` of the order-2 scattering: ``1 + JL +
  L²J(J−1)/2`` channels (81 for J = 2, L = 8)."""
  return 1 + J * L + L * L * J * (J - 1) // 2, height // 2**J, width // 2**J


@functools.lru_cache(maxsize=8)
def _scattering(J: int, L: int, height: int, width: int):
  try:      # the 2-D front end alone: kymatio 0.3.0's package import needs SciPy's old sph_harm
    from kymatio.scattering2d.frontend.jax_frontend import ScatteringJax2D
  except ImportError as exc:           # pragma: no cover - depends on the installation
    raise ImportError("scattering_features needs kymatio >= 0.3.0: pip install "
                      '"dpjax[features]".') from exc
  return jax.jit(ScatteringJax2D(J=J, shape=(height, width), L=L).scattering)


def _group_normalise(features: jax.Array, groups: int, eps: float) -> jax.Array:
  """Per example: each of ``groups`` consecutive channel groups to mean 0, variance 1 (group
  normalisation without learned scale or shift)."""
  n, c, h, w = features.shape
  grouped = features.reshape(n, groups, (c // groups) * h * w)
  mean = grouped.mean(axis=-1, keepdims=True)
  var = grouped.var(axis=-1, keepdims=True)
  return ((grouped - mean) / jnp.sqrt(var + eps)).reshape(n, c * h * w)


def scattering_features(images, *, J: int = 2, L: int = 8, groups: int | None = 27,
                        eps: float = 1e-5, batch_size: int = 2_000,
                        cache_dir: str | os.PathLike | None = None) -> np.ndarray:
  """Scattering features of grey-level images, one row per image: a public feature map.

  Usage::

      mnist = dpjax.data.load_mnist(full=True, flatten=False)
      F_train = dpjax.features.scattering_features(mnist.X_train)    # (60000, 3969) float32

  Args:
    images: ``(n, h, w)`` or ``(n, h, w, 1)`` (NHWC, one channel) or flat ``(n, h·w)`` rows of
      square images, values in ``[0, 1]`` (a public scale, e.g. ``load_mnist``'s k/255); h and
      w divisible by ``2^J``.
    J, L: scales and angles of the transform (Tramèr & Boneh: 2 and 8).
    groups: per-example group normalisation over this many consecutive channel groups (27 for
      81 channels, as Tramèr & Boneh); None: no normalisation.
    eps: the normalisation's variance floor.
    batch_size: images transformed per jitted call (memory only; the result does not depend on
      it).
    cache_dir: None (default) computes the features; a folder keeps them there as
      ``scattering-<hash>.npy``, the hash of the images' bytes and of the settings and kymatio's
      version, and a later call with the same images and settings loads them (bit for bit the
      array the first call returned; 70,000 MNIST images take 1.1 GB).

  Returns:
    ``(n, C·(h/2^J)·(w/2^J))`` float32 NumPy rows (C from :func:`scattering_shape`; 3,969 for
    28×28 at J = 2, L = 8), channel-major.

  Privacy: none spent. Row i's features are a fixed function of image i alone (the transform's
  filters are data-independent; the normalisation uses row i's own statistics), so any mechanism
  on the features is private for the rows exactly as it is on the images (post-processing of
  each row before the mechanism, under add/remove-one and replace-one alike).

  Raises:
    ValueError: a shape that is not images (or flat square rows), sides not divisible by 2^J, a
      channel count not divisible by ``groups``, NaN/inf, bad J, L, eps or batch size.
    ImportError: kymatio is not installed.

  References:
    Tramèr & Boneh, ICLR 2021 (ScatterNet + linear, group normalisation); Oyallon & Mallat, CVPR
    2015; Andreux et al., "Kymatio: scattering transforms in Python", JMLR 2020.
  """
  J = v.check_int(J, "J", low=1)
  L = v.check_int(L, "L", low=1)
  eps = v.check_positive(eps, "eps")
  batch_size = v.check_int(batch_size, "batch_size", low=1)
  X = np.asarray(images, np.float32)
  if X.ndim == 4 and X.shape[-1] == 1:
    X = X[..., 0]
  elif X.ndim == 2:
    side = int(round(np.sqrt(X.shape[1])))
    if side * side != X.shape[1]:
      raise ValueError(f"flat rows must be square images, got {X.shape[1]} values per row.")
    X = X.reshape(len(X), side, side)
  if X.ndim != 3 or len(X) == 0:
    raise ValueError(f"images must be (n, h, w), (n, h, w, 1) or flat square rows, got shape "
                     f"{np.shape(images)}.")
  if not np.all(np.isfinite(X)):
    raise ValueError("images contain NaN or inf.")
  n, height, width = X.shape
  if height % 2**J or width % 2**J:
    raise ValueError(f"image sides ({height}, {width}) must be divisible by 2^J = {2**J}.")
  channels = scattering_shape(height, width, J=J, L=L)[0]
  if groups is not None:
    groups = v.check_int(groups, "groups", low=1)
    if channels % groups:
      raise ValueError(f"{channels} channels do not split into groups={groups}.")
  path = None
  if cache_dir is not None:
    path = pathlib.Path(cache_dir) / f"scattering-{_digest(X, J, L, groups, eps)}.npy"
    if path.exists():
      return np.load(path, allow_pickle=False)
  transform = _scattering(J, L, height, width)
  out = []
  for start in range(0, n, batch_size):
    chunk = X[start:start + batch_size]
    pad = batch_size - len(chunk) if n > batch_size else 0     # one compiled shape
    batch = jnp.asarray(np.concatenate([chunk, np.zeros((pad, height, width), np.float32)]))
    features = transform(batch)
    flat = (features.reshape(len(batch), -1) if groups is None
            else _group_normalise(features, groups, eps))
    out.append(np.asarray(flat[:len(chunk)], np.float32))
  result = np.concatenate(out)
  if path is not None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    with open(partial, "wb") as fh:
      np.save(fh, result, allow_pickle=False)
    os.replace(partial, path)            # atomic: a reader never sees half a file
  return result


def _digest(X: np.ndarray, J: int, L: int, groups, eps: float) -> str:
  """The cache key: the images' shape and bytes, the settings and kymatio's version."""
  from importlib import metadata      # pylint: disable=import-outside-toplevel
  h = hashlib.sha256(repr((X.shape, J, L, groups, float(eps), metadata.version("kymatio"),
                           1)).encode())
  h.update(np.ascontiguousarray(X).tobytes())
  return h.hexdigest()[:32]

