"""One DP-SGD step: dpjax's ghost clipping against a non-private step and per-example libraries.

    python benchmarks/dpsgd_step.py [--quick] [--json PATH]
    python benchmarks/dpsgd_step.py --models 784-1024-256-10 cnn transformer --batch 128

Every side is ONE jitted optimiser step (gradient, privatisation, ``optax.sgd`` update) of a
model with softmax cross-entropy, on a fixed batch of ``--batch`` rows (256; all rows real,
mask all True), clip norm C = 1, noise multiplier σ = 1. The models (``--models``):

* layer widths ``in-h1-...-out``: a tanh MLP with biases written with :func:`dpjax.sgd.dense`
  (keyed by its parameter count: ``1M`` = 784-1024-256-10, 1.07M parameters; ``10M`` =
  784-4096-1664-10, 10.0M);
* ``cnn``: a Flax NNX CNN on 28×28×1 images, as a Flax user writes it (``nnx.Conv`` 1→32 3×3,
  ``nnx.Conv`` 32→64 3×3 stride 2, ``nnx.Linear`` 12,544→10; 144,266 parameters), through
  :func:`dpjax.sgd.flax_layers.nnx_model`;
* ``transformer``: a small Flax NNX transformer classifying token sequences (``--seq`` 64
  tokens of a 512-token vocabulary; ``nnx.Embed`` for tokens and positions, 2 pre-norm blocks of
  ``nnx.MultiHeadAttention`` (4 heads, width 128) and an ``nnx.Linear`` MLP (512), mean pooling,
  10 classes; 471,818 parameters at ``--seq`` 64). Every parameter of each model is clipped
  by ghost norms (no ``vmap(grad)`` fallback; the run fails on the fallback warning).

The sides:

* ``nonprivate`` — ``jax.grad`` of the mean loss, then sgd (the reference; the Flax models run
  batched, as a user's non-private step does).
* ``ghost`` — :func:`dpjax.sgd.ghost_clipped_grad_sum` (ghost norms + book-keeping), then
  :func:`dpjax.sgd.dp_noise` built from it (the full release: std σC, C read from the grad fn)
  and sgd.
* ``ghost_no_noise`` — the same without the noise (a diagnostic, not private: drawing p
  Gaussians is a fixed cost of every DP side, threefry's, which the non-private step does not
  pay).
* ``ghost_subspace`` — ghost's sum released in a subspace (issue 52 §6): a per-layer basis of
  rank ``--subspace-rank`` (16) on the first layer's kernel ``(d, h)`` (a random orthonormal
  ``(d, k)``; the other leaves keep full noise), so the first layer draws k·h normals instead
  of d·h (``noise_draws`` in the JSON); MLPs only.
* ``ghost_bandmf``, ``ghost_subspace_bandmf`` — the same two releases with BandMF correlated
  noise (issue 52 §1, §6; :func:`dpjax.sgd.banded_toeplitz` of 4 bands): the same normals a
  step, plus 3 multiply-adds per released coordinate and a buffer of 3 copies of the released
  coordinates (p of them, or k·h on the projected kernel); unavailable without jax_privacy.
* ``ghost_blt`` — the full release with DP-λCGD's one-buffer BLT noise
  (:func:`dpjax.sgd.lambda_cgd` at λ = 0.8: one buffer of p, one multiply-add per coordinate);
  unavailable without jax_privacy.
* ``ghost_adaptive`` — adaptive clipping by ghost clipping
  (:func:`dpjax.sgd.ghost_quantile_clipped_grad_sum`: the loss divided by C_t, the count
  released inside the sum), the noise, the clip norm's update from the state, and sgd.
* ``vmap`` — :func:`dpjax.sgd.clipped_grad_sum` (``vmap(grad)``, per-example gradients
  materialised), the same noise and sgd.
* ``vmap_per_layer`` — the same with per-layer clipping (``per_layer="uniform"``: C/√K per
  leaf, Δ = C; issue 52 §2).
* ``optax_dpsgd`` — ``optax.contrib.dpsgd`` fed ``vmap(grad)`` per-example gradients.
* ``jax_privacy`` — ``jax_privacy.clipping.clipped_grad(loss, l2_clip_norm=C,
  keep_batch_dim=False, microbatch_size=--microbatch)`` (its sum of clipped gradients), then
  dpjax's noise built from it (it carries its bound C) and sgd; recorded as ``"unavailable: ..."``
  when it does not import. It always gets its ``microbatch_size`` (32): its faster setting here
  (measured on 784-512-10, batch 256: 1.8 s per sum with it, 4.5 s without, 0.73 s for dpjax's
  vmap path).

Memory: the per-example sides hold ``batch × p`` gradients (10 GB in float32 at p = 10M,
batch 256). When that exceeds ``--max-per-example-gb`` (default 2) they run in micro-batches of
``--microbatch`` rows (32) summed inside the same jitted step: dpjax's vmap path with
:func:`dpjax.sgd.sampling.accumulate_microbatches`, and optax with its own
``optax.per_example_global_norm_clip`` over each micro-batch, then the noise of
``optax.contrib.dpsgd`` (std σC per coordinate, divided by the batch size): its
``GradientTransformation`` cannot take micro-batches. The JSON's ``notes`` say which sides did.
``memory_mb`` per side is XLA's compiled buffer estimate (arguments + outputs + temporaries −
aliased, ``compiled.memory_analysis()``), the step's peak device memory as XLA plans it, not
the process's resident memory.

Timing protocol (``benchmarks/_timing.py``): each side's first call (tracing, XLA compilation
and one run) is reported on its own as ``compile_s``; then ``--repeats`` rounds, each timing
every side once in turn (interleaved, so all see the same machine load); a short step is run
``calls_per_sample`` times in a row per sample (as many as make about 0.2 s of that side's
step, at most 50; their mean is the sample), as one 10 ms call is at the mercy of the scheduler
(the 1M MLP's ratio ranged 1.08–1.41 over single-call runs). The ratios are per
round, ``ghost_r / other_r`` (< 1: ghost faster), summarised by median and min; ``summary``
holds the medians. Before timing, ghost's clipped sum is checked against the vmap path's
(``ghost_vs_vmap_max_rel_diff``). Absolute times depend on the machine and its load and are not
a claim.

``--quick``: the 1M MLP, the CNN and the transformer, 5 repeats.
"""

from __future__ import annotations

import argparse
import json
import platform
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _timing import timed
from dpjax import sgd
from dpjax.sgd import flax_layers
from dpjax.sgd import ghost as ghost_lib
from dpjax.sgd import sampling

DEFAULT_MODELS = ("784-1024-256-10", "cnn", "transformer", "784-4096-1664-10")
QUICK_MODELS = ("784-1024-256-10", "cnn", "transformer")
SIDES = ("nonprivate", "ghost", "ghost_no_noise", "ghost_subspace", "ghost_bandmf",
         "ghost_subspace_bandmf", "ghost_blt", "ghost_adaptive", "vmap", "vmap_per_layer",
         "optax_dpsgd", "jax_privacy")
BANDS, BANDMF_STEPS = 4, 1_000_000   # BandMF sides: b bands, normalised for a long run
CLIP, SIGMA, LR = 1.0, 1.0, 0.1
MIN_SAMPLE_S = 0.2     # a timed sample repeats a short step to last about this long
VOCAB, WIDTH, HEADS, HIDDEN, BLOCKS, CLASSES = 512, 128, 4, 512, 2, 10


class Bench(NamedTuple):
  """A benchmarked model: ``apply_fn(params, x, *, dense)`` for one example, ``params``,
  ``batched_loss(params, X, y)`` (the non-private step's mean loss) and ``data(batch)`` →
  ``(X, y)``."""
  apply_fn: Callable
  params: object
  batched_loss: Callable
  data: Callable


def apply_fn(params, x, *, dense):
  """The MLP, written once for every side (``dense`` passed in, :func:`dpjax.sgd.dense`)."""
  for i in range(len(params)):
    x = dense(params[f"l{i}"], x)
    if i < len(params) - 1:
      x = jnp.tanh(x)
  return x


def example_loss(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def model_key(num_params: int) -> str:
  if num_params >= 999_500:
    return f"{num_params / 1e6:.0f}M"
  return f"{num_params / 1e3:.0f}k" if num_params >= 1000 else str(num_params)


def init(widths, seed=0):
  rng = np.random.default_rng(seed)
  return {f"l{i}": {"w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32),
                    "b": jnp.zeros(b, jnp.float32)}
          for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))}


def _mean_of(loss_fn):
  return lambda p, X, y: jnp.mean(jax.vmap(loss_fn, (None, 0))(p, (X, y)))


def mlp_bench(widths) -> Bench:
  def data(batch):
    rng = np.random.default_rng(1)
    return (jnp.asarray(rng.standard_normal((batch, widths[0])), jnp.float32),
            jnp.asarray(rng.integers(0, widths[-1], batch)))
  return Bench(apply_fn, init(widths), _mean_of(ghost_lib.model_loss(apply_fn, example_loss)),
               data)


def _flax_bench(model, data) -> Bench:
  from flax import nnx
  graphdef, params = nnx.split(model, nnx.Param)

  def batched_loss(p, X, y):
    return jnp.mean(example_loss(nnx.merge(graphdef, p)(X), y))
  return Bench(flax_layers.nnx_apply(graphdef), params, batched_loss, data)


def cnn_bench() -> Bench:
  """The NNX CNN on 28×28×1 images (module docstring)."""
  from flax import nnx

  class CNN(nnx.Module):
    def __init__(self, rngs):
      self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
      self.conv2 = nnx.Conv(32, 64, (3, 3), strides=2, rngs=rngs)
      self.dense = nnx.Linear(14 * 14 * 64, CLASSES, rngs=rngs)

    def __call__(self, x):
      h = jax.nn.relu(self.conv1(x))
      h = jax.nn.relu(self.conv2(h))
      return self.dense(h.reshape(h.shape[0], -1))

  def data(batch):
    rng = np.random.default_rng(1)
    return (jnp.asarray(rng.standard_normal((batch, 28, 28, 1)), jnp.float32),
            jnp.asarray(rng.integers(0, CLASSES, batch)))
  return _flax_bench(CNN(nnx.Rngs(0)), data)


def transformer_bench(seq) -> Bench:
  """The small NNX transformer (module docstring)."""
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.norm1 = nnx.LayerNorm(WIDTH, rngs=rngs)
      self.attention = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
      self.norm2 = nnx.LayerNorm(WIDTH, rngs=rngs)
      self.up = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
      self.down = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)

    def __call__(self, h):
      h = h + self.attention(self.norm1(h))
      return h + self.down(jax.nn.gelu(self.up(self.norm2(h))))

  class Transformer(nnx.Module):
    def __init__(self, rngs):
      self.tokens = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
      self.positions = nnx.Embed(seq, WIDTH, rngs=rngs)
      self.blocks = nnx.List([Block(rngs) for _ in range(BLOCKS)])
      self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
      self.head = nnx.Linear(WIDTH, CLASSES, rngs=rngs)

    def __call__(self, ids):
      h = self.tokens(ids) + self.positions(jnp.arange(ids.shape[-1]))
      for block in self.blocks:
        h = block(h)
      return self.head(self.norm(h).mean(axis=-2))

  def data(batch):
    rng = np.random.default_rng(1)
    return (jnp.asarray(rng.integers(0, VOCAB, (batch, seq)), jnp.int32),
            jnp.asarray(rng.integers(0, CLASSES, batch)))
  return _flax_bench(Transformer(nnx.Rngs(0)), data)


def build(spec, seq) -> tuple[str | None, Bench]:
  """``(key or None, bench)``: a named model keeps its name; widths are keyed by size."""
  if spec == "cnn":
    return "cnn", cnn_bench()
  if spec == "transformer":
    return "transformer", transformer_bench(seq)
  return None, mlp_bench([int(w) for w in spec.split("-")])


def _noisy(grad_fn, grad_sum, batch):
  """dpjax's noise built from the clipped-gradient function ``grad_fn`` (std σC, C read from
  it, divided by the batch size) then sgd; ``grad_sum(params, X, y)`` is the step's sum."""
  return optax.chain(sgd.dp_noise(grad_fn, noise_multiplier=SIGMA, expected_batch_size=batch,
                                  key=jax.random.key(1)),
                     optax.sgd(LR)), grad_sum


def _first_layer_bases(params, rank):
  """Per-layer bases: a random orthonormal ``(d, k)`` on ``l0/w`` (an MLP's first kernel), None
  elsewhere; None when the model has no such leaf or d ≤ k."""
  w = params.get("l0", {}).get("w") if isinstance(params, dict) else None
  if w is None or w.ndim != 2 or w.shape[0] <= rank:
    return None
  q, _ = np.linalg.qr(np.random.default_rng(3).standard_normal((w.shape[0], rank)))
  bases = jax.tree_util.tree_map(lambda _: None, params)
  bases["l0"]["w"] = jnp.asarray(q, jnp.float32)
  return bases


def noise_draws(params, bases) -> int:
  """Gaussian draws of one release: p, less d·h + k·h on each leaf with a ``(d, k)`` basis."""
  total = sum(x.size for x in jax.tree_util.tree_leaves(params))
  if bases is not None:
    for x, b in zip(jax.tree_util.tree_leaves(params),
                    jax.tree_util.tree_structure(params).flatten_up_to(bases)):
      if b is not None:
        total -= x.size - b.shape[1] * (x.size // x.shape[0])
  return int(total)


def make_steps(bench, batch, micro, micro_rows, rank=16):
  """``{side: (jitted step(params, state, X, y), initial state, notes)}``."""
  params, apply_fn = bench.params, bench.apply_fn
  loss_fn = ghost_lib.model_loss(apply_fn, example_loss)
  mask = jnp.ones(batch, bool)
  steps = {}

  def build(tx, grad_fn, note=""):
    def step(params, state, X, y):
      grads = grad_fn(params, X, y)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
    steps[side] = (jax.jit(step), tx.init(params), note)

  side = "nonprivate"
  build(optax.sgd(LR), jax.grad(bench.batched_loss))
  side = "ghost"
  ghost = sgd.ghost_clipped_grad_sum(apply_fn, example_loss, clip_norm=CLIP)
  build(*_noisy(ghost, lambda p, X, y: ghost(p, (X, y), mask), batch))
  side = "ghost_no_noise"
  build(optax.sgd(LR), lambda p, X, y: ghost(p, (X, y), mask), "diagnostic: no noise")
  side = "ghost_subspace"
  bases = _first_layer_bases(params, rank)
  if bases is None:
    steps[side] = (None, None, f"unavailable: an MLP's first kernel with more than {rank} rows")
  else:
    tx = optax.chain(sgd.dp_noise(ghost, noise_multiplier=SIGMA, expected_batch_size=batch,
                                  key=jax.random.key(1), bases=bases), optax.sgd(LR))
    build(tx, lambda p, X, y: ghost(p, (X, y), mask),
          f"rank {rank} on l0/w: {noise_draws(params, bases):,} normals, not "
          f"{noise_draws(params, None):,}")
  strategy = sgd.banded_toeplitz([1.0] * BANDS)
  for side, side_bases in (("ghost_bandmf", None), ("ghost_subspace_bandmf", bases)):
    if side == "ghost_subspace_bandmf" and bases is None:
      steps[side] = (None, None, steps["ghost_subspace"][2])
      continue
    try:
      tx = optax.chain(sgd.dp_noise(ghost, noise_multiplier=SIGMA, expected_batch_size=batch,
                                    key=jax.random.key(1), bases=side_bases,
                                    steps=BANDMF_STEPS, noise_strategy=strategy),
                       optax.sgd(LR))
      build(tx, lambda p, X, y: ghost(p, (X, y), mask), f"{BANDS} bands")
    except ImportError as err:
      steps[side] = (None, None, f"unavailable: {err}")

  side = "ghost_blt"
  try:
    tx = optax.chain(sgd.dp_noise(ghost, noise_multiplier=SIGMA, expected_batch_size=batch,
                                  key=jax.random.key(1), steps=BANDMF_STEPS,
                                  noise_strategy=sgd.lambda_cgd(0.8, min_sep=1)),
                     optax.sgd(LR))
    build(tx, lambda p, X, y: ghost(p, (X, y), mask), "DP-λCGD: one buffer")
  except ImportError as err:
    steps[side] = (None, None, f"unavailable: {err}")
  side = "ghost_adaptive"
  adaptive = sgd.ghost_quantile_clipped_grad_sum(apply_fn, example_loss, initial_clip_norm=CLIP)
  adaptive_tx = optax.chain(
      sgd.dp_noise(adaptive, noise_multiplier=SIGMA, expected_batch_size=batch,
                   key=jax.random.key(1)),
      sgd.quantile_clipping.quantile_clip_update(adaptive), optax.sgd(LR))

  def adaptive_step(params, state, X, y):
    clip = sgd.quantile_clip_state(state).clip_norm
    updates, state = adaptive_tx.update(adaptive(params, (X, y), mask, clip), state, params)
    return optax.apply_updates(params, updates), state
  steps[side] = (jax.jit(adaptive_step), adaptive_tx.init(params), "C_t from the state")

  def per_example_side(grad_fn):
    """A vmap(grad) clipped sum, in micro-batches when the per-example gradients are large."""
    if micro:
      idx = jnp.arange(batch, dtype=jnp.int32).reshape(-1, micro)
      build(*_noisy(grad_fn, lambda p, X, y: sampling.accumulate_microbatches(
          grad_fn, p, (X, y), idx, jnp.ones(idx.shape, bool)), batch),
          f"micro-batches of {micro}")
    else:
      build(*_noisy(grad_fn, lambda p, X, y: grad_fn(p, (X, y), mask), batch))

  side = "vmap"
  vmap = sgd.clipped_grad_sum(loss_fn, clip_norm=CLIP)
  per_example_side(vmap)
  side = "vmap_per_layer"
  per_example_side(sgd.clipped_grad_sum(loss_fn, clip_norm=CLIP, per_layer="uniform"))
  side = "optax_dpsgd"
  if micro:
    tx = optax.chain(_OptaxNoise(batch), optax.sgd(LR))
    build(tx, _optax_clipped_sum(loss_fn, micro),
          f"optax.per_example_global_norm_clip over micro-batches of {micro}, dpsgd's noise")
  else:
    per_example = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))
    with warnings.catch_warnings():                 # optax 0.2.8: "seed" is deprecated
      warnings.simplefilter("ignore", DeprecationWarning)
      tx = optax.contrib.dpsgd(LR, CLIP, SIGMA, seed=0)
    build(tx, lambda p, X, y: per_example(p, (X, y)))
  side = "jax_privacy"
  try:
    from jax_privacy import clipping
    clipped = clipping.clipped_grad(loss_fn, l2_clip_norm=CLIP, batch_argnums=1,
                                    keep_batch_dim=False, microbatch_size=micro_rows)
    build(*_noisy(clipped, lambda p, X, y: clipped(p, (X, y)), batch),
          f"microbatch_size={micro_rows}")
  except ImportError as err:
    steps[side] = (None, None, f"unavailable: {err}")
  return steps, (ghost, vmap, mask)


def _OptaxNoise(batch):
  """The noise of ``optax.contrib.differentially_private_aggregate`` applied to a clipped SUM."""
  def init_fn(params):
    del params
    return jax.random.key(2)

  def update_fn(total, key, params=None):
    del params
    leaves, treedef = jax.tree_util.tree_flatten(total)
    key, *keys = jax.random.split(key, len(leaves) + 1)
    noised = [(g + CLIP * SIGMA * jax.random.normal(k, g.shape, g.dtype)) / batch
              for g, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(treedef, noised), key

  return optax.GradientTransformation(init_fn, update_fn)


def _optax_clipped_sum(loss_fn, micro):
  per_example = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))

  def grad_sum(params, X, y):
    leaves, treedef = jax.tree_util.tree_flatten(params)

    def body(total, chunk):
      clipped, _ = optax.per_example_global_norm_clip(
          jax.tree_util.tree_leaves(per_example(params, chunk)), CLIP)
      return [t + c for t, c in zip(total, clipped)], None

    chunks = (X.reshape((-1, micro) + X.shape[1:]), y.reshape((-1, micro) + y.shape[1:]))
    total, _ = jax.lax.scan(body, [jnp.zeros_like(p) for p in leaves], chunks)
    return jax.tree_util.tree_unflatten(treedef, total)

  return grad_sum


def _memory_mb(fn, *args):
  """XLA's compiled buffer estimate of ``fn(*args)`` in MB (module docstring), or None."""
  try:
    stats = fn.lower(*args).compile().memory_analysis()
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
    return total / 1e6
  except Exception:  # noqa: BLE001  # not every backend reports it
    return None


def run_model(bench, batch, repeats, max_gb, micro_rows, rank=16):
  num_params = sum(x.size for x in jax.tree_util.tree_leaves(bench.params))
  per_example_gb = batch * num_params * 4 / 1e9
  micro = micro_rows if per_example_gb > max_gb else 0
  if batch % micro_rows:
    raise ValueError(f"--batch {batch} must be a multiple of --microbatch {micro_rows}.")
  params = bench.params
  with warnings.catch_warnings():        # every leaf is ghost-clipped: a fallback is an error
    warnings.filterwarnings("error", "ghost clipping: parameters", UserWarning)
    steps, (ghost, vmap, mask) = make_steps(bench, batch, micro, micro_rows, rank)
    X, y = bench.data(batch)
    out = _run_steps(steps, ghost, vmap, mask, params, X, y, repeats, micro, num_params,
                     per_example_gb)
  bases = _first_layer_bases(params, rank)
  out["noise_draws"] = {"full": noise_draws(params, None),
                        "subspace": None if bases is None else noise_draws(params, bases)}
  return out


def _run_steps(steps, ghost, vmap, mask, params, X, y, repeats, micro, num_params,
               per_example_gb):
  batch = mask.shape[0]
  check = {}
  if not micro:
    a = jax.jit(lambda p: ghost(p, (X, y), mask))(params)
    b = jax.jit(lambda p: vmap(p, (X, y), mask))(params)
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)])  # noqa
    check["ghost_vs_vmap_max_rel_diff"] = float(np.max(np.abs(flat(a) - flat(b)))
                                                / np.max(np.abs(flat(b))))
  live = [s for s in SIDES if steps[s][0] is not None]
  compile_s, times = {}, {s: [] for s in live}
  for s in live:
    fn, state, _ = steps[s]
    first, _ = timed(lambda: fn(params, state, X, y))
    compile_s[s] = first
  memory = {s: _memory_mb(steps[s][0], params, steps[s][1], X, y) for s in live}
  calls = {}
  for s in live:
    fn, state, _ = steps[s]
    calls[s] = int(np.clip(round(MIN_SAMPLE_S / timed(lambda: fn(params, state, X, y))[0]), 1,
                           50))

  def sample(fn, state, k):
    return [fn(params, state, X, y) for _ in range(k)]

  for _ in range(repeats):                                            # interleaved rounds
    for s in live:
      fn, state, _ = steps[s]
      times[s].append(timed(lambda: sample(fn, state, calls[s]))[0] / calls[s])
  median = {s: float(np.median(times[s])) for s in live}
  for s in live:
    compile_s[s] = max(compile_s[s] - median[s], 0.0)
  ratios = {}
  for s in live:
    if s != "ghost":
      r = np.asarray(times["ghost"]) / np.asarray(times[s])
      ratios[s] = {"median": float(np.median(r)), "min": float(np.min(r)),
                   "paired": r.tolist()}
  vmap_ratios = {}
  for s in live:
    if s != "vmap":
      r = np.asarray(times["vmap"]) / np.asarray(times[s])
      vmap_ratios[s] = {"median": float(np.median(r)), "min": float(np.min(r))}
  r = np.asarray(times["ghost_no_noise"]) / np.asarray(times["nonprivate"])
  check["ghost_no_noise_vs_nonprivate"] = {"median": float(np.median(r)),
                                           "min": float(np.min(r))}
  return {"num_params": int(num_params), "batch": batch, "memory_mb": memory,
          "calls_per_sample": calls,
          "per_example_gradients_gb": per_example_gb, "microbatch": micro or None,
          "median_s": median, "compile_s": compile_s, "times_s": times,
          "ghost_ratio": ratios, "vmap_ratio": vmap_ratios,
          "notes": {s: steps[s][2] for s in SIDES if steps[s][2]}, **check}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true",
                      help="the 1M MLP, the CNN and the transformer, 5 repeats")
  parser.add_argument("--models", nargs="+", default=None,
                      help="cnn, transformer, or MLP layer widths in-h1-...-out (default: "
                      + " ".join(DEFAULT_MODELS) + ")")
  parser.add_argument("--seq", type=int, default=64, help="the transformer's sequence length")
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=None,
                      help="interleaved rounds (default 7, 5 with --quick)")
  parser.add_argument("--microbatch", type=int, default=32,
                      help="rows per micro-batch of the per-example sides when they need it")
  parser.add_argument("--max-per-example-gb", type=float, default=2.0,
                      help="per-example gradients larger than this run in micro-batches")
  parser.add_argument("--subspace-rank", type=int, default=16,
                      help="rank of the ghost_subspace side's basis on an MLP's first kernel")
  parser.add_argument("--json", type=str, default=None)
  args = parser.parse_args(argv)
  models = args.models or (QUICK_MODELS if args.quick else DEFAULT_MODELS)
  repeats = args.repeats or (5 if args.quick else 7)
  results = {}
  for spec in models:
    key, bench = build(spec, args.seq)
    res = run_model(bench, args.batch, repeats, args.max_per_example_gb, args.microbatch,
                    args.subspace_rank)
    results[key or model_key(res["num_params"])] = res
  jp = lambda r: r["ghost_ratio"]["jax_privacy"]["median"] if "jax_privacy" in r["ghost_ratio"] \
      else r["notes"]["jax_privacy"]                                              # noqa: E731
  summary = {
      "ratio_vs_nonprivate": {k: r["ghost_ratio"]["nonprivate"]["median"]
                              for k, r in results.items()},
      "ratio_vs_optax_dpsgd": {k: r["ghost_ratio"]["optax_dpsgd"]["median"]
                               for k, r in results.items()},
      "ratio_vs_jax_privacy": {k: jp(r) for k, r in results.items()},
      "ratio": "ghost step time / other side's step time, median over interleaved rounds",
      "median_s": {k: r["median_s"] for k, r in results.items()},
      "ghost_without_noise_ratio_vs_nonprivate": {
          k: r["ghost_no_noise_vs_nonprivate"]["median"] for k, r in results.items()},
      "vmap_ratio_vs_nonprivate": {k: r["vmap_ratio"]["nonprivate"]["median"]
                                   for k, r in results.items()},
      "vmap_ratio_vs_optax_dpsgd": {k: r["vmap_ratio"]["optax_dpsgd"]["median"]
                                    for k, r in results.items()},
      "full_release_vs_subspace": {k: r["ghost_ratio"]["ghost_subspace"]["median"]
                                   for k, r in results.items()
                                   if "ghost_subspace" in r["ghost_ratio"]},
      "per_layer_clipping_vs_global": {k: r["vmap_ratio"]["vmap_per_layer"]["median"]
                                       for k, r in results.items()},
      "noise_draws": {k: r["noise_draws"] for k, r in results.items()},
      "memory_mb": {k: r["memory_mb"] for k, r in results.items()},
      "num_params": {k: r["num_params"] for k, r in results.items()},
  }
  config = {"batch": args.batch, "repeats": repeats, "seq": args.seq, "clip_norm": CLIP,
            "noise_multiplier": SIGMA, "learning_rate": LR, "backend": jax.default_backend(),
            "machine": platform.processor() or platform.machine(), "jax": jax.__version__,
            "optax": optax.__version__}
  print(f"DP-SGD step, batch {args.batch}, {repeats} interleaved rounds, "
        f"backend={jax.default_backend()}")
  print(f"{'model':<12}{'side':<16}{'median s':>10}{'compile s':>11}{'MB':>8}{'ghost/side':>12}"
        f"{'min':>8}   notes")
  for k, r in results.items():
    for s in SIDES:
      if s not in r["median_s"]:
        print(f"{k:<12}{s:<16}{'-':>10}{'-':>11}{'-':>8}{'-':>12}{'-':>8}   "
              f"{r['notes'].get(s, '')}")
        continue
      ratio = r["ghost_ratio"].get(s)
      rtxt = f"{ratio['median']:>11.3f}x{ratio['min']:>7.3f}x" if ratio else f"{'':>20}"
      mb = r["memory_mb"][s]
      mtxt = f"{mb:>8.0f}" if mb is not None else f"{'-':>8}"
      print(f"{k:<12}{s:<16}{r['median_s'][s]:>10.4f}{r['compile_s'][s]:>11.2f}{mtxt}{rtxt}   "
            f"{r['notes'].get(s, '')}")
    if "ghost_vs_vmap_max_rel_diff" in r:
      print(f"{k:<12}ghost vs vmap clipped sum: max rel diff "
            f"{r['ghost_vs_vmap_max_rel_diff']:.2e}")
  out = {"summary": summary, "models": results, "config": config}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
  return out


if __name__ == "__main__":
  main()
