"""Tests for dpjax.data: the paper's model generators and the bundled real data."""

import hashlib
import io
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import data, metrics


def test_approximate_subspace_data_has_the_stated_covariance():
  X, model = data.approximate_subspace_data(jax.random.key(0), 40_000, 12, 2, gamma=0.2)
  assert X.shape == (40_000, 12) and model.basis.shape == (12, 2)
  cov = np.asarray(X.T @ X, np.float64) / X.shape[0]
  evals = np.sort(np.linalg.eigvalsh(cov))[::-1]
  assert 0.9 < evals[1] < 1.1                       # λ_k normalised to 1
  assert evals[0] <= 2.1
  np.testing.assert_allclose(evals[2:], 0.04, rtol=0.15)   # the tail is γ²
  assert float(metrics.projection_distance(jnp.asarray(np.linalg.eigh(cov)[1][:, -2:],
                                                       jnp.float32), model.basis)) < 0.05


def test_generators_are_deterministic_and_validate():
  # The shape of the test above: its (eagerly compiled) operations are reused.
  a, _ = data.approximate_subspace_data(jax.random.key(1), 40_000, 12, 2, gamma=0.1)
  b, _ = data.approximate_subspace_data(jax.random.key(1), 40_000, 12, 2, gamma=0.1)
  c, _ = data.approximate_subspace_data(jax.random.key(2), 40_000, 12, 2, gamma=0.1)
  assert jnp.array_equal(a, b) and not jnp.array_equal(a, c)
  with pytest.raises(ValueError, match="gamma"):
    data.approximate_subspace_data(jax.random.key(1), 5, 4, 2, gamma=1.5)
  with pytest.raises(ValueError, match="k"):
    data.approximate_subspace_data(jax.random.key(1), 5, 4, 5, gamma=0.1)
  with pytest.raises(TypeError, match="key"):
    data.approximate_subspace_data(0, 5, 4, 2, gamma=0.1)


def test_exact_subspace_data_inliers_lie_in_the_subspace():
  X, B = data.exact_subspace_data(jax.random.key(2), 30, 8, 3, num_outliers=4)
  residual = X - (X @ B) @ B.T
  norms = np.linalg.norm(np.asarray(residual), axis=1)
  assert np.all(norms[:26] < 1e-4) and np.all(norms[26:] > 1e-2)


def test_load_digits_split_and_scaling():
  ds = data.load_digits()
  assert ds.X_train.shape[1] == 64 and ds.num_classes == 10
  assert ds.X_train.shape[0] + ds.X_test.shape[0] == 1797
  assert abs(ds.X_test.shape[0] - 0.2 * 1797) <= 1
  assert ds.X_train.min() >= 0.0 and ds.X_train.max() <= 1.0
  again = data.load_digits()
  assert np.array_equal(ds.y_test, again.y_test)


def test_load_npz_round_trip_and_errors(tmp_path):
  path = tmp_path / "d.npz"
  np.savez(path, X=np.random.default_rng(0).random((50, 3)), y=np.arange(50) % 2)
  ds = data.load_npz(str(path))
  assert ds.X_train.shape[1] == 3 and ds.num_classes == 2
  bad = tmp_path / "bad.npz"
  np.savez(bad, X=np.full((5, 2), np.nan), y=np.zeros(5, int))
  with pytest.raises(ValueError, match="NaN"):
    data.load_npz(str(bad))


def test_load_npz_takes_images_as_rows_and_refuses_raw_pixels(tmp_path):
  images = np.random.default_rng(1).random((20, 28, 28)).astype(np.float32)
  path = tmp_path / "img.npz"
  np.savez(path, X=images, y=np.arange(20) % 10)
  ds = data.load_npz(str(path))
  assert ds.X_train.shape == (16, 784) and ds.X_test.shape == (4, 784)
  rows = {tuple(r) for r in images.reshape(20, -1)}
  assert all(tuple(r) in rows for r in np.concatenate([ds.X_train, ds.X_test]))
  raw = tmp_path / "raw.npz"
  np.savez(raw, X=(images * 255).astype(np.uint8), y=np.arange(20) % 10)
  with pytest.raises(ValueError, match="uint8.*/ 255"):
    data.load_npz(str(raw))
  cube = tmp_path / "cube.npz"
  np.savez(cube, X=np.zeros((4, 2, 2, 2)), y=np.zeros(4, int))
  with pytest.raises(ValueError, match=r"\(n, h, w\)"):
    data.load_npz(str(cube))


# --- Bundled MNIST (dpjax/_data/mnist10k.npz; its provenance in dpjax/_data/convert_mnist.py) ---

MNIST_FILE_SHA256 = "d6e6f18a1c5be9a315daa1f58ce3b52887d29739f32203b7edc265ac0e833ba4"
MNIST_X_SHA256 = "0768d16c5adea568dee18fa5e4e1acb117e9ec2c5d6b1dffe5fc29c1e61c1eca"  # uint8 X
MNIST_Y_SHA256 = "44e605757823cf79c6557e6d2a7f45c693b286e8cd303ea10339b002801b4916"  # uint8 y
MNIST_CLASS_COUNTS = (1001, 1127, 991, 1032, 980, 863, 1014, 1070, 944, 978)
# sha256 of load_mnist()'s float32 X_test: pins the file, the scaling and numpy's seeded split.
MNIST_SEED0_TEST_SHA256 = "7d2b8c690cb367f35bb8746012c356b69e77c1e363c098bdc45f1d640febec0f"


@pytest.fixture(scope="module")
def mnist():
  return data.load_mnist()


def _sha256(b: bytes) -> str:
  return hashlib.sha256(b).hexdigest()


def test_mnist_file_is_the_recorded_one():
  raw = (resources.files("dpjax") / "_data" / "mnist10k.npz").read_bytes()
  assert len(raw) < 1_700_000
  assert _sha256(raw) == MNIST_FILE_SHA256
  with np.load(io.BytesIO(raw), allow_pickle=False) as f:
    assert sorted(f.files) == ["X", "y"]
    X, y = f["X"], f["y"]
  assert X.dtype == np.uint8 and X.shape == (10_000, 28, 28)
  assert y.dtype == np.uint8 and y.shape == (10_000,)
  assert _sha256(X.tobytes()) == MNIST_X_SHA256 and _sha256(y.tobytes()) == MNIST_Y_SHA256


def test_load_mnist_shapes_dtypes_and_the_256_levels(mnist):
  assert mnist.name == "mnist10k" and mnist.num_classes == 10
  assert mnist.X_train.shape == (8_000, 784) and mnist.X_test.shape == (2_000, 784)
  assert mnist.X_train.dtype == mnist.X_test.dtype == np.float32
  assert mnist.y_train.shape == (8_000,) and mnist.y_test.shape == (2_000,)
  assert mnist.y_train.dtype == mnist.y_test.dtype == np.int32
  levels = np.unique(np.concatenate([mnist.X_train.ravel(), mnist.X_test.ravel()]))
  np.testing.assert_array_equal(levels, np.arange(256, dtype=np.float32) / np.float32(255))
  assert levels[0] == 0.0 and levels[-1] == 1.0          # exactly [0, 1], every k/255 present


def test_load_mnist_has_about_1000_of_each_digit(mnist):
  counts = np.bincount(np.concatenate([mnist.y_train, mnist.y_test]), minlength=10)
  assert tuple(counts) == MNIST_CLASS_COUNTS
  assert len(counts) == 10 and np.all((800 <= counts) & (counts <= 1_200))
  assert np.all(np.bincount(mnist.y_test, minlength=10) > 100)   # the shuffle mixes classes


def test_load_mnist_split_is_fixed_and_disjoint(mnist):
  again = data.load_mnist()
  for a, b in zip(mnist[1:5], again[1:5]):
    np.testing.assert_array_equal(a, b)
  train = {r.tobytes() for r in mnist.X_train}
  test = {r.tobytes() for r in mnist.X_test}
  assert len(train) == 8_000 and len(test) == 2_000 and not train & test   # images all distinct
  assert _sha256(mnist.X_test.tobytes()) == MNIST_SEED0_TEST_SHA256
  other = data.load_mnist(test_fraction=0.5, seed=1)
  assert other.X_train.shape == (5_000, 784) and other.X_test.shape == (5_000, 784)
  assert {r.tobytes() for r in other.X_test} != test


def test_load_mnist_images_are_the_flat_rows_reshaped(mnist):
  images = data.load_mnist(flatten=False)
  assert images.X_train.shape == (8_000, 28, 28, 1) and images.X_test.shape == (2_000, 28, 28, 1)
  np.testing.assert_array_equal(images.X_train.reshape(8_000, 784), mnist.X_train)
  np.testing.assert_array_equal(images.X_test.reshape(2_000, 784), mnist.X_test)
  np.testing.assert_array_equal(images.y_test, mnist.y_test)


def test_load_mnist_errors(monkeypatch):
  with pytest.raises(ValueError, match="test_fraction"):
    data.load_mnist(test_fraction=1.0)
  monkeypatch.setattr(data, "_MNIST_FILE", "no_such_file.npz")
  with pytest.raises(FileNotFoundError, match="package data"):
    data.load_mnist()


# --- The full MNIST (dpjax/_data/mnist.npz; its provenance in dpjax/_data/convert_mnist_full.py)

MNIST_FULL_FILE_SHA256 = "1e5094843b301748212efab11f7af81b9512341a9f03f9cb8f2ef5adbee55bb2"
MNIST_FULL_CONTENT_SHA256 = {   # uint8 arrays as the IDX files hold them
    "X_train": "741c988805d008ac6e4c904b69001ba184c24b2c540a4ef403f4c71b676cf757",
    "y_train": "1feba77c54802fa5339a11837ea4b2866434b83314ec45192930f1df69120c13",
    "X_test": "6d87418db22cc8025d05968bec9bd5c3932904b23485740db143a061a2c9d161",
    "y_test": "ddeff807876a9661a1110d45c266c86239a3a1b7d37da0c3716a7a683c852ff5"}
MNIST_TRAIN_COUNTS = (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949)
MNIST_TEST_COUNTS = (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009)


def test_full_mnist_file_is_the_recorded_one():
  raw = (resources.files("dpjax") / "_data" / "mnist.npz").read_bytes()
  assert len(raw) < 11_500_000
  assert _sha256(raw) == MNIST_FULL_FILE_SHA256
  with np.load(io.BytesIO(raw), allow_pickle=False) as f:
    assert sorted(f.files) == sorted(MNIST_FULL_CONTENT_SHA256)
    for name, digest in MNIST_FULL_CONTENT_SHA256.items():
      assert f[name].dtype == np.uint8 and _sha256(f[name].tobytes()) == digest, name


def test_load_mnist_full_is_the_canonical_split():
  """60,000 / 10,000 in MNIST's order, its class counts, every value k/255 in [0, 1]; images
  are the flat rows reshaped; the split cannot be re-drawn."""
  full = data.load_mnist(full=True)
  assert full.name == "mnist" and full.num_classes == 10
  assert full.X_train.shape == (60_000, 784) and full.X_test.shape == (10_000, 784)
  assert full.X_train.dtype == np.float32 and full.y_train.dtype == np.int32
  assert tuple(np.bincount(full.y_train, minlength=10)) == MNIST_TRAIN_COUNTS
  assert tuple(np.bincount(full.y_test, minlength=10)) == MNIST_TEST_COUNTS
  levels = np.unique(full.X_test)
  np.testing.assert_array_equal(levels, np.arange(256, dtype=np.float32) / np.float32(255))
  images = data.load_mnist(full=True, flatten=False)
  assert images.X_test.shape == (10_000, 28, 28, 1)
  np.testing.assert_array_equal(images.X_test.reshape(10_000, 784), full.X_test)
  with pytest.raises(ValueError, match="own 60,000 / 10,000 split"):
    data.load_mnist(full=True, seed=1)
