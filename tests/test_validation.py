"""Every public entry point validates its arguments before tracing, naming the argument.

One table of (entry point, bad argument, expected error) over the whole public API, plus key
hygiene: same key ⇒ bit-identical output, different keys ⇒ different output, for every sampler
and learner.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpjax
from helpers import count_compilations
from dpjax import data, mechanisms as M, sgd
from dpjax.sgd import per_example, sampling

KEY = jax.random.key(0)


def _subspace_data(seed, n, d, k, gamma):
  """``(X float32, basis)``: data.approximate_subspace_data's law (gamma = 0: exact_subspace_data's,
  up to the top eigenvalues) drawn by NumPy, so that importing this module (in every worker)
  compiles no JAX operations."""
  rng = np.random.default_rng(seed)
  basis = np.linalg.qr(rng.standard_normal((d, k)))[0]
  top = np.sort(rng.uniform(1.0, 2.0, k))[::-1]
  top[-1] = 1.0
  w = rng.standard_normal((n, d))
  X = (rng.standard_normal((n, k)) * np.sqrt(top)) @ basis.T + gamma * (w - w @ basis @ basis.T)
  return X.astype(np.float32), basis


X_GOOD, MODEL_BASIS = _subspace_data(0, 2_000, 10, 2, gamma=1e-5)


def _dpase(**kw):
  args = dict(key=KEY, X=X_GOOD, epsilon=1.0, delta=1e-6, k=2, gamma=1e-5) | kw
  key, X = args.pop("key"), args.pop("X")
  return dpjax.dpase(key, X, **args)


def _loss(w, ex):
  return optax.sigmoid_binary_cross_entropy(ex[0] @ w, ex[1])


def _train(**kw):
  X = kw.pop("X", X_GOOD)
  key = kw.pop("key", KEY)
  # RDP: PLD's calibration at this budget takes ~40 s (the accountant is not the subject here).
  args = dict(epsilon=1.0, delta=1e-5, steps=2, expected_batch_size=50, clip_norm=1.0,
              accountant="rdp") | kw
  y = jnp.zeros(X.shape[0])
  return sgd.train_dp_sgd(key, _loss, jnp.zeros(10), (jnp.asarray(X), y),
                          optax.sgd(0.1), **args)


def _with_nan(X):
  X = np.array(X, np.float32)
  X[3, 1] = np.nan
  return X


def _with_inf(X):
  X = np.array(X, np.float32)
  X[0, 0] = np.inf
  return X


CASES = [
    # DPASE
    ("dpase NaN", lambda: _dpase(X=_with_nan(X_GOOD)), ValueError, "NaN"),
    ("dpase inf", lambda: _dpase(X=_with_inf(X_GOOD)), ValueError, "infinite"),
    ("dpase rank", lambda: _dpase(X=X_GOOD[None]), ValueError, "dimensions"),
    ("dpase dtype", lambda: _dpase(X=X_GOOD > 0), TypeError, "dtype"),
    ("dpase eps", lambda: _dpase(epsilon=0.0), ValueError, "epsilon"),
    ("dpase eps type", lambda: _dpase(epsilon="1"), TypeError, "epsilon"),
    ("dpase delta", lambda: _dpase(delta=1.0), ValueError, "delta"),
    ("dpase k low", lambda: _dpase(k=0), ValueError, "k"),
    ("dpase k high", lambda: _dpase(k=11), ValueError, "k"),
    ("dpase k type", lambda: _dpase(k=2.5), TypeError, "k"),
    ("dpase n small", lambda: _dpase(X=X_GOOD[:50]), ValueError, "n is too small"),
    ("dpase key", lambda: _dpase(key=np.zeros(3, np.uint32)), TypeError, "key"),
    # training
    ("train NaN", lambda: _train(X=_with_nan(X_GOOD)), ValueError, "NaN"),
    ("train eps", lambda: _train(epsilon=-1.0), ValueError, "epsilon"),
    ("train delta", lambda: _train(delta=0.0), ValueError, "delta"),
    ("train steps", lambda: _train(steps=0), ValueError, "steps"),
    ("train k", lambda: _train(subspace="public", k=11, public_data=(jnp.zeros((5, 10)),
                                                                     jnp.zeros(5))),
     ValueError, "k"),
    ("train key", lambda: _train(key=1), TypeError, "key"),
    # subspace sources
    ("public k", lambda: sgd.public_gradient_subspace(_loss, jnp.zeros(10),
                                                      (jnp.zeros((3, 10)), jnp.zeros(3)), k=5),
     ValueError, "k"),
    # mechanisms
    ("laplace int", lambda: M.laplace_mechanism(KEY, np.array([1]), sensitivity=1.0,
                                                epsilon=1.0), TypeError, "float"),
    ("gaussian eps", lambda: M.gaussian_mechanism(KEY, jnp.ones(2), sensitivity=1.0,
                                                  epsilon=0.0, delta=1e-5), ValueError, "epsilon"),
    ("gaussian delta", lambda: M.gaussian_mechanism(KEY, jnp.ones(2), sensitivity=1.0,
                                                    epsilon=1.0, delta=-1.0), ValueError, "delta"),
    ("histogram key", lambda: M.stable_histogram(0, jnp.ones((3, 1), jnp.int32), epsilon=1.0,
                                                 delta=1e-5), TypeError, "key"),
    ("gap_max delta", lambda: M.gap_max(KEY, jnp.ones(3), epsilon=1.0, delta=1.0),
     ValueError, "delta"),
    ("exponential eps", lambda: M.exponential_mechanism(KEY, jnp.ones(3), sensitivity=1.0,
                                                        epsilon=-2.0), ValueError, "epsilon"),
    ("snapping key", lambda: M.snapping_mechanism("key", np.ones(2), sensitivity=1.0,
                                                  epsilon=1.0), TypeError, "key"),
    # accounting
    ("calibrate delta", lambda: dpjax.accounting.calibrate_noise_multiplier(1.0, 2.0, 0.1, 10),
     ValueError, "target_delta"),
    ("ledger eps", lambda: dpjax.ledger.PrivacyLedger(0.0, 1e-5), ValueError, "epsilon"),
    # data
    ("data gamma", lambda: data.approximate_subspace_data(KEY, 10, 5, 2, gamma=-0.1),
     ValueError, "gamma"),
]


@pytest.mark.parametrize("name,call,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(name, call, exc, match):
  with pytest.raises(exc, match=match):
    call()


SAMPLERS = {
    "laplace_mechanism": lambda k: M.laplace_mechanism(k, np.zeros(8), sensitivity=1.0,
                                                       epsilon=1.0),
    "laplace_mechanism_raw": lambda k: M.laplace_mechanism(k, jnp.zeros(8), sensitivity=1.0,
                                                           epsilon=1.0, secure=False),
    "gaussian_mechanism": lambda k: M.gaussian_mechanism(k, jnp.zeros(8), sensitivity=1.0,
                                                         epsilon=1.0, delta=1e-5),
    "truncated_laplace": lambda k: M.truncated_laplace(k, (8,), sensitivity=1.0, epsilon=1.0,
                                                       delta=1e-5),
    "discrete_laplace": lambda k: M.discrete_laplace(k, (32,), scale=3.0),
    "stable_histogram": lambda k: M.stable_histogram(
        k, jnp.array([[0]] * 20 + [[1]] * 20, jnp.int32), epsilon=1.0, delta=1e-3).noisy_counts,
    "gap_max": lambda k: jax.vmap(lambda kk: M.gap_max(kk, jnp.array([10.0, 2.0]), epsilon=1.0,
                                                       delta=0.1).ok)(jax.random.split(k, 64)),
    "exponential_mechanism": lambda k: jax.vmap(lambda kk: M.exponential_mechanism(
        kk, jnp.arange(4.0), sensitivity=1.0, epsilon=1.0))(jax.random.split(k, 32)),
    "dpase": lambda k: _dpase(key=k).basis,
    "approximate_subspace_data": lambda k: data.approximate_subspace_data(k, 5, 4, 2,
                                                                          gamma=0.1)[0],
    "poisson_mask": lambda k: sampling.poisson_mask(k, 64, 0.5),
    "train_dp_sgd": lambda k: _train(key=k).params,
}


_SLOW_SAMPLERS = {
    "dpase": "dpase's same-key determinism; test_approximate checks it by default",
    "train_dp_sgd": "train_dp_sgd's same-key determinism; no default test checks it",
    # Issue 33: each is checked by default in its own module (a program of its own here).
    "gap_max": "gap_max's key hygiene; test_gap_max's test_key_hygiene checks it by default",
    "stable_histogram": "the histogram's key hygiene; test_histogram checks it by default",
    "discrete_laplace": "discrete_laplace's key hygiene; test_discrete checks it by default",
    "truncated_laplace": "truncated_laplace's key hygiene; test_truncated_laplace checks it",
    "exponential_mechanism": "the mechanism's key hygiene; test_exponential checks it by default",
    "approximate_subspace_data": "the generator's key hygiene; test_data checks it by default"}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow(reason=_SLOW_SAMPLERS[n])) if n in _SLOW_SAMPLERS
    else n for n in sorted(SAMPLERS)])
def test_same_key_bit_identical_different_key_different(name):
  draw = SAMPLERS[name]
  a, b, c = (np.asarray(draw(jax.random.key(s))) for s in (7, 7, 8))
  assert np.array_equal(a, b), "same key must give bit-identical output"
  assert not np.array_equal(a, c), "different keys must give different output"


def test_noise_transforms_never_reuse_their_key():
  tx = sgd.dp_noise(per_example.ClippedGradSum(lambda *a: None, 1.0), noise_multiplier=1.0,
                    expected_batch_size=1.0, key=KEY)
  state = tx.init(jnp.zeros(4))
  first, state1 = tx.update(jnp.zeros(4), state)
  second, state2 = tx.update(jnp.zeros(4), state1)
  assert not np.array_equal(first, second)
  assert not np.array_equal(jax.random.key_data(state1.key), jax.random.key_data(KEY))
  # The returned key is not the one the noise came from: redrawing from it differs.
  assert not np.array_equal(first, jax.random.normal(state1.key, (4,)))


# ------------------------------------------------------------------------------------------------
# Issue 10 §6: wrong answers and deep crashes on bad input.

X_EXACT, B_EXACT = _subspace_data(4, 20_000, 30, 2, gamma=0.0)


def _distance(basis, truth):
  basis, truth = np.asarray(basis, np.float64), np.asarray(truth, np.float64)
  return float(np.linalg.norm(basis @ basis.T - truth @ truth.T, 2))


@pytest.mark.parametrize("scale", [
    1e25,
    pytest.param(1e-25, marks=pytest.mark.slow(reason="underflow (1e-25); the default run checks "
                                                      "overflow (1e25)"))])
def test_dpase_float32_gram_overflow_or_underflow_gives_the_unscaled_answer(scale):
  """Before: every subset's Gram matrix over/underflowed, all got the same garbage basis, they
  "agreed" and DPASE answered ok=True with a random subspace (distance ≈ 1)."""
  base = _dpase(key=jax.random.key(1))
  res = _dpase(key=jax.random.key(1), X=X_GOOD * np.float32(scale))
  assert bool(base.ok) and bool(res.ok)
  assert res.basis.dtype == jnp.float32
  assert _distance(res.basis, MODEL_BASIS) <= 0.1
  assert abs(_distance(res.basis, MODEL_BASIS) - _distance(base.basis, MODEL_BASIS)) < 1e-3


@pytest.mark.slow(reason="the float64 Gram's over- and underflow; the float32 version above runs "
                         "by default")
@pytest.mark.parametrize("scale", [1e200, 1e-200])
def test_dpase_float64_gram_overflow_or_underflow_gives_the_unscaled_answer(scale):
  with jax.enable_x64(True):
    X = np.asarray(X_GOOD, np.float64)
    base = _dpase(key=jax.random.key(1), X=X)
    res = _dpase(key=jax.random.key(1), X=X * scale)
    assert res.basis.dtype == jnp.float64
  assert bool(base.ok) and bool(res.ok)
  assert _distance(res.basis, MODEL_BASIS) <= 0.1
  assert abs(_distance(res.basis, MODEL_BASIS) - _distance(base.basis, MODEL_BASIS)) < 1e-6


def test_dpase_power_of_two_scale_is_bit_identical():
  a, b = _dpase(key=jax.random.key(2)), _dpase(key=jax.random.key(2), X=X_GOOD * 2.0**-90)
  assert bool(a.ok) == bool(b.ok)
  np.testing.assert_array_equal(np.asarray(a.basis), np.asarray(b.basis))


def _gauss(X, clip_norm, key=5):
  return dpjax.subspace.analyze_gauss(jax.random.key(key), X, epsilon=1.0, delta=1e-6, k=2,
                                      clip_norm=clip_norm)


@pytest.mark.parametrize("scale", [1e25, 1e-25])
def test_analyze_gauss_float32_rows_and_clip_norm_at_extreme_scales(scale):
  """Before: at 1e25 every ‖x‖² overflowed, every row was clipped to zero and the answer was the
  noise's subspace; at 1e-25 C² and XᵀX underflowed to 0 (same garbage, ok=True)."""
  base = _gauss(X_EXACT, 3.0)
  res = _gauss(X_EXACT * np.float32(scale), 3.0 * scale)
  assert _distance(base.basis, B_EXACT) < 0.1
  assert _distance(res.basis, B_EXACT) < 0.1 and _distance(res.basis, base.basis) < 1e-3
  assert res.info["unit_sigma"] == base.info["unit_sigma"]


def test_analyze_gauss_rows_far_above_the_clip_norm_keep_their_direction():
  # Every row is clipped (‖x‖ ≈ 1e25 ≫ C = 3): the clipped rows still span B.
  res = _gauss(X_EXACT * np.float32(1e25), 3.0)
  assert _distance(res.basis, B_EXACT) < 0.1


@pytest.mark.parametrize("scale", [1e200, 1e-200])
def test_analyze_gauss_float64_extreme_scales(scale):
  """Before: C² overflowed (OverflowError) or underflowed to 0 (a confusing sensitivity error)."""
  with jax.enable_x64(True):
    X = np.asarray(X_EXACT, np.float64)
    base, res = _gauss(X, 3.0), _gauss(X * scale, 3.0 * scale)
    assert res.basis.dtype == jnp.float64
  assert _distance(res.basis, B_EXACT) < 0.1 and _distance(res.basis, base.basis) < 1e-6


def test_analyze_gauss_power_of_two_scale_is_bit_identical():
  a = _gauss(X_EXACT, 3.0)
  b = _gauss(X_EXACT * np.float32(2.0**80), 3.0 * 2.0**80)
  np.testing.assert_array_equal(np.asarray(a.basis), np.asarray(b.basis))


@pytest.mark.parametrize("dtype,scale", [(np.float32, 1e25), (np.float32, 1e-25),
                                         (np.float64, 1e200), (np.float64, 1e-200)])
def test_pca_subspace_extreme_scales(dtype, scale):
  """Before: NaN bases (overflow) or a wrong basis (underflow) with ok=True."""
  X = X_EXACT[:500].astype(dtype) * scale
  with jax.enable_x64(dtype == np.float64):
    res = dpjax.subspace.pca_subspace(X, k=2)
    assert res.basis.dtype == dtype and bool(jnp.all(jnp.isfinite(res.basis)))
  assert _distance(res.basis, B_EXACT) < 1e-3


def _loss_big(w, x):
  return 1e25 * (x @ w)            # per-example gradient 1e25·x: its Gram overflows float32


def _loss_tiny(w, x):
  return 1e-25 * (x @ w)           # per-example gradient 1e-25·x: its Gram underflows


@pytest.mark.parametrize("loss", [_loss_big, _loss_tiny])
def test_public_gradient_subspace_extreme_gradient_scales(loss):
  res = sgd.public_gradient_subspace(loss, jnp.zeros(30), jnp.asarray(X_EXACT[:50]), k=2)
  assert bool(res.ok) and bool(jnp.all(jnp.isfinite(res.basis)))
  assert _distance(res.basis, B_EXACT) < 1e-3


HALF = [np.float16, jnp.bfloat16]


@pytest.mark.parametrize("dtype", HALF)
def test_check_data_upcasts_16_bit_floats(dtype):
  from dpjax import _validation
  out = _validation.check_data(np.ones((3, 2), dtype))
  assert out.dtype == jnp.float32
  out = _validation.check_data(jnp.ones((3, 2), dtype))
  assert out.dtype == jnp.float32
  with pytest.raises(ValueError, match="NaN"):
    _validation.check_data(np.full((3, 2), np.inf, dtype))


@pytest.mark.filterwarnings("ignore:DPASE")     # dpaseb's small blocks: ⊥ likely, still private
@pytest.mark.slow(reason="the learners on 16-bit input; check_data's upcast is unit-tested above "
                         "by default")
@pytest.mark.parametrize("dtype", HALF)
def test_learners_accept_16_bit_input(dtype):
  """Before: float16/bfloat16 passed validation and crashed in jaxlib's LAPACK bindings
  ("Unsupported dtype float16") in all five."""
  X = X_GOOD.astype(dtype)
  res = _dpase(X=X)
  assert res.basis.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(res.basis)))
  res = dpjax.subspace.dpaseb(KEY, X, epsilon=1.0, delta=1e-6, k=2, alpha=0.1, num_blocks=3,
                              gamma=1e-5)
  assert res.basis.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(res.basis)))
  res = dpjax.subspace.analyze_gauss(KEY, X, epsilon=1.0, delta=1e-6, k=2, clip_norm=1.0)
  assert res.basis.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(res.basis)))
  res = dpjax.subspace.pca_subspace(X, k=2)
  np.testing.assert_array_equal(
      np.asarray(res.basis),
      np.asarray(dpjax.subspace.pca_subspace(np.asarray(X, np.float32), k=2).basis))
  from dpjax.ashtiani_liaw import masking
  out = masking.covariance_mask(KEY, np.eye(3).astype(dtype), eta=0.1)
  assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(out).T)


def test_al_covariance_too_few_rows_fails_fast_and_names_the_numbers(monkeypatch):
  """Before: 442 s (busy machine; 58 s on an idle one) of group-size simulation at d = 30 before
  the error. The cheap bound k·(d + 1) is known without simulating: the error comes before any
  simulation runs and before anything is compiled."""
  from dpjax.ashtiani_liaw import al_covariance, calibration, masking

  def simulated(*args, **kwargs):
    raise AssertionError("a calibration simulation ran before the too-few-rows error")

  for module, name in ((calibration, "_simulated_fraction"),
                       (calibration, "simulated_candidate_accuracy"),
                       (masking, "_simulated_accuracy")):
    monkeypatch.setattr(module, name, simulated)
  X = np.random.default_rng(0).standard_normal((1000, 30))
  dpjax._validation.check_data64(X, "X")          # the input checks' own programs, compiled now
  errors = []

  def run():
    with pytest.raises(ValueError) as err:
      al_covariance(KEY, X, epsilon=1.0, delta=1e-6)
    errors.append(str(err.value))

  assert count_compilations(run, monkeypatch, clear=False) == 0     # beyond the input checks
  message = errors[0]
  for part in ("got n=1000", "d=30", "epsilon=1,", "delta=1e-06", "required_n",
               "at the very least"):
    assert part in message, (part, message)
  bound = int(message.split("needs n >= ")[1].split(" ")[0])
  assert bound > 1000 and bound % 31 == 0                      # k groups of d + 1 rows


def test_dpaseb_too_few_rows_names_the_users_n_and_blocks():
  """Before: the message came from the per-block DPASE and called the block size "n"."""
  X = np.random.default_rng(0).standard_normal((5000, 5))
  with pytest.raises(ValueError, match="n is too small") as err:
    dpjax.subspace.dpaseb(KEY, X, epsilon=1.0, delta=1e-6, k=1, alpha=0.1, gamma=0.1)
  message = str(err.value)
  T = dpjax.subspace.num_blocks_for(0.1)
  t = dpjax.subspace.approximate.num_subsets_for(1.0, 1e-6)
  for part in ("got n=5000", f"T={T}", f"t={t}", f"n >= T·t·(k + 1) = {T * t * 2}"):
    assert part in message, (part, message)


def test_learn_covariance_too_few_rows_names_the_users_n_and_the_split():
  """The user's n, not the AL step's share of it (al_covariance's message would say n=100), and
  (issue 53) the exact total its helper returns, not a lower bound."""
  from dpjax.ashtiani_liaw import learn_covariance, learn_covariance_required_n
  X = np.random.default_rng(0).standard_normal((200, 3))
  with pytest.raises(ValueError) as err:
    learn_covariance(KEY, X, epsilon=20.0, delta=1e-6)
  message = str(err.value)
  need = learn_covariance_required_n(3, 20.0, 1e-6)
  for part in (f"learn_covariance needs n >= {need:,} rows", "got n=200:",
               f"learn_covariance_required_n(3, 20, 1e-06) = {need:,}"):
    assert part in message, (part, message)
  assert need > 200 and "at the very least" not in message
  with pytest.raises(ValueError) as err:
    learn_covariance(KEY, X, epsilon=20.0, delta=1e-6, coarse_fraction=0.5)
  assert "got n=200; the AL step gets 100 of the n=200 rows" in str(err.value), err.value


def test_truncated_laplace_survival_matches_the_sampler():
  tl = M.truncated_laplace_params(1.0, 1.0, 0.02)
  z = np.asarray(M.truncated_laplace(jax.random.key(3), (200_000,), sensitivity=1.0,
                                     epsilon=1.0, delta=0.02))
  for x in (-3.0, -1.0, 0.0, 0.5, 2.0, tl.bound - 1.0):
    p = M.truncated_laplace_survival(x, tl.scale, tl.bound)
    assert abs(np.mean(z > x) - p) < 5 * np.sqrt(p * (1 - p) / z.size) + 1e-4, x
  # The TLap calibration: exactly δ of the mass beyond A − Δ; nothing beyond A.
  assert M.truncated_laplace_survival(tl.bound - 1.0, tl.scale, tl.bound) == (
      pytest.approx(0.02, rel=1e-9))
  assert M.truncated_laplace_survival(tl.bound, tl.scale, tl.bound) == 0.0
  assert M.truncated_laplace_survival(-tl.bound, tl.scale, tl.bound) == 1.0


PPME_X = np.random.default_rng(1).standard_normal((4_000, 3))


@pytest.mark.parametrize("learner", ["ppme_mean", "robust_mean"])
def test_ppme_refuses_when_bottom_is_certain(learner):
  """k ≤ 2/(1 − c0) = 20: even unanimous groups pass with probability ≤ δ1. Before: ⊥ silently."""
  from dpjax.ashtiani_liaw import min_groups_for_test, ppme_mean, robust_mean
  kwargs = dict(epsilon=1.0, delta=1e-6, num_groups=20, radius=2.0)
  if learner == "robust_mean":
    run = lambda: robust_mean(KEY, PPME_X, corruption=0.05, **kwargs)   # noqa: E731
  else:
    run = lambda: ppme_mean(KEY, PPME_X, **kwargs)                      # noqa: E731
  with pytest.raises(ValueError, match="num_groups=20") as err:
    run()
  assert f"min_groups_for_test(epsilon_test=0.25, delta_test=5e-07) = " \
         f"{min_groups_for_test(0.25, 5e-7)}" in str(err.value)


def test_ppme_warns_below_min_groups_for_test_and_not_above():
  import warnings
  from dpjax.ashtiani_liaw import min_groups_for_test, ppme_mean
  recommended = min_groups_for_test(0.25 * 20.0, 5e-7)
  kwargs = dict(epsilon=20.0, delta=1e-6, radius=2.0)
  with pytest.warns(UserWarning, match=f"use num_groups >= {recommended}") as record:
    ppme_mean(KEY, PPME_X, num_groups=30, **kwargs)
  assert "passes with probability at most" in str(record[0].message)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    ppme_mean(KEY, PPME_X, num_groups=recommended, **kwargs)


def test_al_subspace_refuses_when_bottom_is_certain_and_warns_when_likely():
  import warnings
  from dpjax.ashtiani_liaw import al_subspace, al_subspace_parameters
  X = np.random.default_rng(2).standard_normal((400, 3))
  k_min = al_subspace_parameters(400, 3, epsilon=1.0, delta=1e-6).min_groups
  for k in (3, 4):
    with pytest.raises(ValueError, match=f"num_groups={k}.*min_groups = {k_min}"):
      al_subspace(KEY, X, epsilon=1.0, delta=1e-6, num_groups=k)
  with pytest.warns(UserWarning, match=f"num_groups=30 < min_groups = {k_min}.*at most 0.6"):
    al_subspace_parameters(400, 3, epsilon=1.0, delta=1e-6, num_groups=30)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    al_subspace_parameters(400, 3, epsilon=1.0, delta=1e-6)
    al_subspace_parameters(4000, 3, epsilon=1.0, delta=1e-6, num_groups=k_min)


def test_uint8_pixels_are_refused_with_the_conversion_to_write():
  """Issue 53: uint8 pixels were taken as 0–255 values by DP-SGD, DPASE and CoinPress in
  silence; now every learner refuses them and says how to convert."""
  import optax
  import dpjax
  pixels = np.random.default_rng(0).integers(0, 256, (64, 6)).astype(np.uint8)
  with pytest.raises(TypeError, match=r"uint8.*astype\(np.float32\) / 255"):
    dpjax.subspace.dpase(jax.random.key(0), pixels, epsilon=1.0, delta=1e-6, k=1, gamma=0.1)
  with pytest.raises(TypeError, match="uint8"):
    dpjax.coinpress.coinpress_covariance(jax.random.key(0), pixels, epsilon=1.0, delta=1e-6,
                                         kappa=10.0)
  labels = np.zeros(64, np.uint8)                  # 1-D uint8 labels are fine
  grad_fn = dpjax.sgd.clipped_grad_sum(
      lambda w, ex: optax.sigmoid_binary_cross_entropy(ex[0] @ w, ex[1]), clip_norm=1.0)
  plan = dpjax.sgd.dp_sgd_plan(grad_fn, num_examples=64, expected_batch_size=8, steps=2,
                               noise_multiplier=1.0, key=jax.random.key(1))
  with pytest.raises(TypeError, match=r"data\[0\] has dtype uint8"):
    plan.prepare((pixels, labels))
  opt = optax.sgd(0.1)
  with pytest.raises(TypeError, match="uint8"):
    plan.clipped_sum(jnp.zeros(6), (pixels, labels), plan.init(jnp.zeros(6), opt))
  prepared = plan.prepare((pixels.astype(np.float32) / 255, labels))
  assert prepared[0].dtype == jnp.float32
