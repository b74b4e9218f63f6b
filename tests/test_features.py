"""dpjax.features.scattering_features: the public scattering map (kymatio's transform, per-example
group normalisation): shapes, per-row independence, normalisation, clear errors."""

import numpy as np
import pytest

pytest.importorskip("kymatio")

from dpjax import data, features  # noqa: E402


@pytest.fixture(scope="module")
def images():
  return data.load_mnist(flatten=False).X_test[:12]


def test_shapes_and_layouts_agree(images):
  out = features.scattering_features(images)
  assert out.shape == (12, 3969) and out.dtype == np.float32
  assert features.scattering_shape(28, 28) == (81, 7, 7)
  np.testing.assert_array_equal(features.scattering_features(images[..., 0]), out)
  np.testing.assert_array_equal(features.scattering_features(images.reshape(12, 784)), out)
  assert np.all(np.isfinite(out))


def test_each_rows_groups_are_normalised(images):
  """GroupNorm without affine parameters (as torch's, eps = 1e-5): each row's 27 groups of 3
  channels to mean 0 and variance var/(var + eps) of the raw scattering's group."""
  out = features.scattering_features(images).reshape(12, 27, 3 * 49)
  raw = features.scattering_features(images, groups=None).reshape(12, 27, 3 * 49)
  raw_var = raw.astype(np.float64).var(axis=-1)
  np.testing.assert_allclose(out.mean(axis=-1), 0.0, atol=1e-4)
  np.testing.assert_allclose(out.var(axis=-1), raw_var / (raw_var + 1e-5), rtol=1e-3, atol=1e-5)
  centred = (raw - raw.mean(axis=-1, keepdims=True)) / np.sqrt(raw_var + 1e-5)[..., None]
  np.testing.assert_allclose(out, centred, rtol=1e-3, atol=1e-4)


def test_a_rows_features_are_its_own():
  """A public per-row map: a row's features do not depend on the other rows, their number or
  the batch size (the privacy argument of the module docstring)."""
  X = data.load_mnist(flatten=False).X_test[:10]
  alone = features.scattering_features(X[:1])
  others = np.concatenate([X[:1], np.random.default_rng(0).random((4, 28, 28, 1), np.float32)])
  np.testing.assert_allclose(features.scattering_features(others, batch_size=3)[:1], alone,
                             atol=1e-5)
  np.testing.assert_allclose(features.scattering_features(X, batch_size=4)[:1], alone, atol=1e-5)


@pytest.mark.parametrize("bad, kwargs, match", [
    (np.zeros((3, 28, 28, 3)), {}, "images must be"),
    (np.zeros((3, 10)), {}, "square"),
    (np.zeros((3, 30, 30)), {}, "divisible"),
    (np.full((3, 28, 28), np.nan), {}, "NaN"),
    (np.zeros((3, 28, 28)), {"groups": 4}, "groups"),
    (np.zeros((0, 28, 28)), {}, "images must be"),
])
def test_bad_input_raises_clear_errors(bad, kwargs, match):
  with pytest.raises(ValueError, match=match):
    features.scattering_features(bad, **kwargs)


def test_the_cache_returns_the_same_array_without_recomputing(images, tmp_path, monkeypatch):
  first = features.scattering_features(images, cache_dir=tmp_path)
  assert len(list(tmp_path.glob("scattering-*.npy"))) == 1
  monkeypatch.setattr(features, "_scattering", lambda *a: pytest.fail("recomputed"))
  again = features.scattering_features(images, cache_dir=tmp_path)
  np.testing.assert_array_equal(again, first)
  assert again.dtype == np.float32
  # Other images or settings are other entries, not a stale hit.
  monkeypatch.undo()
  other = features.scattering_features(images[::-1], cache_dir=tmp_path)
  np.testing.assert_allclose(other, first[::-1], atol=1e-5)
  features.scattering_features(images, groups=None, cache_dir=tmp_path)
  assert len(list(tmp_path.glob("scattering-*.npy"))) == 3
