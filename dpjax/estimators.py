"""scikit-learn-style estimators over dpjax's pure functions: ``PrivatePCA`` and
``PrivateLogisticRegression`` (``fit`` / ``transform`` / ``predict`` / ``score``).

Thin wrappers: every number they release comes from a function of :mod:`dpjax.classic` or
:mod:`dpjax.subspace`, whose docstring states the guarantee; the fitted estimator keeps that
function's result as ``result_`` (ε, δ, the neighboring relation, public info). Needs the
``sklearn`` extra (``pip install "dpjax[sklearn]"``).

Public bounds. The guarantees hold for rows of norm ≤ ``data_norm``, a bound the analyst must
choose WITHOUT looking at the data (rows above it are clipped to it: a fixed map of each row,
DP-safe). ``fit`` refuses to run without it (``ValueError`` saying how to choose one). Reading
the bound off the data (its largest row norm) is not differentially private; it happens only by
the explicit opt-in ``data_norm="from_data"``, and then with a :class:`PrivacyLeakWarning`.
``PrivateLogisticRegression``'s label set ``classes`` left at None is read off the labels with
the same warning, as diffprivlib does.

Randomness. ``random_state`` is an int seed, a ``jax.random`` key, a ``numpy.random.RandomState``
(one int is drawn from it) or None (fresh randomness from the operating system, so two fits
differ, as a private mechanism's runs should). ``fit`` never changes the caller's arrays.
"""

from __future__ import annotations

import secrets
import warnings

import jax
import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, TransformerMixin
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

from dpjax import subspace
from dpjax.classic import erm, pca

__all__ = ["PrivacyLeakWarning", "PrivateLogisticRegression", "PrivatePCA"]

PCA_METHODS = ("sulq", "ppca", "dpase", "analyze_gauss")


class PrivacyLeakWarning(UserWarning):
  """A bound that the privacy guarantee needs to be public was computed from the data."""


def _key(random_state) -> jax.Array:
  """A ``jax.random`` key from ``random_state`` (module docstring)."""
  if random_state is None:
    return jax.random.key(secrets.randbits(63))
  if isinstance(random_state, np.random.RandomState):
    return jax.random.key(int(random_state.randint(np.iinfo(np.int32).max)))
  if isinstance(random_state, (int, np.integer)) and not isinstance(random_state, bool):
    return jax.random.key(int(random_state))
  if isinstance(random_state, jax.Array):
    return random_state
  raise TypeError(f"random_state must be None, an int, a jax.random key or a "
                  f"numpy.random.RandomState, got {type(random_state).__name__}.")


FROM_DATA = "from_data"


def _data_norm(X: np.ndarray, data_norm, owner: str):
  """The public row-norm bound ``data_norm``; the data's largest norm (with a
  :class:`PrivacyLeakWarning`) only for the explicit ``"from_data"``.

  Raises:
    ValueError: ``data_norm`` None (not given), or not a positive finite number.
  """
  if data_norm is None:
    raise ValueError(
        f"{owner} needs data_norm: a public bound on every row's ℓ2 norm, chosen WITHOUT looking "
        "at the data (e.g. from the measurement's range: √d for features in [−1, 1]; rows above "
        "it are clipped). data_norm='from_data' reads it off the data instead, which is NOT "
        "differentially private (for exploration only; it warns).")
  if isinstance(data_norm, str):
    if data_norm != FROM_DATA:
      raise ValueError(f"data_norm must be a positive number or {FROM_DATA!r}, got "
                       f"{data_norm!r}.")
  else:
    value = float(data_norm)
    if not (np.isfinite(value) and value > 0):
      raise ValueError(f"data_norm must be a positive finite number, got {data_norm!r}.")
    return value
  warnings.warn("data_norm='from_data': the largest row norm of the data is used as the bound, "
                "which is not differentially private. Pass a public data_norm (chosen without "
                "looking at the data) for the stated guarantee.", PrivacyLeakWarning,
                stacklevel=3)
  norm = float(np.max(np.linalg.norm(X, axis=1)))
  return norm if norm > 0 else 1.0


def _fitted_rows(estimator, X) -> np.ndarray:
  """``X`` checked against a fitted estimator (its feature count), as a float array."""
  check_is_fitted(estimator)
  return validate_data(estimator, X, dtype=[np.float64, np.float32], reset=False)


class PrivatePCA(TransformerMixin, BaseEstimator):
  """Differentially private PCA with scikit-learn's ``PCA`` interface (uncentred).

  >>> import numpy as np
  >>> from dpjax.estimators import PrivatePCA
  >>> X = np.random.default_rng(0).normal(size=(2000, 6)) * [3, 2, 1, .1, .1, .1] / 10
  >>> pca = PrivatePCA(n_components=2, epsilon=1.0, delta=1e-6, data_norm=1.0,
  ...                  random_state=0).fit(X)
  >>> pca.transform(X).shape, pca.result_.neighboring.name
  ((2000, 2), 'REPLACE_ONE')

  ``method``:

  * ``"analyze_gauss"`` (default) — Analyze Gauss, (ε, δ)-DP
    (:func:`dpjax.subspace.analyze_gauss`): the strongest of these at moderate n (captured
    energy at k = 2 on scikit-learn's breast_cancer, ε = 10: 0.61 against MOD-SuLQ's 0.04 and
    0.63 without privacy; ``tests/test_estimators.py``);
  * ``"sulq"`` — MOD-SuLQ, (ε, δ)-DP (:func:`dpjax.classic.mod_sulq`);
  * ``"ppca"`` — PPCA, the exponential mechanism, ε-DP (:func:`dpjax.classic.ppca`; for
    ``n_components > 1`` a Gibbs sampler whose guarantee holds in the mixing limit of
    ``num_sweeps``);
  * ``"dpase"`` — Singhal & Steinke's DPASE, (ε, δ)-DP, no norm bound needed, may answer ⊥
    (:func:`dpjax.subspace.dpase`; ``gamma`` is its public approximation parameter).

  All are stated under replace-one neighbours. The subspace is that of the second moment
  ``XᵀX/n`` (not centred: centring needs a private mean, which would cost budget), so
  ``mean_`` is zero; centre the data with a public or separately private mean first if needed.

  ⊥: DPASE may decline to answer. Then ``ok_`` is False, ``components_`` is zeros (so
  ``transform`` returns zeros) and ``fit`` warns; the other methods always answer.

  Attributes:
    components_: ``(n_components, d)`` orthonormal rows (as scikit-learn's PCA).
    mean_: ``(d,)`` zeros.
    n_components_, n_features_in_: ints.
    ok_: bool, False for ⊥.
    result_: the :class:`dpjax.results.SubspaceResult` (ε, δ, neighboring, info).
    data_norm_: the row-norm bound used (public unless ``data_norm="from_data"``).

  Raises (at ``fit``):
    ValueError: no ``data_norm`` (except for ``"dpase"``, which needs none); an unknown method.
  """

  def __init__(self, n_components: int = 2, *, epsilon: float = 1.0, delta: float = 1e-6,
               method: str = "analyze_gauss", data_norm: float | str | None = None,
               random_state=None,
               num_sweeps: int = pca.DEFAULT_NUM_SWEEPS, gamma: float = 0.1):
    self.n_components = n_components
    self.epsilon = epsilon
    self.delta = delta
    self.method = method
    self.data_norm = data_norm
    self.random_state = random_state
    self.num_sweeps = num_sweeps
    self.gamma = gamma

  def fit(self, X, y=None):
    """Fits on ``X (n, d)`` (rows are individuals); ``y`` is ignored. Returns self."""
    if self.method not in PCA_METHODS:
      raise ValueError(f"method must be one of {PCA_METHODS}, got {self.method!r}.")
    X = validate_data(self, X, dtype=[np.float64, np.float32], copy=True)
    key, k = _key(self.random_state), self.n_components
    if self.method == "dpase":
      res = subspace.dpase(key, X, epsilon=self.epsilon, delta=self.delta, k=k,
                           gamma=self.gamma)
      self.data_norm_ = None
    else:
      norm = self.data_norm_ = _data_norm(X, self.data_norm, "PrivatePCA")
      if self.method == "sulq":
        res = pca.mod_sulq(key, X, epsilon=self.epsilon, delta=self.delta, k=k, data_norm=norm,
                           clip=True)
      elif self.method == "ppca":
        res = pca.ppca(key, X, epsilon=self.epsilon, k=k, num_sweeps=self.num_sweeps,
                       data_norm=norm, clip=True)
      else:
        res = subspace.analyze_gauss(key, X, epsilon=self.epsilon, delta=self.delta, k=k,
                                     clip_norm=norm)
    self.result_ = res
    self.ok_ = bool(res.ok)
    if not self.ok_:
      warnings.warn(f"{self.method} answered ⊥ (its private test failed): components_ are "
                    "zeros. This is a DP outcome, not an error.", UserWarning, stacklevel=2)
    self.components_ = np.asarray(res.basis, np.float64).T
    self.n_components_ = k
    self.mean_ = np.zeros(X.shape[1])
    return self

  def transform(self, X):
    """``X (m, d)`` → ``(m, n_components)`` coordinates in the private subspace."""
    return (_fitted_rows(self, X) - self.mean_) @ self.components_.T

  def inverse_transform(self, Z):
    """``Z (m, n_components)`` → ``(m, d)``: the points of the subspace."""
    check_is_fitted(self)
    return np.asarray(Z) @ self.components_ + self.mean_


class PrivateLogisticRegression(ClassifierMixin, BaseEstimator):
  """ε-DP L2-regularised logistic regression ([CMS11]) with scikit-learn's classifier interface.

  ``method="objective"`` (default, :func:`dpjax.classic.objective_perturbation`) or
  ``"output"`` (:func:`dpjax.classic.output_perturbation`); more than two classes run
  one-vs-rest with ε split equally across the classes (:func:`dpjax.classic.one_vs_rest`).
  Guarantee: (ε, 0)-DP under replace-one neighbours for rows of norm ≤ ``data_norm`` and the
  label set ``classes``, both public, and up to the approximate-minimiser caveat of
  :mod:`dpjax.classic.erm`. No intercept (``intercept_`` is zero): append a public constant
  column, with ``data_norm`` covering it, to fit one. ``coef_`` is released on a public
  power-of-two grid by default (``release="grid"``: float-safe for output perturbation, a
  post-processing rounding for objective perturbation; see :mod:`dpjax.classic.erm`).

  Args:
    epsilon: ε > 0.
    method: ``"objective"`` or ``"output"``.
    regularization: Λ > 0; None picks :func:`dpjax.classic.default_regularization`, a rule of
      the public (n, d, ε).
    data_norm: public row-norm bound (required; ``"from_data"``: read off the data, not
      private, with a PrivacyLeakWarning).
    classes: the public label set (None: read off the data, with a PrivacyLeakWarning).
    random_state: see the module docstring.
    tol, max_iter: the optimiser's gradient-norm target and iteration cap.
    release: ``"grid"`` (default) or ``"raw"`` (the float64 coefficients themselves, ε-DP in
      real arithmetic only), passed to :mod:`dpjax.classic.erm` (validated there: a
      ``ValueError`` naming ``release`` otherwise).

  Attributes:
    coef_: ``(1, d)`` for two classes (positive class ``classes_[1]``), else ``(K, d)``.
    intercept_: zeros of ``(1,)`` or ``(K,)``.
    classes_: the label set.
    result_: the :class:`dpjax.results.ERMResult` (ε, neighboring, public info, and the
      non-private optimiser diagnostic ``nonprivate_gradient_norm``).
  """

  def __init__(self, *, epsilon: float = 1.0, method: str = "objective",
               regularization: float | None = None, data_norm: float | str | None = None,
               classes=None, random_state=None, tol: float = erm.DEFAULT_TOL,
               max_iter: int = erm.DEFAULT_MAX_ITERATIONS, release: str = "grid"):
    self.epsilon = epsilon
    self.method = method
    self.regularization = regularization
    self.data_norm = data_norm
    self.classes = classes
    self.random_state = random_state
    self.tol = tol
    self.max_iter = max_iter
    self.release = release

  def fit(self, X, y):
    """Fits on ``X (n, d)`` and labels ``y (n,)``. Returns self."""
    if self.method not in erm.METHODS:
      raise ValueError(f"method must be one of {erm.METHODS}, got {self.method!r}.")
    X, y = validate_data(self, X, y, dtype=[np.float64, np.float32], copy=True)
    check_classification_targets(y)
    if self.classes is None:
      warnings.warn("classes was not given: the label set is read off the data, which is not "
                    "differentially private. Pass the public label set as classes.",
                    PrivacyLeakWarning, stacklevel=2)
      classes = np.unique(y)
    else:
      classes = np.unique(np.asarray(self.classes))
      unknown = ~np.isin(y, classes)
      if np.any(unknown):
        raise ValueError(f"{int(unknown.sum())} labels are not in classes={list(classes)}.")
    if classes.size < 2:
      raise ValueError(f"classes must hold at least two labels, got {classes.size} class: "
                       f"{classes.tolist()}.")
    self.classes_ = classes
    norm = self.data_norm_ = _data_norm(X, self.data_norm, "PrivateLogisticRegression")
    key = _key(self.random_state)
    common = dict(epsilon=self.epsilon, regularization=self.regularization, data_norm=norm,
                  clip=True, tol=self.tol, max_iterations=self.max_iter, release=self.release)
    index = np.searchsorted(classes, y)
    if classes.size == 2:
      fit = (erm.objective_perturbation if self.method == "objective"
             else erm.output_perturbation)
      res = fit(key, X, np.where(index == 1, 1.0, -1.0), **common)
      coef = np.asarray(res.coefficients, np.float64)[None, :]
    else:
      res = erm.one_vs_rest(key, X, index, classes=list(range(classes.size)),
                            method=self.method, **common)
      coef = np.asarray(res.coefficients, np.float64)
    self.result_ = res
    self.coef_ = coef
    self.intercept_ = np.zeros(coef.shape[0])
    return self

  def decision_function(self, X):
    """``(m,)`` scores for two classes (positive: ``classes_[1]``), else ``(m, K)``."""
    scores = _fitted_rows(self, X) @ self.coef_.T + self.intercept_
    return scores[:, 0] if scores.shape[1] == 1 else scores

  def predict(self, X):
    """The predicted labels ``(m,)``."""
    scores = self.decision_function(X)
    index = (scores > 0).astype(int) if scores.ndim == 1 else np.argmax(scores, axis=1)
    return self.classes_[index]

  def predict_proba(self, X):
    """``(m, K)`` class probabilities: the logistic model's for two classes; for one-vs-rest,
    each class's logistic probability, normalised over the classes."""
    scores = self.decision_function(X)
    if scores.ndim == 1:
      p = 1.0 / (1.0 + np.exp(-scores))
      return np.stack([1.0 - p, p], axis=1)
    p = 1.0 / (1.0 + np.exp(-scores))
    return p / np.sum(p, axis=1, keepdims=True)
