"""Every release draws its randomness from its own key stream (issue 34 §2).

Under JAX's partitionable threefry (the default since jax 0.5, and here), ``fold_in(key, i)``
equals ``split(key, n)[i]``: a stream folded in from a key that is also split shares its data
with one of the split's children. The proofs of dpjax's composed learners assume independent
noise for independent releases, so every stream must be derived once, disjointly.

:class:`KeyRecorder` runs a learner eagerly (``jax.disable_jit()``, so that every key is a
concrete value) and records every key derivation (``split``, ``fold_in``) and every consumption
(random bits drawn from a key; a NumPy generator seeded from a key's data on the host), by the
keys' data. It then checks:

* no key's data is consumed twice, or both consumed and derived from (a release's key is
  the release's alone: no two releases, or samplers, share a key or a key's descendant). This is
  the decisive check: a key derived twice (``fold_in(k, 1)`` beside ``split(k, 3)``, or
  ``split(k, 2)`` beside ``split(k, 3)``) is harmless while one party consumes it, and caught
  here as soon as two do. Recomputing the same derivation for the same purpose (as
  ``dpjax.experiments.train_route`` does for a run's subspace stream, on the host and in the
  program) is fine;
* no parent is both split and folded into (the pattern that collides by construction).

A negative control shows the recorder catches the pattern the issue found.
"""

import collections
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

try:                                   # jax >= 0.10 (the random package)
  from jax._src.random import prng as _prng
except ImportError:                    # pragma: no cover - jax < 0.10
  from jax._src import prng as _prng

import dpjax._host
from dpjax import classic, coinpress, demo, experiments, sgd, subspace, synthetic
from dpjax.classic import erm


def _concrete(keys):
  """The value of ``keys``: itself, a ``vmap`` batch's values (batch axis first), or None for an
  abstract trace (``jax.eval_shape``), which draws nothing."""
  while isinstance(keys, jax.core.Tracer):
    if not hasattr(keys, "batch_dim"):
      return None
    dim, keys = keys.batch_dim, keys.val
    if isinstance(dim, int):
      keys = jnp.moveaxis(keys, dim, 0)
  return keys


def _rows(keys) -> list[tuple[int, ...]]:
  """The data of each key in ``keys`` (any shape), as tuples, in row-major order."""
  keys = _concrete(keys)
  if keys is None:
    return []
  if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
    keys = jax.random.key_data(keys)
  data = np.asarray(keys).astype(np.uint32)
  return [tuple(int(w) for w in row) for row in data.reshape(-1, data.shape[-1])]


class KeyRecorder:
  """Records key derivations and consumptions by key data (see the module docstring)."""

  def __init__(self):
    self.splits = collections.Counter()               # parent -> split calls
    self.folds = collections.Counter()                # parent -> fold_in calls
    self.consumed = collections.Counter()             # key -> consumptions
    self.sites = collections.defaultdict(list)        # key -> what consumed it

    self.inside = 0                                   # depth inside a sampler boundary

  def _derive(self, parents, how):
    for p in ([] if self.inside else parents):
      (self.splits if how == "split" else self.folds)[p] += 1

  def _consume(self, keys, site):
    for k in ([] if self.inside else _rows(keys)):
      self.consumed[k] += 1
      self.sites[k].append(site)

  def boundary(self, module, name, key_arg=0):
    """``module.name(..., key, ...)`` (``key`` its ``key_arg``-th positional argument) counts as
    one consumption of ``key`` (what it does inside is not recorded): for code that stages its
    sampling abstractly even when run eagerly (``custom_vmap``), whose keys the recorder cannot
    read, or a jitted training run's keys."""
    original = getattr(module, name)

    def recorded(*args, **kwargs):
      self._consume(args[key_arg], name)
      self.inside += 1
      try:
        return original(*args, **kwargs)
      finally:
        self.inside -= 1

    return module, name, recorded

  @contextlib.contextmanager
  def active(self, boundaries=(), eager: bool = True):
    """Records within; ``eager`` runs everything op by op (``jax.disable_jit``) so every key is
    concrete, else only what runs outside jitted programs is recorded (a program's keys are
    abstract there): with ``boundaries`` around the programs, what each run is handed."""
    split, fold_in, bits = _prng.random_split, _prng.random_fold_in, _prng.random_bits
    host_rng = dpjax._host.host_rng

    def split_rec(keys, shape):
      out = split(keys, shape)
      self._derive(_rows(keys), "split")
      return out

    def fold_rec(keys, msgs):
      out = fold_in(keys, msgs)
      self._derive(_rows(keys), "fold_in")
      return out

    def bits_rec(keys, bit_width, shape):
      self._consume(keys, f"bits{tuple(shape)}")
      return bits(keys, bit_width, shape)

    def host_rec(key):
      self._consume(key, "host_rng")
      return host_rng(key)

    patches = [(_prng, "random_split", split_rec), (_prng, "random_fold_in", fold_rec),
               (_prng, "random_bits", bits_rec), (dpjax._host, "host_rng", host_rec),
               *(self.boundary(*b) for b in boundaries)]
    originals = [getattr(module, name) for module, name, _ in patches]
    try:
      for module, name, fn in patches:
        setattr(module, name, fn)
      with jax.disable_jit() if eager else contextlib.nullcontext():
        yield self
    finally:
      for (module, name, _), original in zip(patches, originals):
        setattr(module, name, original)

  def problems(self) -> list[str]:
    found = []
    for k, n in self.consumed.items():
      if n > 1:
        found.append(f"key {k} consumed {n} times: {self.sites[k]}")
      if self.splits[k] or self.folds[k]:
        found.append(f"key {k} consumed ({self.sites[k]}) and also derived from")
    for p in set(self.splits) & set(self.folds):
      found.append(f"key {p} both split and folded into")
    return found


def _record(fn, boundaries=()) -> KeyRecorder:
  recorder = KeyRecorder()
  with recorder.active(boundaries):
    fn()
  assert recorder.consumed, "nothing was recorded: the recorder missed the samplers"
  return recorder


def test_the_recorder_catches_fold_in_beside_split():
  """Negative control: the pattern issue 34 found (a stream folded in from a key that is also
  split, as private_input_subspace and GEP did) is flagged, and its collision is real."""
  key = jax.random.key(0)
  assert np.array_equal(jax.random.key_data(jax.random.fold_in(key, 1)),
                        jax.random.key_data(jax.random.split(key, 3)[1]))

  def old_private_input_route():
    k_init, k_noise, k_sample = jax.random.split(key, 3)
    jax.random.normal(k_noise, (4,))                       # the SGD noise
    jax.random.normal(jax.random.fold_in(key, 1), (4,))    # the "independent" subspace release
    del k_init, k_sample

  problems = _record(old_private_input_route).problems()
  assert any("both split and folded" in p for p in problems), problems
  assert any("consumed 2 times" in p for p in problems), problems


def test_the_recorder_passes_one_split_into_named_streams():
  """Positive control: one split into purposes, each consumed once."""
  def clean():
    k_a, k_b, k_c = jax.random.split(jax.random.key(0), 3)
    jax.random.normal(k_a, (3,))
    jax.random.uniform(k_b, (2,))
    dpjax._host.host_rng(k_c).normal()

  recorder = _record(clean)
  assert recorder.problems() == []
  assert len(recorder.consumed) == 3


# ------------------------------------------------------------------------- the learners

D, N = 4, 24
LINEAR = functools.partial(demo.init_mlp, sizes=(D, 3))


@functools.lru_cache(maxsize=None)
def _data():
  rng = np.random.default_rng(0)
  X = rng.normal(size=(N, D)).astype(np.float32)
  return X, (X[:, 0] > 0).astype(np.int32)


def _route(name, steps, **settings):
  def run():
    experiments.train_route(name, jnp.stack([jax.random.key(0), jax.random.key(1)]), [0.1, 0.1],
                            _data(), init_fn=LINEAR, loss_fn=demo.example_loss, epsilon=2.0,
                            delta=1e-5, steps=steps, expected_batch_size=8, accountant="rdp",
                            settings=experiments.RouteSettings(**settings))
  return run


def _gep_noise():
  """Two steps of the GEP release (dp_noise built from GEP's grad sum, one clip per part): the
  embedding's and the residual's noise per leaf."""
  params = {"w": jnp.zeros((D, 3)), "b": jnp.zeros(3)}
  bases = {"w": np.eye(D, 2, dtype=np.float32), "b": None}
  grad_fn = sgd.embedding_residual_grad_sum(demo.example_loss, embedding_clip=1.0,
                                            residual_clip=0.5, joint=False)
  tx = sgd.dp_noise(grad_fn, noise_multiplier=1.0, expected_batch_size=8, key=jax.random.key(3),
                    bases=bases)
  sums = {"embedding": {"w": jnp.ones((2, 3)), "b": jnp.ones(3)},
          "residual": {"w": jnp.ones((D, 3)), "b": jnp.zeros(3)}}
  state = tx.init(params)
  for _ in range(2):
    _, state = tx.update(sums, state, params)


def _plan_steps():
  """Two steps of a DP-SGD plan with GEP's release (issue 50 §2): each step's Poisson sample,
  embedding noise and residual noise from one split of the state's key into named purposes
  (``StepKeys``), the key moved on to the split's ``next``; no key from the user."""
  params = LINEAR(jax.random.key(16))
  bases = experiments.first_layer_bases(params, np.eye(D, 2, dtype=np.float32))
  grad_fn = sgd.embedding_residual_grad_sum(demo.example_loss, embedding_clip=1.0,
                                            residual_clip=0.5, joint=False)
  plan = sgd.dp_sgd_plan(grad_fn, num_examples=N, expected_batch_size=8, steps=2,
                         noise_multiplier=1.0, accountant="rdp", key=jax.random.key(17),
                         bases=bases, microbatch_size=8)
  opt = optax.sgd(0.1)
  state = plan.init(params, opt)
  data = tuple(jnp.asarray(a) for a in _data())
  for _ in range(2):
    params, state = plan.update(params, state, data, opt)


def _layer_noise():
  params = [{"w": jnp.zeros((D, 3)), "b": jnp.zeros(3)}]
  tx = sgd.dp_noise(sgd.clipped_grad_sum(demo.example_loss, clip_norm=1.0),
                    noise_multiplier=1.0, expected_batch_size=8, key=jax.random.key(4),
                    bases=experiments.first_layer_bases(params, np.eye(D, 2, dtype=np.float32)))
  state = tx.init(params)
  for _ in range(2):
    _, state = tx.update(jax.tree_util.tree_map(jnp.ones_like, params), state, params)


def _dpase():
  X = np.asarray(jax.random.normal(jax.random.key(5), (200, 2)) @ jnp.eye(2, 4))
  subspace.dpase(jax.random.key(6), X, epsilon=4.0, delta=1e-3, k=1, gamma=0.5)


def _private_gradient_subspace():
  X, y = _data()
  sgd.private_gradient_subspace(jax.random.key(7), demo.example_loss, LINEAR(jax.random.key(8)),
                                (np.tile(X, (8, 1)), np.tile(y, 8)), k=1, epsilon=4.0,
                                delta=1e-3, gamma=0.5)


def _synthetic():
  X = np.asarray(jax.random.uniform(jax.random.key(9), (200, 3)))
  synthetic.low_dimensional_synthetic_data(jax.random.key(10), X, epsilon=4.0)


def _coinpress():
  X = np.asarray(jax.random.normal(jax.random.key(11), (400, 3)))
  coinpress.coinpress_mean(jax.random.key(12), X, epsilon=2.0, delta=1e-5, center=np.zeros(3),
                           radius=10.0)
  coinpress.coinpress_covariance(jax.random.key(13), X, epsilon=2.0, delta=1e-5, kappa=4.0)


# ERM's solver is a custom_vmap, staged abstractly even eagerly: each problem's erm_core call
# consumes its class key (the ℓ2-Laplace draw inside).
BOUNDARIES = {"one-vs-rest ERM (K output perturbations)": [(erm, "erm_core")]}


def _one_vs_rest():
  X, labels = _data()
  X = X / np.linalg.norm(X, axis=1, keepdims=True)
  classic.one_vs_rest(jax.random.key(14), X, labels + (X[:, 1] > 0), classes=[0, 1, 2],
                      epsilon=3.0, max_iterations=5)


def _ppca():
  X, _ = _data()
  classic.ppca(jax.random.key(15), X / np.linalg.norm(X, axis=1, keepdims=True), epsilon=2.0, k=2,
               num_sweeps=2)


# Eager runs compile every operation on its own (5–30 s each here): the default run checks
# dp_noise's GEP and per-layer releases (and the recorder's controls); --run-slow checks the
# routes (the private input subspace's Analyze Gauss release once shared the SGD noise's key) and
# the learners that compose many releases.
_SLOW = pytest.mark.slow(reason="key streams of the routes and the composed learners, run "
                                "eagerly; the default run checks GEP's and the per-layer noise's")
LEARNERS = [
    pytest.param("GEP noise (embedding + residual)", _gep_noise),
    pytest.param("per-layer subspace noise", _layer_noise),
    pytest.param("DP-SGD plan steps (sample, GEP noise)", _plan_steps),
    pytest.param("route private_input_subspace",
                 _route("private_input_subspace", 1, input_rank=2), marks=_SLOW),
    pytest.param("CoinPress mean and covariance (T Gaussian steps each)", _coinpress,
                 marks=_SLOW),
    pytest.param("route gep_trajectory",
                 _route("gep_trajectory", 2, gep_rank=2, gep_refreshes=1, gep_warmup=0.5),
                 marks=_SLOW),
    pytest.param("DPASE (partition, histogram, snapping)", _dpase, marks=_SLOW),
    pytest.param("private gradient subspace (DPASE on gradients)", _private_gradient_subspace,
                 marks=_SLOW),
    pytest.param("He-Vershynin-Zhu synthetic data (covariance, mean, d', PMM/PSMM)", _synthetic,
                 marks=_SLOW),
    pytest.param("one-vs-rest ERM (K output perturbations)", _one_vs_rest, marks=_SLOW),
    pytest.param("PPCA k = 2 (Gibbs sweeps, Haar rotation)", _ppca, marks=_SLOW),
]


@pytest.mark.parametrize("name,learner", LEARNERS, ids=[p.values[0] for p in LEARNERS])
def test_each_release_has_its_own_stream(name, learner):
  recorder = _record(learner, BOUNDARIES.get(name, ()))
  assert recorder.problems() == [], name


# ------------------------------------------------------------------------- the main job


# The main job's trainers as boundaries: every key a method hands to a training run is consumed by
# that run (what the run derives inside is the routes' and train_dp_sgd's own streams, checked
# above).
MAIN_JOB_BOUNDARIES = [(experiments, "train_route", 1), (demo.training, "train_dp_sgd", 0)]


MAIN_JOB = ["--data", "digits", "--steps", "1", "--seeds", "2", "--no-progress", "--models",
            "mlp", "--learning-rates", "0.01", "0.03", "--methods", "dp_sgd", "gep_trajectory",
            "private_input_subspace", "subspace_dp_sgd_private", "public_subspace",
            "public_gradient_subspace"]


def _main_job_problems(tmp_path) -> list[str]:
  recorder = KeyRecorder()
  with recorder.active(MAIN_JOB_BOUNDARIES, eager=False):
    demo.main(MAIN_JOB + ["--json", str(tmp_path / "report.json")])
  assert recorder.consumed, "nothing was recorded"
  return recorder.problems()


@pytest.mark.filterwarnings("ignore")
def test_the_main_job_gives_each_model_method_and_seed_its_own_stream(tmp_path):
  """Issue 49 §3: before, the tuned methods all started from tuning_runs(key(seed)) (dp_sgd,
  gep_trajectory, public_subspace and public_gradient_subspace got identical init, sampling and
  noise keys) and private_input_subspace's run_keys(key(seed)) shared the tuning's rate draw."""
  assert _main_job_problems(tmp_path) == []


@pytest.mark.slow(reason="the negative control of the check above: a second main-job run "
                        "(about 30 s on 2 cores)")
@pytest.mark.filterwarnings("ignore")
def test_the_main_job_check_catches_the_shared_seed_key(tmp_path, monkeypatch):
  """Negative control: every method from ``key(seed)``, as before the fix."""
  monkeypatch.setattr(demo, "run_key", lambda seed, model, method: jax.random.key(seed))
  problems = _main_job_problems(tmp_path)
  assert any("consumed" in p for p in problems), problems
