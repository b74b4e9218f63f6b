"""The main job runs end to end and writes the documented JSON schema."""

import json

import numpy as np
import pytest

from dpjax import demo

METHODS = {"non_private", "dp_sgd", "subspace_dp_sgd_private", "subspace_dp_sgd_public"}


def test_demo_runs_and_writes_json_and_plot(tmp_path):
  out, plot = tmp_path / "r.json", tmp_path / "acc.png"
  demo.main(["--steps", "6", "--eval-every", "3", "--k", "4", "--no-progress",
             "--json", str(out), "--plot", str(plot)])
  report = json.loads(out.read_text())
  assert report["dataset"] == "digits" and report["n_train"] == 1438
  assert {r["method"] for r in report["results"]} == METHODS
  for r in report["results"]:
    assert set(r) == {"method", "epsilon", "delta", "test_accuracy", "subspace_ok", "seed"}
    assert 0.0 <= r["test_accuracy"] <= 1.0
    if r["method"] == "non_private":
      assert r["epsilon"] is None and r["delta"] is None and r["subspace_ok"] is None
    else:
      assert r["epsilon"] <= 2.0 + 1e-9 and r["delta"] <= 1e-5
  assert plot.stat().st_size > 1000


def test_demo_on_user_data(tmp_path):
  rng = np.random.default_rng(0)
  X = rng.random((600, 10)).astype(np.float32)
  y = (X[:, 0] > 0.5).astype(np.int64)
  path = tmp_path / "mine.npz"
  np.savez(path, X=X, y=y)
  report = demo.main(["--data", str(path), "--steps", "3", "--k", "2", "--no-progress",
                      "--epsilon", "4"])
  assert report["n_train"] == 480 and len(report["results"]) == 4


def test_demo_rejects_bad_options():
  with pytest.raises(SystemExit):
    demo.main(["--epsilon", "0"])
  with pytest.raises(SystemExit):
    demo.main(["--delta", "1.5"])
