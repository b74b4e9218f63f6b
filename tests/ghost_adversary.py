"""An adversarial search against ghost clipping's Gram route (issue 49 §1).

One example's tokens come in cancelling pairs ``(s·v, −s·v + s·η·w)``: its per-token gradients
``x_tᵀδ_t`` nearly cancel, so the true gradient ``G = Σ_t x_tᵀδ_t`` is about η times the
per-token ones and any float evaluation of ``⟨x xᵀ, δ δᵀ⟩`` carries an error of about ``u·T²``
times ``(Σ_t‖x_t‖‖δ_t‖)²`` — far above ``‖G‖²``. A norm computed that way can come out too
small, and the clipped term ``G·C/norm`` then exceeds C. The targets are scaled so that every
example is clipped (``‖G‖ ≫ C``).

:func:`search` builds such examples for NNX models whose covered layers take the Gram route
(T² < a·b) — a per-token ``Linear`` with mean pooling, ``Conv`` (a window of 2 with stride 2,
and of 1), ``MultiHeadAttention``'s projections — at several scales ``s`` and cancellation
levels ``η``, in float32 and bfloat16, and returns the largest clipped term it finds (its norm
computed exactly, in float64, from the values the sum receives with a one-hot mask).
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import linalg, sgd
from dpjax.sgd import flax_layers, ghost

C = 1.0
LAYERS = ("linear", "conv2", "conv1", "attention")
# (T, width) per dtype, T² < a·b (the Gram route). bfloat16 inputs cannot cancel below about
# 2⁻⁸ of a token, so its error needs longer sequences to show.
SHAPES = {"float32": (32, 64), "bfloat16": (32, 64)}
SCALES = (2.0 ** -30, 1.0, 2.0 ** 30)
# η (the residual of the one pair that does not cancel exactly), per dtype.
ETAS = {"float32": tuple(np.geomspace(1e-7, 1e-2, 11)),
        "bfloat16": tuple(np.geomspace(2 ** -10, 2 ** -5, 6))}


def _model(layer: str, dtype):
  from flax import nnx
  kw = {"dtype": dtype, "rngs": nnx.Rngs(0)}
  width = SHAPES[jnp.dtype(dtype).name][1]

  class Model(nnx.Module):
    def __init__(self):
      if layer == "linear":
        self.f = nnx.Linear(width, width, use_bias=False, **kw)
      elif layer == "conv2":
        self.f = nnx.Conv(width, width, (2,), strides=2, padding="VALID", use_bias=False, **kw)
      elif layer == "conv1":
        self.f = nnx.Conv(width, width, (1,), use_bias=False, **kw)
      else:
        self.f = nnx.MultiHeadAttention(num_heads=2, in_features=width, use_bias=False,
                                        decode=False, **kw)

    def __call__(self, x):
      return self.f(x).mean(axis=-2).astype(jnp.float32)

  return Model()


class Found(NamedTuple):
  """The largest clipped term of a search: ``ratio`` = its norm / C; the example's ``x (T, a)``
  and target ``y (a,)``; where it was found."""
  ratio: float
  x: np.ndarray
  y: np.ndarray
  layer: str
  dtype: str
  scale: float
  eta: float


def cancelling_pairs(rng, size: int, scale: float, eta: float, dtype: str,
                     residual: str = "one") -> np.ndarray:
  """``(size, T, width)`` examples of cancelling token pairs (module docstring), exact in
  ``dtype``: token ``t + T/2`` is ``−v + η‖v‖·w`` for token t = v (``w`` a random unit vector),
  rounded to ``dtype``; ``residual="one"``: only in the first pair, the others cancel exactly
  (``−v``); ``"all"``: in every pair."""
  tokens, width = SHAPES[dtype]
  cast = lambda a: np.asarray(jnp.asarray(a, dtype), np.float32)            # noqa: E731
  v = cast(scale * rng.standard_normal((size, tokens // 2, width)))
  w = rng.standard_normal((size, tokens // 2, width))
  w *= eta * np.linalg.norm(v, axis=-1, keepdims=True) / np.linalg.norm(w, axis=-1, keepdims=True)
  if residual == "one":
    w[:, 1:] = 0.0
  return np.concatenate([v, cast(-v + w)], axis=1)


def loss(out, y):
  return jnp.sum(out * y)


@functools.cache
def _terms(layer: str, dtype: str):
  """A jitted ``(x, y) -> (B,)`` norms of each example's clipped term (a one-hot mask per row)
  and the model's ``(apply_fn, params)``."""
  apply_fn, params = flax_layers.nnx_model(_model(layer, jnp.dtype(dtype)))
  fn = sgd.ghost_clipped_grad_sum(apply_fn, loss, clip_norm=C)

  @jax.jit
  def terms(x, y):
    masks = jnp.eye(x.shape[0], dtype=jnp.float32)
    return jax.vmap(lambda m: fn(params, (x, y), m))(masks)

  return terms, apply_fn, params


def term_norms(layer: str, dtype: str, x, y) -> np.ndarray:
  """``(B,)`` exact (float64) norms of the clipped terms of the examples ``(x, y)``."""
  terms = _terms(layer, dtype)[0](jnp.asarray(x), jnp.asarray(y))
  return np.sqrt(sum(np.sum(np.asarray(t, np.float64).reshape(t.shape[0], -1) ** 2, axis=1)
                     for t in jax.tree_util.tree_leaves(terms)))


def search(layers=LAYERS, dtypes=("float32", "bfloat16"), *, size: int = 32,
           seed: int = 0) -> Found:
  """The largest clipped term over cancelling examples (module docstring); ``size`` examples per
  (layer, dtype, scale, η)."""
  rng = np.random.default_rng(seed)
  best = None
  for layer in layers:
    for dtype in dtypes:
      for scale in SCALES:
        for eta in ETAS[dtype]:
          x = cancelling_pairs(rng, size, scale, eta, dtype)
          # Targets large enough that every example is clipped: ‖G‖ ≈ η·s·‖y‖ ≫ C.
          y = np.float32(rng.standard_normal((size, x.shape[-1])) * 1e3 / (eta * scale))
          norms = term_norms(layer, dtype, x, y)
          i = int(np.argmax(norms))
          if best is None or norms[i] > best.ratio * C:
            best = Found(float(norms[i] / C), x[i], y[i], layer, dtype, scale, eta)
  return best


def naive_gram_norm(xt, dt):
  """The Gram route's norm before issue 49: ``√max(⟨x xᵀ, δ δᵀ⟩, 0)`` in float, no error bound
  (a negative control)."""
  gx = jnp.einsum("nta,nsa->nts", xt, xt, precision=linalg.HIGHEST)
  gd = jnp.einsum("ntb,nsb->nts", dt, dt, precision=linalg.HIGHEST)
  return jnp.sqrt(jnp.maximum(jnp.sum(gx * gd, axis=(1, 2)), 0))


@contextlib.contextmanager
def naive_gram():
  """Within: ghost clipping's Gram route clips by :func:`naive_gram_norm` (functions traced
  inside only; this module's cached programs are dropped on entry and exit)."""
  _terms.cache_clear()
  try:
    with mock.patch.object(ghost, "_gram_norm_bound", naive_gram_norm):
      yield
  finally:
    _terms.cache_clear()
