"""The main job: private training on real data, every gradient-subspace route, one (ε, δ) per run.

    python -m dpjax.demo                       # full MNIST (bundled), scatnet and mlp, ε = 2
    python -m dpjax.demo --json results.json --plot accuracy.png
    python -m dpjax.demo --data mnist10k       # the 10,000-digit subset
    python -m dpjax.demo --data digits         # scikit-learn's 8×8 digits
    python -m dpjax.demo --data my.npz         # X (n, d) rows or (n, 28, 28) images, integer y (n,)

Models (``--models``, default ``scatnet mlp``), each with its own training (:data:`TRAINING`:
expected batch size, epochs over its private rows, a two-point Adam grid; ``--batch-size``,
``--steps`` and ``--learning-rates`` override them for every model):

* ``scatnet``: the strongest private pipeline for images (Tramèr & Boneh 2021): softmax
  regression on the images' scattering features (:func:`dpjax.features.scattering_features`,
  J = 2, L = 8, per-example group normalisation: 3,969 features for 28×28, a public map that
  costs no privacy; needs kymatio, ``pip install "dpjax[features]"``; ``--cache-dir`` keeps
  them). The routes act on its one dense layer: ``private_input_subspace`` is DP-PCA of the
  scattering features in front of the linear model.
* ``mlp``: one tanh hidden layer of ``--hidden`` units (1,000, Abadi et al.'s) on the pixels;
  ``private_input_subspace`` is their DP-PCA of the pixels in front of it.
* ``cnn`` (``--models cnn``): a Flax NNX CNN for square single-channel images given as flat rows
  (two 3×3 stride-2 convolutions with 8 and 16 channels, tanh, a dense layer: 9,098 parameters
  on MNIST; needs ``flax``, ``pip install "dpjax[examples]"``), trained as any params pytree.

Every method runs on each model, except that the routes acting on a first dense layer
(``gep_trajectory``, ``private_input_subspace``, ``public_subspace``) are reported as not
runnable on the CNN, with the reason, as is every method on a model that cannot be built (a CNN
or scattering features on rows that are not square images, or without Flax or kymatio), and a
method that would hold more than 2 GiB of flattened per-example gradients
(``subspace_dp_sgd_private`` on full MNIST; :data:`MAX_FLAT_GRADIENT_BYTES`). Each result row
names its ``model``; the summary, the winner and the crossover lines are given per model, and
the best private model overall closes the table with every method's distance to it. DP-SGD
clips the models by ghost norms (their layers are built by :func:`dpjax.sgd.dense` or recorded
by :func:`dpjax.sgd.nnx_apply`: no per-example gradients; the same sum and bound C).

Methods (every DP run at the same (ε, δ) under add/remove-one, every release of the run accounted:
the private subspace's cost and the learning-rate tuning included). Routes that use public data have
``public`` in their name.

* ``non_private``: the same model, optimiser and weight averaging without clipping or noise.
* ``dp_sgd``: privately tuned DP-SGD — Poisson sampling, normalised per-example clipping, Gaussian noise
  in all p parameters, Adam, an EMA of the iterates (``dpjax.experiments.train_route``, a research
  harness on ``dpjax.sgd``'s public API: ``dp_noise`` built from the clipped-gradient sum).
* ``dp_sgd_denoise`` (not in the default set, ``--methods`` runs it): ``dp_sgd`` then low-rank
  denoising of each layer's noisy update (post-processing; docs/algorithms.md §6.3). At the
  defaults its shrinkage threshold removes the signal with the noise (0.585 against dp_sgd's
  0.933 on digits), so it is left out of the default set rather than shown as a route.
* ``gep_trajectory``: no public data; the first layer's gradients split before clipping into a
  rank-8 embedding and a residual (GEP), the basis taken from the released updates (free; §6.4).
* ``private_input_subspace``: no public data; Abadi et al.'s DP-PCA: the first layer trained in
  the top ``--input-rank`` eigenvectors of Analyze Gauss's noisy second moment of the
  training rows scaled to unit norm, the release at a stand-alone
  ``(--input-epsilon-fraction·ε, 0.1·δ)`` composed with the steps by the accountant (rank and
  share per model, :data:`INPUT_SUBSPACES`: 60 and 0.3 on pixels, 2,048 and 0.05 on scattering
  features)
  (docs/algorithms.md §6.5).
* ``subspace_dp_sgd_private``: a rank-k subspace of the flattened per-example gradients learned
  with DPASE, paying (ε_s, δ_s) out of the total (``dpjax.sgd.train_dp_sgd``); if DPASE returns
  ⊥, the run continues as plain DP-SGD with the remaining budget, and the table says ⊥.
* ``public_subspace`` (not in the default set, ``--methods`` runs it): the first layer's noise
  in the top-k principal directions of a public split's inputs (``--public-fraction`` of the
  rows, at most ``--public-rows``, left out of this route's private rows). On full MNIST at the
  defaults it came last (0.940 on scatnet against dp_sgd's 0.982; 0.918 on the mlp, behind the
  DP-PCA route's 0.926) and took the longest (114 s of scatnet's 6.5 minutes), so it is left
  out of the default set; the benchmark leaves it out too.
* ``public_gradient_subspace``: PDP-SGD (Zhou et al. 2021), the crossover study's public route:
  DP-SGD's noisy gradient projected on the top-32 right singular vectors of the public split's
  per-example gradients, refreshed every 10 steps by warm-started subspace iteration
  (``dpjax.experiments.train_route``).
* ``subspace_dp_sgd_public`` (not in the default set, ``--methods`` runs it): the same idea through
  ``dpjax.sgd.train_dp_sgd(subspace="public")``: a rank-``--k`` subspace of the public split's
  flattened gradients by an exact SVD every ``--refresh-every`` steps. At the defaults it trailed
  dp_sgd by 15 points on the MLP (0.721 against 0.867 on MNIST) and took the longest (77 s of
  the MLP's 185 s): ``public_gradient_subspace`` takes its place.

Tuning, accounted: 10% of the rows are held back as a tuning split, never trained on, that
scores runs; it is public by this experiment's construction (its rows get no protection). The
Adam learning rate is chosen from ``--learning-rates`` by Papernot & Steinke's private tuning
(``dpjax.accounting.HyperparameterTuning``): for each seed, K runs with K drawn from the
logarithmic distribution with mean the number of rates, each at a rate drawn uniformly from the
grid, and only the run with the best tuning-split accuracy is released and tested. σ is
calibrated (RDP accountant) so that this whole tuning is (ε, δ)-DP: the ε reported covers it.
Methods with a private subspace release (``private_input_subspace``: Analyze Gauss's Gaussian
event composed with the steps by the accountant; ``subspace_dp_sgd_private``: DPASE's (ε_s, δ_s)
by basic composition, which has no RDP curve to repeat) are not tuned: they run once per seed at the grid's median rate, a public
choice, by the PLD accountant. ``non_private`` takes the best rate on the tuning split. With a
single rate in the grid nothing is tuned. Each result row records its ``tuning``, its number of
runs and its ``accountant``.

Who the (ε, δ) protects: the training rows each method trains on; the public routes train on the
other rows only, and their public split is public only because this experiment marks it so (a
seeded sample of the same data set): its rows get no protection, and neither do the tuning
split's. Each result row records the number of rows its guarantee covers (``n_private``); the
report says this in ``privacy_note``. The (ε, δ) is each released run's: the report publishes
many runs trained on the same rows (seeds × methods × models) and a non-private reference, so
``composed`` gives the DP runs' total by basic composition (:func:`composed_total`) and says that
the reference has no guarantee; ``budget`` is "per released run". Each (model, method, seed)
draws from its own key, one split of the seed's key into one per model and method
(:func:`run_key`): no two runs share sampling or noise.

The methods are planned before any training, from public quantities only (row counts, p, d, k,
ε, δ, γ): a method that cannot run at these settings (for example DPASE needing more rows than
the data have at its share of ε) is reported as not runnable with the reason, and the others
still run; the experiment is never changed silently. A method whose run raises is recorded as
failed with its error, and the table, the JSON and the plot are still written. Each result row
has a ``status`` ("ok", "not_runnable" or "failed") and a ``note``.

The table states the neighboring relation, each method's subspace rank, σ, released learning
rate and number of tuning runs, and which method won (the highest mean test accuracy over the
seeds; one or a few seeds are an illustration — ``benchmarks/gradient_subspace.py`` gives paired
intervals). After it, one line per route from the crossover study
(``benchmarks/gradient_subspace.py``, its summary shipped as ``dpjax/_data/crossover.json``):
"wins from n ≈ … at this ε" or "does not win up to n = …", for the study's cell nearest to this
run (data set, model, ε), or that the study has no such cell.

Exit status: 0 when every run finished or was reported not runnable; 1 when a run failed.

Features are scaled by a public constant (1/255 for MNIST's pixels, 1/16 for digits'); the
scattering map and its normalisation act on each image alone; no statistic of the private data
is used unprivately.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import textwrap
import time
import traceback
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax import accounting
from dpjax import data as data_lib
from dpjax import experiments
from dpjax import features as features_lib
from dpjax import sgd
from dpjax import subspace as subspace_lib
from dpjax._host import host_rng
from dpjax.sgd import ghost, training

# The main job's entry points; the model, optimiser and planning helpers are its own.
__all__ = ["composed_total", "main", "run", "run_key"]

# The methods, in run order: (name, source). Source "route": dpjax.experiments.train_route (the
# name is the route); "private" / "public": dpjax.sgd.train_dp_sgd's subspace argument.
METHODS = (("non_private", "route"), ("dp_sgd", "route"), ("dp_sgd_denoise", "route"),
           ("gep_trajectory", "route"), ("private_input_subspace", "route"),
           ("subspace_dp_sgd_private", "private"),
           ("public_subspace", "route"), ("public_gradient_subspace", "route"),
           ("subspace_dp_sgd_public", "public"))
PUBLIC_METHODS = ("public_subspace", "public_gradient_subspace", "subspace_dp_sgd_public")
# The default set leaves out dp_sgd_denoise (broken at the defaults), subspace_dp_sgd_public
# (superseded by public_gradient_subspace) and public_subspace (last on full MNIST, and the slowest
# route there); see the module docstring.
DEFAULT_METHODS = tuple(m for m, _ in METHODS
                        if m not in ("dp_sgd_denoise", "subspace_dp_sgd_public", "public_subspace"))
DATASETS = ("mnist", "mnist10k", "digits")   # --data: one of these, or a path to an .npz
MODELS = ("scatnet", "mlp", "cnn")            # --models: build_model's names
DEFAULT_MODELS = ("scatnet", "mlp")           # the CNN runs with --models cnn


class TrainingDefaults(NamedTuple):
  """A model's default training, set on full MNIST: expected batch size L (capped at an eighth
  of the private rows), epochs over the private rows, Adam's learning-rate grid."""
  batch_size: int
  epochs: float
  learning_rates: tuple[float, ...]


class Training(NamedTuple):
  """A model's training in one main job (:func:`training_plan`): L, T and the grid."""
  batch_size: int
  steps: int
  learning_rates: tuple[float, ...]


# Set on full MNIST (issue 51; docs/algorithms.md §6.5.2): at a fixed number of steps the batch
# size hardly changes the accuracy (σ/L is set by T and n), so the smallest batch that reaches
# ~500 steps in a few epochs keeps the main job within 10 minutes; each grid's two rates bracket
# the best rate at ε = 1 and 2.
TRAINING = {"scatnet": TrainingDefaults(1024, 10.0, (0.003, 0.006)),
            "mlp": TrainingDefaults(1024, 8.0, (0.001, 0.003)),
            "cnn": TrainingDefaults(1024, 8.0, (0.003, 0.01))}
# The DP-PCA route's (rank, share of ε) per model, where the crossover study on full MNIST found
# it best (docs/algorithms.md §6.5.2): Abadi et al.'s 60 dimensions on the pixels; on the
# scattering features half of them at the smallest share (the linear model needs the directions
# the release cannot resolve, so its best subspace is nearly no subspace).
INPUT_SUBSPACES = {"scatnet": (2048, 0.05), "mlp": (60, 0.3)}
# The crossover study's names of the demo's data sets and models (--hidden 32 is its mlp_small).
_STUDY_DATA = {"mnist": "mnist_full", "mnist10k": "mnist", "digits": "digits"}
_STUDY_MODELS = {32: "mlp_small", 128: "mlp_large", 1000: "mlp_1000"}
# Methods that hold (rows, p) flattened per-example gradients in memory, and the main job's cap
# on that array (a method above it is reported as not runnable, with its size).
FLAT_GRADIENT_METHODS = ("subspace_dp_sgd_private", "public_gradient_subspace",
                         "subspace_dp_sgd_public")
MAX_FLAT_GRADIENT_BYTES = 2 ** 31
# The share of δ spent on the private subspace (train_dp_sgd's subspace_delta_fraction).
SUBSPACE_DELTA_FRACTION = 0.1
TUNING_FRACTION = 0.1      # share of the training rows held back to score the tuning's runs
ACCOUNTANT = "pld"         # the methods run once per seed (not tuned)
TUNING_ACCOUNTANT = "rdp"  # the privately tuned methods (only RDP repeats an event)
TUNING_SEED = 10_000       # non_private's tuning runs
# Methods tuned privately (their runs are T sampled Gaussian steps, an RDP curve to repeat); the
# other DP methods compose a private subspace release into their budget and run untuned.
TUNED_PRIVATELY = ("dp_sgd", "dp_sgd_denoise", "gep_trajectory", "public_subspace",
                   "public_gradient_subspace", "subspace_dp_sgd_public")


def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
  """He-style initialisation of a fully connected network with layer sizes ``sizes``."""
  params = []
  for key_layer, (fan_in, fan_out) in zip(jax.random.split(key, len(sizes) - 1),
                                          zip(sizes[:-1], sizes[1:])):
    w = jax.random.normal(key_layer, (fan_in, fan_out)) * math.sqrt(2.0 / fan_in)
    params.append({"w": w, "b": jnp.zeros(fan_out)})
  return params


def mlp_logits(params, x: jax.Array, *, dense: Callable = sgd.dense) -> jax.Array:
  """Logits of the MLP (tanh hidden layers) for one example ``x (d,)`` or a batch ``(B, d)``,
  its layers built by ``dense`` (so DP-SGD can clip it by ghost norms)."""
  h = x
  for layer in params[:-1]:
    h = jnp.tanh(dense(layer, h))
  return dense(params[-1], h)


# Cross-entropy of one example ``(x (d,), y ())``: the per-example loss DP-SGD clips; a
# dpjax.sgd.ghost.ModelLoss, so the routes clip it by ghost norms.
example_loss = ghost.model_loss(mlp_logits, optax.softmax_cross_entropy_with_integer_labels)


@functools.lru_cache(maxsize=None)
def adam(learning_rate: float) -> optax.GradientTransformation:
  """``optax.adam(learning_rate)``, one object per learning rate: ``train_dp_sgd`` compiles its
  step with the optimiser as a static argument, so reusing the object reuses the compilation
  across methods, seeds and calls."""
  return optax.adam(learning_rate)


@jax.jit
def accuracy(params, X: jax.Array, y: jax.Array) -> jax.Array:
  """Test accuracy of :func:`mlp_logits`' network on ``X (n, d)``, ``y (n,)``."""
  return jnp.mean(jnp.argmax(mlp_logits(params, X), axis=-1) == y)


class Model(NamedTuple):
  """A model of the main job: ``init(key) -> params``, ``loss(params, (x (d,), y ())) ->
  scalar`` (the per-example loss DP-SGD clips), ``logits(params, X (B, d)) -> (B, classes)``;
  ``dense_first_layer``: whether its first layer is a dense kernel ``(d, h)`` (the routes in
  ``dpjax.experiments.DENSE_ROUTES`` act on it)."""
  init: Callable
  loss: Callable
  logits: Callable
  dense_first_layer: bool
  features: str = "pixels"


@functools.lru_cache(maxsize=None)
def mlp_model(sizes: tuple[int, ...]) -> Model:
  """The tanh MLP with layer sizes ``sizes`` (``(d, classes)``: softmax regression) as a
  :class:`Model` (one object per shape, so compilations are reused)."""
  return Model(functools.partial(init_mlp, sizes=sizes), example_loss, mlp_logits, True)


@functools.lru_cache(maxsize=None)
def cnn_model(d: int, classes: int) -> Model:
  """A Flax NNX CNN on square single-channel images given as flat rows ``x (d,)``, ``d = s²``:
  two 3×3 stride-2 'SAME' convolutions with 8 and 16 channels, tanh, then a dense layer
  (9,098 parameters on 28×28 MNIST); its params are the NNX ``State`` of ``nnx.split``, trained
  as any params pytree. One object per shape (compilations are reused).

  Raises:
    ValueError: ``d`` is not a square.
    ImportError: Flax is not installed (``pip install "dpjax[examples]"``).
  """
  side = math.isqrt(d)
  if side * side != d:
    raise ValueError(f"the cnn takes square images as flat rows; d = {d} is not a square")
  try:
    from flax import nnx  # pylint: disable=import-outside-toplevel  # an examples dependency
  except ImportError as exc:
    raise ImportError('the cnn model needs Flax: pip install "dpjax[examples]"') from exc
  flat = 16 * (-(-(-(-side // 2)) // 2)) ** 2       # two stride-2 'SAME' convolutions

  class CNN(nnx.Module):
    def __init__(self, rngs):
      self.conv1 = nnx.Conv(1, 8, (3, 3), strides=2, rngs=rngs)
      self.conv2 = nnx.Conv(8, 16, (3, 3), strides=2, rngs=rngs)
      self.dense = nnx.Linear(flat, classes, rngs=rngs)

    def __call__(self, x):
      h = jnp.tanh(self.conv1(x.reshape(-1, side, side, 1)))
      h = jnp.tanh(self.conv2(h))
      return self.dense(h.reshape(h.shape[0], -1))

  graphdef = nnx.split(CNN(nnx.Rngs(0)))[0]
  apply_fn = sgd.nnx_apply(graphdef)      # one example; its layers recorded for ghost norms

  def init(key):
    return nnx.split(CNN(nnx.Rngs(key)))[1]

  def logits(params, x):
    out = nnx.merge(graphdef, params)(jnp.atleast_2d(x))
    return out if x.ndim == 2 else out[0]

  loss = ghost.model_loss(apply_fn, optax.softmax_cross_entropy_with_integer_labels)
  return Model(init, loss, logits, False)


@functools.partial(jax.jit, static_argnums=0)
def model_accuracy(logits_fn, params, X: jax.Array, y: jax.Array) -> jax.Array:
  """Accuracy of ``logits_fn(params, X)`` on ``X (n, d)``, ``y (n,)``."""
  return jnp.mean(jnp.argmax(logits_fn(params, X), axis=-1) == y)


class Route(NamedTuple):
  """One method of the main job, planned from public quantities before any training.

  Attributes:
    method: the method's name in the results.
    subspace: ``"route"`` (trained by :func:`dpjax.experiments.train_route`), else
      ``train_dp_sgd``'s ``subspace`` argument (``"private"`` or ``"public"``).
    n_private: the number of rows the method's (ε, δ) covers (None for the non-private run).
    note: None if the method can run at these settings, else the reason it cannot.
  """
  method: str
  subspace: str | None
  n_private: int | None
  note: str | None


def num_params(sizes: tuple[int, ...]) -> int:
  """The number p of parameters of :func:`init_mlp`'s network with layer sizes ``sizes``."""
  return sum(fan_in * fan_out + fan_out for fan_in, fan_out in zip(sizes[:-1], sizes[1:]))


def plan_routes(*, n_train: int, n_public: int, p: int, k: int, epsilon: float, delta: float,
                batch_size: int, gamma: float, subspace_epsilon_fraction: float,
                d: int | None = None, dataset: str = "the data",
                dense_first_layer: bool = True, model: str = "mlp",
                input_rank: int | None = None) -> list[Route]:
  """Plans the methods of :data:`METHODS` before any training, from public quantities only.

  Each method is checked the way its trainer would check it: the expected batch size against
  its private rows, ``k ≤ p`` for the flattened-gradient subspaces, ``k ≤ d`` for the public
  input subspace, the public split's size against k, and, for the private subspace, whether
  DPASE can run at ``ε_s = fraction·ε`` and ``δ_s = SUBSPACE_DELTA_FRACTION·δ``:
  ``train_dp_sgd(subspace="private")`` calls :func:`dpjax.sgd.private_gradient_subspace`, which
  calls :func:`dpjax.subspace.dpase` with ``partition="random_labels"`` on the ``(n_train, p)``
  per-example gradients, which calls :func:`dpjax.subspace.dpase_parameters` with these
  arguments; this function makes the same call. A method that cannot run gets a note saying why
  (with the smallest share of ε, on a grid of 0.01, that would let DPASE run, when there is
  one); the experiment itself is not changed. The noise calibration is left to the run.

  Args:
    n_train: training rows (all private for the methods without public data).
    n_public: rows of the public split (left out of the public methods' private rows).
    p: number of model parameters (the per-example gradients' dimension).
    k: subspace dimension (of the flattened-gradient subspaces and the public input subspace).
    epsilon, delta: the total budget.
    batch_size: the expected batch size L.
    gamma: DPASE's public gap parameter.
    subspace_epsilon_fraction: the share of ε spent on the private subspace.
    d: number of input features (None: not checked).
    dataset: the data set's name, for the notes.
    dense_first_layer: whether the model's first layer is a dense kernel; if not, the routes
      that act on one (``dpjax.experiments.DENSE_ROUTES``) cannot run.
    model: the model's name, for the notes.
    input_rank: ``private_input_subspace``'s rank (None: ``k``).

  Returns:
    One :class:`Route` per method, in the order of :data:`METHODS`.
  """
  n_rest = n_train - n_public
  routes = []
  for method, source in METHODS:
    public = method in PUBLIC_METHODS
    n = n_rest if public else n_train
    note = None
    if method in experiments.DENSE_ROUTES and not dense_first_layer:
      note = (f"the route acts on a first dense layer; the {model}'s first layer is not one "
              "(a convolution)")
    elif batch_size > n:
      note = (f"the expected batch size {batch_size} exceeds the {n} "
              f"{'training' if method == 'non_private' else 'private training'} rows")
    elif source in ("private", "public") and k > p:
      note = f"k={k} exceeds the model's p={p} parameters"
    elif method in ("public_subspace", "private_input_subspace") and d is not None and (
        rank := input_rank or k if method == "private_input_subspace" else k) > d:
      note = f"k={rank} exceeds the d={d} input features"
    elif public and n_public < k:
      note = f"the public split has {n_public} rows, fewer than k={k}"
    elif method in FLAT_GRADIENT_METHODS and (
        size := 4 * p * (n_public if public else n)) > MAX_FLAT_GRADIENT_BYTES:
      rows = "public" if public else "private"
      note = (f"it holds the {n_public if public else n} {rows} rows' flattened per-example "
              f"gradients (p = {p:,}): {size / 2**30:.1f} GiB, above the main job's "
              f"{MAX_FLAT_GRADIENT_BYTES / 2**30:g} GiB")
    elif source == "private":
      note = _dpase_note(n, p, k, epsilon=epsilon, delta=delta, gamma=gamma,
                         fraction=subspace_epsilon_fraction, dataset=dataset)
    routes.append(Route(method, source, None if method == "non_private" else n, note))
  return routes


def _dpase_note(n: int, p: int, k: int, *, epsilon: float, delta: float, gamma: float,
                fraction: float, dataset: str) -> str | None:
  """None if DPASE runs on ``n`` gradient rows at the subspace's share of (ε, δ), else why not."""
  eps_s, delta_s = epsilon * fraction, delta * SUBSPACE_DELTA_FRACTION

  def fits(eps):
    return n // subspace_lib.num_subsets_for(eps, delta_s) >= k + 1

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # DPASE's ⊥-likely warning belongs to the run, not the plan
    try:
      subspace_lib.dpase_parameters(n, p, k, epsilon=eps_s, delta=delta_s, gamma=gamma)
    except ValueError as exc:
      if fits(eps_s):
        return f"DPASE cannot run: {exc}"
    else:
      return None
  t = subspace_lib.num_subsets_for(eps_s, delta_s)
  note = (f"DPASE needs n >= {t * (k + 1)} private rows at ε_s = {eps_s:g}, δ_s = {delta_s:g} "
          f"({t} subsets of at least k + 1 = {k + 1} rows); {dataset} has {n}")
  # The smallest share on a grid of 0.01 that fits (t only shrinks as ε_s grows).
  lo, hi = 1, 99
  if not fits(epsilon * hi / 100):
    return note + f"; no share of ε = {epsilon:g} below 1 is enough (a smaller --k is)"
  while lo < hi:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if fits(epsilon * mid / 100) else (mid + 1, hi)
  return note + f"; --subspace-epsilon-fraction {lo / 100:.2f} or more would let it run"


def build_model(name: str, d: int, classes: int, hidden: int) -> Model:
  """The main job's model ``name`` (:data:`MODELS`) for ``d`` pixels and ``classes`` classes:
  ``"scatnet"``, softmax regression (:func:`mlp_model` with no hidden layer) on the images'
  scattering features (``features="scattering"``: :func:`dpjax.features.scattering_features`,
  J = 2, L = 8); ``"mlp"``, :func:`mlp_model` with one tanh hidden layer of ``hidden`` units;
  ``"cnn"``, :func:`cnn_model`.

  Raises:
    ValueError: ``"scatnet"`` or ``"cnn"`` on rows that are not square images (``"scatnet"``:
      sides divisible by 4); ImportError: ``"cnn"`` without Flax.
  """
  if name == "scatnet":
    side = math.isqrt(d)
    if side * side != d or side % 4:
      raise ValueError(f"scattering features need square images with sides divisible by 4 "
                       f"(J = 2), given as flat rows; d = {d} is not one")
    channels, h, w = features_lib.scattering_shape(side, side)
    return mlp_model((channels * h * w, classes))._replace(features="scattering")
  if name == "mlp":
    return mlp_model((d, hidden, classes))
  if name == "cnn":
    return cnn_model(d, classes)
  raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")


def _load(name: str) -> data_lib.Dataset:
  """The main job's data set ``--data``: full MNIST, MNIST-10k, digits or a user's .npz."""
  if name == "mnist":
    return data_lib.load_mnist(full=True)
  if name == "mnist10k":
    return data_lib.load_mnist(seed=0)
  if name == "digits":
    return data_lib.load_digits(seed=0)
  return data_lib.load_npz(name, seed=0)


def training_plan(model: str, n_private: int, args) -> Training:
  """The model's expected batch size, steps and learning-rate grid: ``--batch-size``,
  ``--steps`` and ``--learning-rates`` where given, else :data:`TRAINING`'s defaults for the
  model — the batch capped at an eighth of the private rows and the steps ``⌈epochs·n/L⌉``
  (public quantities: the row count and the settings)."""
  default = TRAINING[model]
  batch = args.batch_size or max(1, min(default.batch_size, n_private // 8))
  steps = args.steps or max(1, math.ceil(default.epochs * n_private / batch))
  grid = tuple(float(lr) for lr in (args.learning_rates or default.learning_rates))
  return Training(batch, steps, grid)


def run(args) -> dict:
  """Plans, tunes, trains and reports the methods for each model (see the module docstring);
  ``args`` as parsed by :func:`main`. Returns the report that ``--json`` writes."""
  started = time.perf_counter()
  ds = _load(args.data)
  n_all, d = ds.X_train.shape
  # Fixed, seeded splits of the training rows: a tuning split (learning rates only), then a
  # public split out of the rest (public only because this experiment says so).
  perm = np.random.default_rng(1).permutation(n_all)
  n_tune = max(1, int(round(TUNING_FRACTION * n_all)))
  tune, fit = perm[:n_tune], perm[n_tune:]
  n_train = len(fit)
  n_public = max(1, min(args.public_rows, int(round(args.public_fraction * n_train))))
  pub, priv = fit[:n_public], fit[n_public:]
  y = np.asarray(ds.y_train)
  y_test = np.asarray(ds.y_test)
  progress = not args.no_progress
  inputs = {"pixels": (np.asarray(ds.X_train, np.float32), np.asarray(ds.X_test, np.float32))}

  def features(kind):
    """``(X_train (n_all, d'), X_test)`` of a model's input features, computed once."""
    if kind not in inputs:
      start = time.perf_counter()
      inputs[kind] = tuple(features_lib.scattering_features(x, cache_dir=args.cache_dir)
                           for x in inputs["pixels"])
      if progress:
        print(f"scattering features {inputs[kind][0].shape[1]} per image: "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    return inputs[kind]

  settings = experiments.RouteSettings(clip_norm=args.clip_norm, public_rank=args.k,
                                       input_delta_fraction=SUBSPACE_DELTA_FRACTION)
  methods = [m for m, _ in METHODS if m in args.methods]
  left_out = [m for m, _ in METHODS if m not in DEFAULT_METHODS and m not in args.methods]
  if left_out and progress:
    print(f"{' and '.join(left_out)}: not in the default set (see --help); --methods ... runs "
          "them", file=sys.stderr)
  X = splits = plan = None      # the current model's inputs, splits and training plan

  def train(model, route, keys, lrs, tuned=None):
    """Runs of one method: ``(params list, σ, rank, [(ε, δ, subspace_ok, notes)] per run)``;
    ``tuned``: the HyperparameterTuning each run belongs to (None: a run released alone)."""
    public = route.method in PUBLIC_METHODS
    rows = priv if public else fit
    data = (X[rows], y[rows])
    accountant = ACCOUNTANT if tuned is None else TUNING_ACCOUNTANT
    if route.subspace == "route":
      out = experiments.train_route(route.method, jnp.stack(keys), lrs, data,
                                    init_fn=model.init, loss_fn=model.loss,
                                    epsilon=args.epsilon, delta=args.delta, steps=plan.steps,
                                    expected_batch_size=plan.batch_size,
                                    public_inputs=(X[pub] if route.method == "public_subspace"
                                                   else None),
                                    public_data=((X[pub], y[pub])
                                                 if route.method == "public_gradient_subspace"
                                                 else None),
                                    settings=settings, accountant=accountant, tuning=tuned)
      params = [jax.tree_util.tree_map(lambda x, i=i: x[i], out.params) for i in range(len(keys))]
      budget = (None, None) if route.method == "non_private" else (out.epsilon, out.delta)
      return params, out.noise_multiplier, out.rank, [(*budget, None, [])] * len(keys)
    params, info, sigma = [], [], None
    for key, lr in zip(keys, lrs):
      k_init, k_train = jax.random.split(key)
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = training.train_dp_sgd(
            k_train, model.loss, model.init(k_init), data, adam(float(lr)),
            epsilon=args.epsilon, delta=args.delta, steps=plan.steps,
            expected_batch_size=plan.batch_size, clip_norm=args.clip_norm,
            subspace=route.subspace, k=args.k, public_data=(X[pub], y[pub]) if public else None,
            gamma=args.gamma, refresh_every=args.refresh_every if public else None,
            subspace_epsilon_fraction=args.subspace_epsilon_fraction,
            subspace_delta_fraction=SUBSPACE_DELTA_FRACTION, accountant=accountant,
            clipping=settings.clipping, stability=settings.stability,
            weight_ema=settings.weight_ema, progress=progress, tuning=tuned)
      params.append(res.averaged_params)
      sigma = res.budget.noise_multiplier
      info.append((res.budget.epsilon, res.budget.delta, res.subspace_ok,
                   [str(w.message) for w in caught]))
    return params, sigma, args.k, info

  def seed_runs(model_name, model, route, accuracies):
    """``(kind, [(params, lr, runs, σ, rank, info)] per seed)``: the released run of each seed."""
    seed_keys = [run_key(seed, model_name, route.method) for seed in range(args.seeds)]
    grid = list(plan.learning_rates)
    tuning = tuning_plan(grid)
    fixed_lr = sorted(grid)[len(grid) // 2]           # the untuned methods' rate: public
    if route.method == "non_private":
      tuned, *_ = train(model, route, [jax.random.key(TUNING_SEED)] * len(grid), grid)
      lr = grid[int(np.argmax(accuracies(tuned, "tune")))]
      params, sigma, rank, info = train(model, route, seed_keys, [lr] * args.seeds)
      return "non_private", [(p, lr, len(grid), sigma, rank, i) for p, i in zip(params, info)]
    if tuning is None or route.method not in TUNED_PRIVATELY:
      params, sigma, rank, info = train(model, route, seed_keys, [fixed_lr] * args.seeds)
      return "fixed", [(p, fixed_lr, 1, sigma, rank, i) for p, i in zip(params, info)]
    released = []
    for key in seed_keys:   # Papernot–Steinke: K drawn, rates drawn, only the best released
      keys, lrs = tuning_runs(key, tuning, grid)
      runs = [train(model, route, [k], [lr], tuned=tuning) for k, lr in zip(keys, lrs)]
      scores = accuracies([r[0][0] for r in runs], "tune")
      best = int(np.argmax(scores))
      params, sigma, rank, info = runs[best]
      released.append((params[0], lrs[best], len(keys), sigma, rank, info[0]))
    return "private", released

  results, summary, winners, crossover, plans = [], {}, {}, {}, {}
  for model_name in args.models:
    base_row = {"model": model_name, "epsilon": None, "delta": None, "test_accuracy": None,
                "subspace_ok": None, "status": "ok", "note": None, "rank": None,
                "noise_multiplier": None, "learning_rate": None, "tuning": None, "runs": None,
                "accountant": None}
    plan = training_plan(model_name, n_train, args)
    input_rank, input_fraction = INPUT_SUBSPACES.get(model_name, (60, 0.1))
    input_rank = args.input_rank or input_rank
    input_fraction = args.input_epsilon_fraction or input_fraction
    settings = dataclasses.replace(settings, input_rank=input_rank,
                                   input_epsilon_fraction=input_fraction)
    try:
      model = build_model(model_name, d, ds.num_classes, args.hidden)
      p = sum(int(np.size(leaf)) for leaf in jax.tree_util.tree_leaves(
          jax.eval_shape(model.init, jax.random.key(0))))
    except (ValueError, ImportError) as exc:   # a public fact of these settings: not runnable
      model, note = None, f"the {model_name} model cannot be built: {exc}"
      routes = [Route(m, s, None if m == "non_private" else
                      n_train - n_public if m in PUBLIC_METHODS else n_train, note)
                for m, s in METHODS]
    if model is not None:
      X, X_test = features(model.features)
      splits = {"tune": (X[tune], y[tune]), "test": (X_test, y_test)}
      routes = plan_routes(n_train=n_train, n_public=n_public, p=p, k=args.k,
                           epsilon=args.epsilon, delta=args.delta, batch_size=plan.batch_size,
                           gamma=args.gamma,
                           subspace_epsilon_fraction=args.subspace_epsilon_fraction,
                           d=X.shape[1], dataset=ds.name,
                           dense_first_layer=model.dense_first_layer,
                           model=model_name, input_rank=input_rank)
    plans[model_name] = {"batch_size": plan.batch_size, "steps": plan.steps,
                            "learning_rates": list(plan.learning_rates),
                            "tuning": _tuning_report(tuning_plan(plan.learning_rates),
                                                     sorted(plan.learning_rates)[
                                                         len(plan.learning_rates) // 2]),
                            "features": None if model is None else model.features,
                            "input_rank": input_rank, "input_epsilon_fraction": input_fraction}

    def accuracies(params_list, split, model=model):
      return [float(model_accuracy(model.logits, p, *map(jnp.asarray, splits[split])))
              for p in params_list]

    summary[model_name] = {}
    for route in (r for r in routes if r.method in args.methods):
      base = {"method": route.method, **base_row, "n_private": route.n_private}
      if route.note is not None:
        print(f"{model_name}/{route.method}: not runnable: {route.note}", file=sys.stderr)
        results += [{**base, "seed": s, "status": "not_runnable", "note": route.note}
                    for s in range(args.seeds)]
        continue
      if progress:
        print(f"{model_name}/{route.method}: {args.seeds} seed(s)", file=sys.stderr)
      start = time.perf_counter()
      try:
        kind, released = seed_runs(model_name, model, route, accuracies)
        accs = accuracies([r[0] for r in released], "test")
      except Exception as exc:  # pylint: disable=broad-except  # isolate methods; record it
        traceback.print_exc()
        note = f"{type(exc).__name__}: {exc}"
        print(f"{model_name}/{route.method}: FAILED ({note}); carrying on", file=sys.stderr)
        results += [{**base, "seed": s, "status": "failed", "note": note}
                    for s in range(args.seeds)]
        continue
      accountant = {"non_private": None, "fixed": ACCOUNTANT,
                    "private": TUNING_ACCOUNTANT}[kind]
      summary[model_name][route.method] = {
          "mean_test_accuracy": float(np.mean(accs)), "min_test_accuracy": float(np.min(accs)),
          "max_test_accuracy": float(np.max(accs)), "seeds": len(accs), "tuning": kind,
          "accountant": accountant, "seconds": time.perf_counter() - start}
      for seed, (acc, (_, lr, runs, sigma, rank, (eps, delta, ok, notes))) in enumerate(
          zip(accs, released)):
        for note in notes:
          print(f"  note: {note}", file=sys.stderr)
        results.append({**base, "seed": seed, "epsilon": eps, "delta": delta,
                        "test_accuracy": acc, "subspace_ok": ok,
                        "note": " ".join(notes) or None, "rank": rank,
                        "noise_multiplier": sigma, "learning_rate": lr, "tuning": kind,
                        "runs": runs, "accountant": accountant})
    winners[model_name] = _winner(summary[model_name])
    dense_first = model.dense_first_layer if model is not None else model_name != "cnn"
    applicable = [m for m in methods if dense_first or m not in experiments.DENSE_ROUTES]
    crossover[model_name] = crossover_lines(ds.name, study_model(model_name, args.hidden),
                                            args.epsilon, applicable)

  report = {"dataset": ds.name, "n_train": int(n_train), "n_tune": int(n_tune),
            "n_test": int(ds.X_test.shape[0]), "n_public": int(n_public), "k": args.k,
            "training": plans, "neighboring": "ADD_OR_REMOVE_ONE",
            "epsilon": args.epsilon, "delta": args.delta, "budget": "per released run",
            "composed": composed_total(results),
            "subspace_epsilon_fraction": args.subspace_epsilon_fraction,
            "seconds": time.perf_counter() - started,
            "models": list(args.models), "methods": methods, "winner": winners,
            "crossover": crossover, "best_private": _best_private(winners),
            "privacy_note": _privacy_note(int(n_train), int(n_public), int(n_tune),
                                          args.epsilon, args.delta),
            "summary": summary, "results": results}
  _print_table(report)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=2, ensure_ascii=False)
    print(f"wrote {args.json}")
  if args.plot:
    _plot(report, args.plot)
    print(f"wrote {args.plot}")
  failed = [r for r in results if r["status"] == "failed"]
  if failed:
    print(f"{len(failed)} run(s) failed (status 'failed' above); the other runs are reported "
          "as usual.", file=sys.stderr)
  return report


def _study() -> dict:
  """The crossover study's summary (``dpjax/_data/crossover.json``; {} if absent)."""
  from importlib import resources   # pylint: disable=import-outside-toplevel
  try:
    with (resources.files("dpjax") / "_data" / "crossover.json").open("r",
                                                                      encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:          # pragma: no cover - an installation without package data
    return {}


def study_model(model: str, hidden: int) -> str | None:
  """The crossover study's name of the main job's ``model`` (``"mlp"`` with ``hidden`` units:
  ``mlp_small`` for 32, ``mlp_large`` for 128, ``mlp_1000`` for 1000, else None; ``"cnn"`` and
  ``"scatnet"``: their own)."""
  return model if model in ("cnn", "scatnet") else _STUDY_MODELS.get(hidden)


def crossover_lines(dataset: str, model: str | None, epsilon: float, methods) -> dict:
  """``{method: line}`` from the crossover study for the cell nearest this run: the study's
  data set (MNIST-10k or digits; none for a user's data), its ``model`` (a study model name,
  :func:`study_model`; else, or if the study has no such cell, its softmax) and the largest ε
  it measured at or below this one (else the smallest above). A route the study measured says
  "wins from n ≈ N at ε = E (model M)" (it wins at every measured n from N on), "wins at
  n ≈ N1, N2 (not at n = N) …" (a public subspace can win at small n only) or "does not win up to
  n = N at ε = E (model M): X points vs the best dp_sgd (its model)", with ", though it beats
  this model's dp_sgd from n ≈ N' (…)" where it beats its own model's DP-SGD but not the best
  private model, and "; on M' it wins from n ≈ N (…)" where the study found the route winning
  with another model of the data set at that ε; others say why there is no line."""
  study = _study().get(_STUDY_DATA.get(dataset, ""), {})
  if not study:
    return {m: f"the crossover study has no measurements on {dataset}" for m in methods
            if m not in ("non_private", "dp_sgd")}
  model = model if model in study else "softmax" if "softmax" in study else sorted(study)[0]
  eps_all = sorted(study[model], key=float)
  below = [e for e in eps_all if float(e) <= epsilon * (1 + 1e-9)]
  eps = below[-1] if below else eps_all[0]
  rows = study[model][eps]
  lines = {}
  for m in methods:
    if m in ("non_private", "dp_sgd"):
      continue
    names = [r for r in rows if r == m or r.startswith(m + "_m")]
    if not names:
      lines[m] = f"not measured by the crossover study (ε = {eps}, {model})"
      continue
    parts = []
    for name in names:
      c = rows[name]
      label = name if name != m else ""
      wins = c.get("n_wins") or ([] if c["n_star"] is None else [c["n_star"]])
      if wins and wins[-1] == c["n_max"] and c["n_star"] is not None:
        parts.append(f"{label} wins from n ≈ {c['n_star']:,} at ε = {eps} ({model})".strip())
      elif wins:
        at = ", ".join(f"{n:,}" for n in wins)
        parts.append(f"{label} wins at n ≈ {at} (not at n = {c['n_max']:,}: "
                     f"{100 * c['vs_best_dp_sgd_at_n_max']:+.1f} points vs the best dp_sgd) at "
                     f"ε = {eps} ({model})".strip())
      else:
        best = f" ({c['best_model_at_n_max']})" if c.get("best_model_at_n_max") else ""
        parts.append(f"{label} does not win up to n = {c['n_max']:,} at ε = {eps} ({model}): "
                     f"{100 * c['vs_best_dp_sgd_at_n_max']:+.1f} points vs the best dp_sgd{best}"
                     .strip())
        if c.get("n_star_model") is not None:
          parts[-1] += (f", though it beats this model's dp_sgd from n ≈ {c['n_star_model']:,} "
                        f"({100 * c['diff_at_n_max']:+.1f} points at n = {c['n_max']:,})")
    for other in sorted(study):        # where the study found the route winning on another model
      c = study[other].get(eps, {}).get(m)
      if other != model and c is not None and c.get("n_star") is not None:
        parts.append(f"on {other} it wins from n ≈ {c['n_star']:,} at ε = {eps} "
                     f"({100 * c['vs_best_dp_sgd_at_n_max']:+.1f} points vs the best dp_sgd at "
                     f"n = {c['n_max']:,})")
    lines[m] = "; ".join(parts)
  return lines


def run_key(seed: int, model: str, method: str) -> jax.Array:
  """The key of one (model, method, seed) of the main job: ONE split of ``key(seed)`` into a key
  per (model, method) of every model in :data:`MODELS` and method in :data:`METHODS` (whichever
  are selected), so no two runs share a stream (issue 49 §3). The method derives everything it
  draws from it: the tuning's K, rates and run keys (:func:`tuning_runs`), or one run's init,
  sampling and noise (``experiments.run_keys`` or ``train_dp_sgd``'s)."""
  keys = jax.random.split(jax.random.key(seed), (len(MODELS), len(METHODS)))
  return keys[MODELS.index(model), [m for m, _ in METHODS].index(method)]


def tuning_plan(grid) -> accounting.HyperparameterTuning | None:
  """The private tuning of a learning-rate grid: K logarithmic with mean ``len(grid)`` (None
  for a single rate: nothing to tune)."""
  return accounting.HyperparameterTuning(float(len(grid)), 0.0) if len(grid) > 1 else None


def tuning_runs(key: jax.Array, tuning: accounting.HyperparameterTuning,
                grid) -> tuple[list[jax.Array], list[float]]:
  """One private tuning's runs: ``(keys, learning rates)``, K of each. One split of ``key``
  into the draw of K, the draw of the rates (uniform over ``grid``, a public distribution) and
  the runs' keys."""
  k_count, k_rates, k_runs = jax.random.split(key, 3)
  count = accounting.tuning_repetitions(k_count, tuning)
  picks = host_rng(k_rates).integers(len(grid), size=count)
  return list(jax.random.split(k_runs, count)), [float(grid[i]) for i in picks]


def _tuning_report(tuning, fixed_lr: float) -> dict:
  if tuning is None:
    return {"method": "none (a single learning rate)", "fixed_learning_rate": fixed_lr}
  return {"method": "Papernot & Steinke (2022) random stopping, RDP accountant",
          "mean_runs": tuning.mean, "shape": tuning.shape, "distribution": "logarithmic",
          "tuned_methods": list(TUNED_PRIVATELY), "fixed_learning_rate": fixed_lr,
          "score": "accuracy on the tuning split (public by this experiment's construction)"}


def _winner(summary: dict) -> dict | None:
  """The DP method with the highest mean test accuracy, and its margin over ``dp_sgd``."""
  private = {m: r["mean_test_accuracy"] for m, r in summary.items() if m != "non_private"}
  if not private:
    return None
  best = max(private, key=private.get)
  margin = private[best] - private["dp_sgd"] if "dp_sgd" in private else None
  return {"method": best, "mean_test_accuracy": private[best], "vs_dp_sgd": margin}


def _best_private(winners: dict) -> dict | None:
  """The best private model overall: the (model, method) with the highest mean test accuracy
  over the models' winners."""
  done = {m: w for m, w in winners.items() if w is not None}
  if not done:
    return None
  model = max(done, key=lambda m: done[m]["mean_test_accuracy"])
  return {"model": model, "method": done[model]["method"],
          "mean_test_accuracy": done[model]["mean_test_accuracy"]}


def exit_status(report: dict) -> int:
  """The main job's exit status: 1 if a run failed unexpectedly, else 0 (methods reported as
  not runnable at these settings do not count as failures)."""
  return int(any(r["status"] == "failed" for r in report["results"]))


def composed_total(results) -> dict:
  """What the whole report releases, composed (issue 49 §4): every DP run it publishes was
  trained on the same rows, each at its own (ε, δ), so together they are (Σε, Σδ)-DP by basic
  composition (a bound: their accountants differ, PLD for the untuned runs and RDP for the
  tuned ones); a non-private reference it publishes has no guarantee at all."""
  runs = [r for r in results if r["status"] == "ok" and r["epsilon"] is not None]
  return {"dp_runs": len(runs), "epsilon": float(sum(r["epsilon"] for r in runs)),
          "delta": float(sum(r["delta"] for r in runs)), "composition": "basic",
          "non_private_released": any(r["status"] == "ok" and r["method"] == "non_private"
                                      for r in results)}


def _privacy_note(n_train: int, n_public: int, n_tune: int, epsilon: float,
                  delta: float) -> str:
  share = n_public / n_train
  public = ", ".join(PUBLIC_METHODS)
  return (f"(ε, δ) = ({epsilon:g}, {delta:g}) under add/remove-one covers the private training "
          f"rows: all {n_train} training rows for the methods without public data; for "
          f"{public} the other {n_train - n_public} ({1 - share:.0%}), while their public split "
          f"of {n_public} rows ({share:.0%}) is public only because this experiment marks it so "
          f"and gets no protection. The {n_tune} tuning rows score the tuning's runs and are "
          "public by the same construction; the tuning's cost to the training rows is in the "
          "(ε, δ) (Papernot–Steinke, RDP).")


def _print_table(report: dict) -> None:
  print(f"\n{report['dataset']}: n_train={report['n_train']} (public split "
        f"{report['n_public']}), n_tune={report['n_tune']}, n_test={report['n_test']}; "
        f"(ε, δ) = ({report['epsilon']:g}, {report['delta']:g}) per released run, "
        f"add/remove-one, tuning included; {report['seconds']:.0f} s in all")
  total = report["composed"]
  reference = (", and the non-private reference with no guarantee"
               if total["non_private_released"] else "")
  print(textwrap.fill(
      f"the report: {total['dp_runs']} DP runs on the same rows, together (ε, δ) ≤ "
      f"({total['epsilon']:.4g}, {total['delta']:.3g}) by basic composition{reference}; each "
      "run illustrates one budget of its own, the report as a whole is not released under "
      "it", width=100, break_on_hyphens=False))
  print(textwrap.fill("privacy: " + report["privacy_note"], width=100, break_on_hyphens=False))
  for model, t in report["training"].items():
    grid = ", ".join(f"{lr:g}" for lr in t["learning_rates"])
    tuning = t["tuning"]
    how = (f"{', '.join(tuning['tuned_methods'])} tuned privately ({tuning['method']}; K ~ "
           f"logarithmic with mean {tuning['mean_runs']:g} runs, rates drawn from the grid, the "
           "best on the tuning split released); the other DP methods run once at lr "
           f"{tuning['fixed_learning_rate']:g} (PLD accountant)" if "mean_runs" in tuning
           else f"nothing tuned: one rate, {tuning['fixed_learning_rate']:g}")
    print(textwrap.fill(f"{model} ({t['features']}): expected batch {t['batch_size']}, "
                        f"{t['steps']} steps, Adam learning rates {grid}; {how}.", width=100,
                        break_on_hyphens=False))
  header = (f"{'model':<8}{'method':<25}{'rank':>5}{'sigma':>7}{'lr':>7}{'runs':>5}{'seed':>5}"
            f"{'eps/run':>9}{'delta/run':>10}{'test acc':>9}  {'subspace':<9}status")
  print(header)
  print("-" * len(header))
  notes = {}
  for r in report["results"]:
    rank = "-" if r["rank"] is None else str(r["rank"])
    sigma = "-" if r["noise_multiplier"] is None else f"{r['noise_multiplier']:.2f}"
    lr = "-" if r["learning_rate"] is None else f"{r['learning_rate']:g}"
    eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.3f}"
    delta = "-" if r["delta"] is None else f"{r['delta']:.1e}"
    acc = "-" if r["test_accuracy"] is None else f"{r['test_accuracy']:.4f}"
    ok = {None: "-", True: "ok", False: "⊥"}[r["subspace_ok"]]
    runs = "-" if r["runs"] is None else str(r["runs"])
    print(f"{r['model']:<8}{r['method']:<25}{rank:>5}{sigma:>7}{lr:>7}{runs:>5}{r['seed']:>5}"
          f"{eps:>9}{delta:>10}{acc:>9}  {ok:<9}{r['status']}")
    if r["note"] is not None:
      notes.setdefault((r["model"], r["method"], r["status"], r["note"]), []).append(
          str(r["seed"]))
  for (model, method, status, note), seeds in notes.items():
    label = "seed" if len(seeds) == 1 else "seeds"
    print(textwrap.fill(f"{model}/{method} ({label} {', '.join(seeds)}, {status}): {note}",
                        width=100, subsequent_indent="    ", break_on_hyphens=False))
  for model in report["models"]:
    if report["summary"].get(model):
      print(f"{model}: test accuracy, mean [min, max] over the seeds; wall time per method:")
      for method, m in report["summary"][model].items():
        print(f"  {method:<25}{m['mean_test_accuracy']:.4f} [{m['min_test_accuracy']:.4f}, "
              f"{m['max_test_accuracy']:.4f}] over {m['seeds']} seed(s), {m['seconds']:.0f} s")
    if report["crossover"].get(model):
      print(f"{model}: crossover study (benchmarks/gradient_subspace.py; docs/algorithms.md "
            "§6.5.1):")
      for method, line in report["crossover"][model].items():
        print(textwrap.fill(f"  {method}: {line}", width=100, subsequent_indent="    ",
                            break_on_hyphens=False))
    won = report["winner"][model]
    if won is None:
      print(f"{model}: won: no DP method finished")
    elif won["method"] == "dp_sgd" or won["vs_dp_sgd"] is None:
      print(f"{model}: won: {won['method']} (mean test accuracy "
            f"{won['mean_test_accuracy']:.4f}); no route beat tuned DP-SGD here")
    else:
      seeds = len({r["seed"] for r in report["results"]})
      print(f"{model}: won: {won['method']} (mean test accuracy "
            f"{won['mean_test_accuracy']:.4f}, {won['vs_dp_sgd']:+.4f} against tuned dp_sgd over "
            f"{seeds} seed(s); benchmarks/gradient_subspace.py gives paired intervals)")
  best = report["best_private"]
  if best is not None and len(report["models"]) > 1:
    print(f"best private model overall: {best['model']}/{best['method']} (mean test accuracy "
          f"{best['mean_test_accuracy']:.4f}); each route against it:")
    for model, rows in report["summary"].items():
      for method, m in rows.items():
        if method != "non_private" and (model, method) != (best["model"], best["method"]):
          print(f"  {model}/{method}: {m['mean_test_accuracy'] - best['mean_test_accuracy']:+.4f}")


def _plot(report: dict, path: str) -> None:
  """Test accuracy per method: mean over the seeds, with the range."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as exc:  # pragma: no cover
    raise ImportError('--plot needs matplotlib: pip install "dpjax[examples]".') from exc
  models = report["models"]
  fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.4), squeeze=False)
  for ax, model in zip(axes[0], models):
    rows = [r for r in report["results"] if r["model"] == model]
    methods = [m for m, _ in METHODS]
    accs = {m: [r["test_accuracy"] for r in rows if r["method"] == m and r["status"] == "ok"]
            for m in methods}
    bottom = {m: sum(r["subspace_ok"] is False for r in rows if r["method"] == m)
              for m in methods}
    done = [m for m in methods if accs[m]]
    means = [float(np.mean(accs[m])) for m in done]
    err = [[mean - min(accs[m]) for m, mean in zip(done, means)],
           [max(accs[m]) - mean for m, mean in zip(done, means)]]
    ax.bar(range(len(done)), means, yerr=err, capsize=3,
           color=["tab:gray" if m == "non_private" else "tab:orange" if m in PUBLIC_METHODS
                  else "tab:blue" for m in done])
    for i, m in enumerate(done):     # the seeds themselves, and ⊥ where a subspace was ⊥
      ax.plot([i] * len(accs[m]), accs[m], "k.", ms=4)
      if bottom[m]:
        ax.annotate(f"⊥ ×{bottom[m]}", (i, means[i]), ha="center", va="bottom", fontsize=8,
                    color="tab:red")
    ax.set_xticks(range(len(done)), done, rotation=30, ha="right")
    ax.set_ylabel("test accuracy (mean, range and dots: seeds)")
    ax.set_title(f"{report['dataset']}, {model}: total ε = {report['epsilon']:g}, "
                 f"δ = {report['delta']:.0e}")
    if means:
      ax.set_ylim(max(0.0, min(means) - 0.1), 1.0)
    ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  """Parses the options, runs the main job and returns its report (see :func:`run`).

  ``python -m dpjax.demo`` exits with :func:`exit_status` of the report: 1 if a run failed
  unexpectedly, else 0.
  """
  parser = argparse.ArgumentParser(
      prog="python -m dpjax.demo", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--epsilon", type=float, default=2.0, help="total ε (default 2.0)")
  parser.add_argument("--delta", type=float, default=1e-5, help="total δ (default 1e-5)")
  parser.add_argument("--k", type=int, default=16, help="subspace dimension (default 16)")
  parser.add_argument("--input-rank", type=int, default=None,
                      help="private_input_subspace's rank for every model (default: each "
                           "model's, see INPUT_SUBSPACES: 60 on pixels, Abadi et al.'s; 2,048 "
                           "on scattering features; where the crossover study found it best)")
  parser.add_argument("--input-epsilon-fraction", type=float, default=None,
                      help="share of ε spent on private_input_subspace's basis for every model "
                           "(default: each model's, see INPUT_SUBSPACES: 0.3 on pixels, 0.05 on "
                           "scattering features)")
  parser.add_argument("--seeds", type=int, default=2,
                      help="number of seeds; the table gives the spread over them (default 2)")
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps of every model (default: each model's epochs over "
                           "its private rows, see TRAINING)")
  parser.add_argument("--data", type=str, default="mnist",
                      help="mnist (default: the bundled full MNIST, 60,000 / 10,000), mnist10k "
                           "(its 10,000-digit subset), digits, or an .npz with arrays X (n, d) "
                           "or 28x28 images X (n, 28, 28) in [0, 1] and integer y (n,)")
  parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                      choices=[m for m, _ in METHODS],
                      help="the methods to run (default: all but dp_sgd_denoise)")
  parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list(MODELS),
                      help="scatnet (softmax regression on the images' scattering features, "
                           "needs kymatio), mlp (one tanh hidden layer of --hidden units on the "
                           "pixels) and/or cnn (a Flax NNX CNN for square images, needs flax; "
                           "its routes: those that take any params pytree) "
                           "(default: scatnet mlp)")
  parser.add_argument("--json", type=str, default=None, help="write the results to this path")
  parser.add_argument("--plot", type=str, default=None,
                      help="write a PNG of each method's test accuracy")
  parser.add_argument("--batch-size", type=int, default=None,
                      help="expected batch size of every model (default: each model's, see "
                           "TRAINING, capped at an eighth of the private rows)")
  parser.add_argument("--clip-norm", type=float, default=1.0,
                      help="per-example clip norm (default 1.0)")
  parser.add_argument("--learning-rates", type=float, nargs="+", default=None,
                      help="Adam learning rates of every model; the tuned methods draw from them "
                           "(default: each model's two, see TRAINING: two points keep the main "
                           "job within 10 minutes on 2 CPU cores)")
  parser.add_argument("--hidden", type=int, default=1000,
                      help="hidden units of the MLP (default 1000, Abadi et al.'s)")
  parser.add_argument("--public-fraction", type=float, default=0.1,
                      help="share of the training rows marked public for the public methods "
                           "(default 0.1; public only by this experiment's construction)")
  parser.add_argument("--public-rows", type=int, default=1000,
                      help="at most this many public rows (default 1000, PDP-SGD's setting)")
  parser.add_argument("--cache-dir", type=str, default=None,
                      help="keep the scattering features in this folder and reuse them "
                           "(default: compute them each run, about 35 s for full MNIST)")
  parser.add_argument("--gamma", type=float, default=1e-3,
                      help="DPASE's public gap parameter for the gradient subspace (default 1e-3)")
  parser.add_argument("--subspace-epsilon-fraction", type=float, default=0.25,
                      help="share of ε spent on DPASE's gradient subspace (default 0.25); if "
                           "DPASE cannot run at this share, that method is reported as not "
                           "runnable")
  parser.add_argument("--refresh-every", type=int, default=10,
                      help="subspace_dp_sgd_public recomputes its public subspace every this "
                           "many steps (free; default 10)")
  parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
  args = parser.parse_args(argv)
  if not (math.isfinite(args.epsilon) and args.epsilon > 0):
    parser.error(f"--epsilon must be > 0, got {args.epsilon}")
  if not 0 < args.delta < 1:
    parser.error(f"--delta must lie in (0, 1), got {args.delta}")
  for name in ("k", "input_rank", "seeds", "steps", "batch_size", "hidden", "refresh_every",
               "public_rows"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if not (math.isfinite(args.clip_norm) and args.clip_norm > 0):
    parser.error(f"--clip-norm must be > 0, got {args.clip_norm}")
  if args.learning_rates is not None and not all(math.isfinite(lr) and lr > 0
                                                 for lr in args.learning_rates):
    parser.error(f"--learning-rates must be > 0, got {args.learning_rates}")
  for name in ("public_fraction", "subspace_epsilon_fraction", "input_epsilon_fraction"):
    if getattr(args, name) is not None and not 0 < getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must lie in (0, 1), got {getattr(args, name)}")
  if not (math.isfinite(args.gamma) and args.gamma >= 0):
    parser.error(f"--gamma must be >= 0, got {args.gamma}")
  if args.plot:
    try:
      import matplotlib  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
      parser.error('--plot needs matplotlib: pip install "dpjax[examples]"')
  return run(args)


if __name__ == "__main__":
  sys.exit(exit_status(main()))
