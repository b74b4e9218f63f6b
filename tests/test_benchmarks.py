"""The speed benchmarks run with every documented option at tiny sizes, and their NumPy baselines
compute the same thing as dpjax. No timing is asserted: timings belong to the benchmarks' output."""

import importlib
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import linalg
from dpjax.ashtiani_liaw import closeness_matrix

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
  if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))     # the scripts import their shared _timing module
  return importlib.import_module(name)


@pytest.mark.slow(reason="dpase_speed's NumPy baseline equals dpjax's top-k (both routes, all "
                         "methods); a benchmark check, not library code")
def test_numpy_top_k_matches_dpjax():
  bench = _load("dpase_speed")
  rng = np.random.default_rng(0)
  for m, d in ((6, 9), (12, 5), (20, 30)):  # Gram route (m < d) and covariance route
    blocks = rng.standard_normal((3, m, d)) * np.linspace(3.0, 0.1, d)
    blocks = blocks.astype(np.float32)
    for method in linalg.TOP_K_METHODS:
      ours = bench.numpy_top_k(blocks, 2, method)
      theirs = linalg.batched_top_k_subspaces(jnp.asarray(blocks), 2, method=method)
      np.testing.assert_allclose(ours, np.asarray(theirs), atol=1e-4)   # same signs (canonical_signs)


@pytest.mark.slow(reason="the DPASE speed benchmark's options (Gram and covariance routes)")
@pytest.mark.parametrize("shape", [("600", "40"), ("1500", "8")])   # m < d, then m ≥ d
def test_dpase_speed_options(tmp_path, shape):
  pytest.importorskip("threadpoolctl")
  n, d = shape
  path = tmp_path / "out.json"
  out = _load("dpase_speed").main(
      ["--quick", "--n", n, "--d", d, "--k", "2", "--epsilon", "2", "--delta", "1e-5",
       "--gamma", "1e-6", "--repeats", "1", "--blas-threads", "1", "--json", str(path)])
  saved = json.loads(path.read_text())
  assert saved["summary"]["speedup_vs_numpy"] == out["summary"]["speedup_vs_numpy"] > 0
  assert saved["config"]["route"] == ("gram" if shape[0] == "600" else "covariance")
  assert set(saved["summary"]["gflops"]) == {"gram", "eigh", "iteration", "matmul"}
  assert set(saved["summary"]["per_method"]) == set(linalg.TOP_K_METHODS)
  for p in saved["summary"]["per_method"].values():
    assert all(e < 0.5 for e in p["dpjax_errors"] + p["numpy_errors"])


def test_closeness_baselines_match_dpjax():
  bench = _load("covariance")
  rng = np.random.default_rng(1)
  for d in (3, 14):                         # both of dpjax's Cholesky paths (d ≤ 12 and d > 12)
    X = rng.standard_normal((9, 4 * d, d))
    Y = np.einsum("kmi,kmj->kij", X, X) / (4 * d)
    Y[4] = np.diag(np.r_[np.ones(d - 1), 0.0])          # singular: close to nothing
    with jax.enable_x64(True):
      ours = np.asarray(closeness_matrix(jnp.asarray(Y), 1.5))
    assert 0 < ours.sum() < ours.size and not ours[4].any()
    np.testing.assert_array_equal(bench.numpy_closeness_loop(Y, 1.5), ours)
    np.testing.assert_array_equal(bench.numpy_closeness_batched(Y, 1.5, chunk_bytes=1), ours)


@pytest.mark.slow(reason="the covariance benchmark's --speed-only options and its NumPy "
                         "predicates on both Cholesky paths")
def test_covariance_speed_options(tmp_path):
  pytest.importorskip("threadpoolctl")
  path = tmp_path / "out.json"
  out = _load("covariance").main(
      ["--speed-only", "--speed-dims", "4,13", "--speed-k", "7", "--repeats", "1",
       "--blas-threads", "1", "--seed", "3", "--json", str(path)])
  saved = json.loads(path.read_text())
  assert set(saved["summary"]["pairwise_speedup_vs_numpy"]) == {"4", "13"}
  for sp in out["pairwise"]:
    assert sp["mismatched_pairs"] == {"loop": 0, "batched": 0} and sp["counts_agree"]
    assert len(sp["results"]) == 4


@pytest.mark.slow(reason="the covariance benchmark's accuracy options: learners at their minimum "
                         "n, the required-n tables, the plot")
def test_covariance_accuracy_options(tmp_path):
  pytest.importorskip("matplotlib")
  path, plot = tmp_path / "out.json", tmp_path / "fig.png"
  _load("covariance").main(
      ["--quick", "--dims", "3", "--trials", "1", "--epsilon", "1000", "--delta", "1e-5",
       "--seed", "2", "--speed-dims", "3", "--speed-k", "4", "--repeats", "1",
       "--json", str(path), "--plot", str(plot)])
  saved = json.loads(path.read_text())
  assert saved["config"]["dims"] == [3] and saved["gaussian"] and plot.stat().st_size > 0
  # Issue 16's before/after table (--quick: d ∈ {3, 5, 10}, ε ∈ {1, 4}): every tightening lowers n.
  summary = saved["summary"]
  for after, before in (("required_n", "required_n_before"),
                        ("learn_covariance_required_n", "learn_covariance_required_n_before"),
                        ("gaussian_required_n", "gaussian_required_n_before")):
    assert set(summary[after]) == {f"{d},{e}" for d in (3, 5, 10) for e in (1, 4)}
    assert all(0 < summary[after][key] < summary[before][key] for key in summary[after])
  # Issue 16's targets at d = 5, ε = 1: ≤ 6·10⁵ rows (from ~1.8·10⁷ with the spec's choices).
  assert summary["required_n"]["5,1"] <= 6e5 < 1.5e7 < summary["required_n_before"]["5,1"]
  # The refined learner: the AL step's rows plus CoinPress's (was twice the AL step's).
  assert summary["learn_covariance_required_n"]["5,1"] < 0.6 * 2 * summary["required_n"]["5,1"]


@pytest.mark.slow(reason="the gradient-subspace crossover study's options (routes' training "
                         "programs compile per data set, n and model)")
def test_gradient_subspace_options(tmp_path):
  """Every option at toy sizes (3 steps, 2 seeds, as many tuning runs as evaluation runs so each
  route compiles once per cell); the JSON has the documented summary and crossover schema and
  the wins rule. It tests that the options work, not the results."""
  pytest.importorskip("matplotlib")
  pytest.importorskip("sklearn")
  rng = np.random.default_rng(0)
  user = tmp_path / "mine.npz"
  np.savez(user, X=rng.random((900, 6)).astype(np.float32), y=rng.integers(0, 3, 900))
  path, plot = tmp_path / "out.json", tmp_path / "fig"
  bench = _load("gradient_subspace")
  out = bench.main(
      ["--seeds", "2", "--tuning-seeds", "1", "--learning-rates", "0.05", "0.1",
       "--epsilons", "1", "2", "--data", "digits", str(user), "--n", "200", "400",
       "--models", "softmax", "--steps", "3", "--batch", "64", "--public-rows", "50",
       "--pca-ranks", "2", "4", "--pca-fractions", "0.2", "--routes", "non_private", "dp_sgd",
       "private_input_subspace", "public_gradient_subspace", "public_subspace",
       "--oracle-refresh", "2", "--json", str(path), "--plot", str(plot),
       "--write-crossover", str(tmp_path / "crossover.json")])
  saved = json.loads(path.read_text())
  assert saved["summary"] == json.loads(json.dumps(out["summary"]))
  rows_expected = {"non_private", "dp_sgd", "private_input_subspace",
                   "public_gradient_subspace_m50", "public_subspace", "oracle_every2"}
  for dataset in ("digits", "mine.npz"):
    for n in (200, 400):
      for eps in ("1", "2"):
        rows = saved["summary"][f"{dataset}/n={n}/softmax/eps={eps}"]
        assert set(rows) == rows_expected
        assert rows["dp_sgd"]["diff"] == 0 and not rows["dp_sgd"]["wins"]
        for route, r in rows.items():
          assert 0 <= r["acc"] <= 1 and r["ci"][0] <= r["diff"] <= r["ci"][1]
          assert r["learning_rate"] in (0.05, 0.1)
          assert r["private"] == (route != "non_private" and not route.startswith("oracle"))
          assert r["beats_model"] == (r["private"] and route != "dp_sgd" and r["ci"][0] > 0)
          assert r["wins"] == (r["beats_model"] and r["vs_best_dp_sgd"] > 0)
        detail = saved["details"][f"{dataset}/n={n}/softmax/eps={eps}"]
        assert all(d["n_private"] == n for d in detail.values())
        pca = detail["private_input_subspace"]
        assert pca["rank"] in (2, 4) and pca["pca_fraction"] == 0.2
        assert pca["pca_noise_multiplier"] > 0
        assert detail["public_gradient_subspace_m50"]["public_rows"] == 50
    for route, c in saved["crossover"][dataset]["softmax"]["2"].items():
      assert c["n_max"] == 400 and set(c["by_n"]) == {"200", "400"}
      wins = sorted(int(n) for n, b in c["by_n"].items() if b["wins"])
      assert c["n_star"] == (min(wins) if wins else None) and c["n_wins"] == wins
      beats = sorted(int(n) for n, b in c["by_n"].items() if b["beats_model"])
      assert c["n_star_model"] == (min(beats) if beats else None) and c["n_beats_model"] == beats
    assert (tmp_path / f"fig_{dataset}.png").stat().st_size > 0
  shipped = json.loads((tmp_path / "crossover.json").read_text())
  assert set(shipped) == {"digits", "mine.npz"}
  assert shipped["digits"]["softmax"]["1"]["private_input_subspace"]["n_max"] == 400
  assert "by_n" not in shipped["digits"]["softmax"]["1"]["private_input_subspace"]
  assert shipped["digits"]["softmax"]["1"]["private_input_subspace"][
      "best_model_at_n_max"] == "softmax"
  # Paired seeds: the non-private route's test accuracies are shared across ε.
  d = saved["details"]
  assert (d["digits/n=200/softmax/eps=1"]["non_private"]
          == d["digits/n=200/softmax/eps=2"]["non_private"])
  quick_path = tmp_path / "quick.json"
  quick = bench.main(["--quick", "--data", "digits", "--steps", "3", "--routes", "dp_sgd",
                      "gep_trajectory", "dp_sgd_denoise", "--oracle-refresh", "--gep-ranks", "2",
                      "4", "--models",
                      "softmax", "mlp_small", "mlp_large", "cnn", "--json", str(quick_path)])
  assert set(quick["summary"]["digits/n=1157/softmax/eps=2"]) == {
      "dp_sgd", "gep_trajectory", "dp_sgd_denoise"}
  # The CNN (a Flax NNX State) takes the pytree routes only; gep acts on a first dense layer.
  assert set(quick["summary"]["digits/n=1157/cnn/eps=2"]) == {"dp_sgd", "dp_sgd_denoise"}
  assert set(quick["summary"]["digits/n=1157/mlp_large/eps=2"]) == {
      "dp_sgd", "gep_trajectory", "dp_sgd_denoise"}
  assert quick["details"]["digits/n=1157/mlp_large/eps=2"]["gep_trajectory"]["rank"] in (2, 4)
  assert quick["config"]["gep_ranks"] == [2, 4]
  # --merge: the pieces' cells united, the crossover derived from the whole, nothing run.
  merged_path = tmp_path / "merged.json"
  merged = bench.main(["--merge", str(path), str(quick_path), "--diagnostics",
                       "--markdown", str(tmp_path / "tables.md"), "--json", str(merged_path),
                       "--plot", str(tmp_path / "merged"), "--write-crossover",
                       str(tmp_path / "merged_crossover.json")])
  assert set(merged["summary"]) == set(saved["summary"]) | set(quick["summary"])
  digits = merged["crossover"]["digits"]
  assert set(digits["softmax"]["2"]["private_input_subspace"]["by_n"]) == {"200", "400"}
  assert set(digits["softmax"]["2"]["gep_trajectory"]["by_n"]) == {"1157"}
  assert digits["cnn"]["2"]["dp_sgd_denoise"]["n_max"] == 1157
  assert json.loads(merged_path.read_text())["config"]["merged"] == [str(path), str(quick_path)]
  tables = (tmp_path / "tables.md").read_text()
  assert tables.count("| digits, softmax | ") >= 4 and "| above 2σ_p√d |" in tables
  for name, rows in merged["details"].items():       # every DP-PCA row diagnosed, DPASE at n_max
    if "private_input_subspace" in rows:
      diag = rows["private_input_subspace"]["diagnostics"]
      assert diag["rank"] == rows["private_input_subspace"]["rank"]
      assert ("dpase" in diag) == name.endswith(("n=400/softmax/eps=1", "n=400/softmax/eps=2"))
  assert (tmp_path / "merged_digits.png").stat().st_size > 0
  assert "public_subspace" not in bench.DEFAULT_ROUTES
  assert "dp_sgd_denoise" not in bench.DEFAULT_ROUTES


def test_gradient_subspace_wins_against_the_best_model_of_the_task():
  """A route beats its own model's DP-SGD (``beats_model``) but wins only above the best DP-SGD
  of its task at that (n, ε) — over models AND the feature map (scattering features pose full
  MNIST's task): DP-PCA on pixels that beats its MLP's DP-SGD is no win next to scattering."""
  bench = _load("gradient_subspace")

  def row(mean, ci, private=True):
    return {"mean": mean, "acc": mean, "diff": 0.0, "ci": ci, "private": private,
            "learning_rate": 0.1}
  summary = {
      "mnist_full/n=58000/mlp_1000/eps=2": {
          "dp_sgd": row(0.925, [0.0, 0.0]), "private_input_subspace": row(0.935, [0.005, 0.016]),
          "non_private": row(0.976, [0.05, 0.06], private=False)},
      "mnist_full_scattering/n=58000/softmax/eps=2": {
          "dp_sgd": row(0.984, [0.0, 0.0]), "gep_trajectory": row(0.985, [0.0005, 0.002])},
      "mnist_full/n=10000/mlp_1000/eps=2": {
          "dp_sgd": row(0.85, [0.0, 0.0]), "private_input_subspace": row(0.87, [0.01, 0.03])}}
  bench._mark_wins(summary)
  pca = summary["mnist_full/n=58000/mlp_1000/eps=2"]["private_input_subspace"]
  assert pca["beats_model"] and not pca["wins"]
  assert pca["vs_best_dp_sgd"] == pytest.approx(0.935 - 0.984)
  assert pca["best_model"] == "mnist_full_scattering/softmax"
  gep = summary["mnist_full_scattering/n=58000/softmax/eps=2"]["gep_trajectory"]
  assert gep["beats_model"] and gep["wins"]
  assert not summary["mnist_full/n=58000/mlp_1000/eps=2"]["non_private"]["beats_model"]
  # At n = 10k the scattering pipeline did not run: beating the only model there is no win.
  small = summary["mnist_full/n=10000/mlp_1000/eps=2"]["private_input_subspace"]
  assert small["beats_model"] and not small["wins"]
  assert small["best_unmeasured"] == ["mnist_full_scattering/softmax"]
  assert bench.crossovers(summary)["mnist_full"]["mlp_1000"]["2"]["private_input_subspace"][
      "n_star"] is None
  summary["mnist_full_scattering/n=10000/softmax/eps=2"] = {"dp_sgd": row(0.86, [0.0, 0.0])}
  bench._mark_wins(summary)
  small = summary["mnist_full/n=10000/mlp_1000/eps=2"]["private_input_subspace"]
  assert small["wins"] and small["best_model"] == "mnist_full_scattering/softmax"
  assert small["vs_best_dp_sgd"] == pytest.approx(0.01)            # 0.87 against 0.86
  assert small["best_unmeasured"] == []
  crossover = bench.crossovers(summary)
  c = crossover["mnist_full"]["mlp_1000"]["2"]["private_input_subspace"]
  details = {name: {r: {"test": [0.9, 0.91]} for r in rows} for name, rows in summary.items()}
  summary.pop("mnist_full_scattering/n=10000/softmax/eps=2")
  bench._mark_wins(summary)                 # the table says which model did not run at 10k
  tables = bench.markdown_tables(summary, details, crossover).splitlines()
  assert ("| mnist_full, mlp_1000 | 2 | 58,000 | 0.925 (2) | **+0.0 [+0.5, +1.6]** | | -5.9 "
          "(mnist_full_scattering/softmax) |") in [" ".join(t.split()) for t in tables]
  assert ("| mnist_full, mlp_1000 | 2 | 10,000 | 0.850 (2) | **+0.0 [+1.0, +3.0]** | | +0.0 "
          "(mnist_full/mlp_1000; mnist_full_scattering/softmax not run) |") in [
              " ".join(t.split()) for t in tables]
  assert (c["n_star"], c["n_wins"]) == (10_000, [10_000])
  assert (c["n_star_model"], c["n_beats_model"]) == (10_000, [10_000, 58_000])
  assert c["best_model_at_n_max"] == "mnist_full_scattering/softmax"
  # Another model above the best one's mean, but with three independent seeds a Welch interval
  # (the seeds of different models share keys, not randomness) that holds zero: no win.
  real = {"mnist_full_scattering/n=58000/softmax/eps=2": {
              "dp_sgd": {**row(0.98383, [0.0, 0.0]), "test": [0.9836, 0.9838, 0.9841]}},
          "mnist_full_scattering/n=58000/mlp_256/eps=2": {
              "dp_sgd": {**row(0.98257, [0.0, 0.0]), "test": [0.9824, 0.9828, 0.9825]},
              "gep_trajectory": {**row(0.98467, [0.001, 0.003]),
                                 "test": [0.9842, 0.9846, 0.9852]}}}
  bench._mark_wins(real)
  gep = real["mnist_full_scattering/n=58000/mlp_256/eps=2"]["gep_trajectory"]
  assert gep["beats_model"] and gep["vs_best_dp_sgd"] > 0 and not gep["wins"]
  assert gep["ci_vs_best"][0] < 0 < gep["ci_vs_best"][1]
  mean, ci = bench.welch_interval([0.9842, 0.9846, 0.9852], [0.9836, 0.9838, 0.9841])
  assert mean == pytest.approx(0.000833, abs=1e-6)
  assert ci == pytest.approx([-0.000212, 0.001879], abs=2e-6)     # scipy's Welch test: p = 0.085
  # Shipped to the main job under its model names: scattering + softmax is its scatnet.
  assert bench.shipped_name("mnist_full_scattering", "softmax") == ("mnist_full", "scatnet")
  assert bench.shipped_name("mnist_full_scattering", "mlp_256") == ("mnist_full",
                                                                     "scatnet_mlp_256")
  assert bench.shipped_name("mnist_full", "mlp_1000") == ("mnist_full", "mlp_1000")


def test_input_diagnostics_on_a_planted_spectrum():
  """The DP-PCA diagnostics on rows with three strong directions: the exact basis captures at
  least what the release does, the strong directions are above the noise edge and the weak ones
  below, and the numbers follow the route's own release (σ_p of its event); the DPASE probe
  answers only where the gap is sharp, and says when there are too few rows."""
  bench = _load("gradient_subspace")
  rng = np.random.default_rng(0)
  n, d = 20_000, 40
  X = rng.normal(size=(n, d)) * 0.05
  X[:, :3] += rng.normal(size=(n, 3)) * np.array([3.0, 2.0, 1.5])
  diag = bench.input_diagnostics(X, rank=3, epsilon=2.0, fraction=0.1, dpase_probe=True)
  assert diag["noise_sigma"] == pytest.approx(
      bench.experiments.input_basis_event(0.2, 1e-6).noise_multiplier)
  assert diag["noise_edge"] == pytest.approx(2 * diag["noise_sigma"] * np.sqrt(d))
  assert diag["detectable"] == 3 and len(diag["snr"]) == 3 and len(diag["eigenvalues"]) == 6
  assert 0.9 < diag["captured_released"] <= diag["captured_exact"] + 1e-9 <= 1.0 + 1e-9
  assert [p["k"] for p in diag["dpase"]] == [1, 3]
  for probe in diag["dpase"]:
    assert set(probe) == {"k", "ok", "gamma", "cell_length", "num_subsets", "captured", "note"}
    assert probe["note"] is None
  few = bench.input_diagnostics(X[:300], rank=3, epsilon=2.0, fraction=0.1, dpase_probe=True)
  assert not few["dpase"][-1]["ok"] and "n is too small" in few["dpase"][-1]["note"]
  # DPASE needs a far sharper gap than Analyze Gauss: ⊥ here (γ ≈ 0.05), an answer at γ ≈ 1e-4.
  assert not diag["dpase"][-1]["ok"] and diag["dpase"][-1]["captured"] is None
  X[:, 3:] *= 2e-3
  sharp = bench.input_diagnostics(X, rank=3, epsilon=2.0, fraction=0.1, dpase_probe=True)
  assert sharp["dpase"][-1]["ok"] and 0.99 < sharp["dpase"][-1]["captured"] <= 1.0


def test_gradient_subspace_full_mnist_split():
  """Full MNIST in the crossover study: the canonical test digits, 1,000 tuning rows, 1,000
  public rows and a pool of 58,000, disjoint, in the loader's fixed order; the scattering data
  set is the same rows as features (its default grid's largest n is the whole pool)."""
  bench = _load("gradient_subspace")
  parts = bench.load("mnist_full", 0)
  assert {k: v[0].shape for k, v in parts.items()} == {
      "test": (10_000, 784), "tune": (1000, 784), "public": (1000, 784), "pool": (58_000, 784)}
  rows = np.concatenate([parts[k][0] for k in ("tune", "pool", "public")])
  np.testing.assert_array_equal(rows, bench.data_lib.load_mnist(full=True).X_train)
  assert max(bench.DEFAULT_N["mnist_full_scattering"]) == 58_000
  assert bench.STEPS["mnist_full"] == bench.STEPS["mnist_full_scattering"]


@pytest.mark.slow(reason="the synthetic-data benchmark's options and its NumPy PMM baseline")
def test_synthetic_data_options(tmp_path):
  """Every option at tiny sizes; the JSON has the documented summary schema, both PNGs exist and
  the NumPy baseline's PMM pieces equal dpjax's."""
  pytest.importorskip("matplotlib")
  pytest.importorskip("sklearn")
  pytest.importorskip("ot")
  pytest.importorskip("threadpoolctl")
  path, prefix = tmp_path / "out.json", tmp_path / "fig"
  bench = _load("synthetic_data")
  out = bench.main(
      ["--quick", "--epsilon", "2", "--dims", "10", "--sub-dims", "1", "3", "--n-min", "500",
       "--n-max", "2000", "--keys", "1", "--w1-rows", "300", "--dim-epsilons", "1", "16",
       "--digits-epsilons", "1", "4", "16", "--speed-n", "2000", "5000", "--repeats", "1",
       "--blas-threads", "1", "--covariance-scale", "tight", "--seed", "3", "--json", str(path),
       "--plot", str(prefix)])
  saved = json.loads(path.read_text())
  assert saved["config"]["covariance_scale"] == "tight" and saved["config"]["n_grid"] == [632, 2000]
  summary = saved["summary"]
  assert summary == json.loads(json.dumps(out["summary"]))
  cells = {"10,1", "10,3"}
  assert set(summary["slope"]) == set(summary["w1_ratio_vs_full_dim_pmm"]) == cells
  assert all(isinstance(s, float) for s in summary["slope"].values())          # n ∈ {632, 2000}
  assert all(r > 0 for r in summary["w1_ratio_vs_full_dim_pmm"].values())
  assert summary["slope_theory"]["10,3"] == pytest.approx(-1 / 3)
  assert set(summary["digits"]) == {"1", "4", "16"}
  for r in summary["digits"].values():
    assert r["w1"] > 0 and 1 <= r["dim"] <= 10
  assert set(summary["speed"]) == {"2000", "5000"}
  for r in summary["speed"].values():
    assert set(r) == {"dpjax_s", "numpy_s", "ratio_median", "ratio_min", "compile_s"}
    assert r["ratio_min"] <= r["ratio_median"] and r["dpjax_s"] > 0 and r["numpy_s"] > 0
  points = saved["points"]
  assert len(points) == 2 * 2 * len(bench.METHODS)                    # (d, d') × n × method
  for p in points:
    assert len(p["w1"]) == 1 and p["w1_median"] >= 0 and p["w1_rows"] == 300
    assert p["w1_label"] == ("closed_form" if p["method"] == "mean_point_mass" else "exact")
  assert set(saved["dim_choice"]["dims"]) == {"1", "16"}
  assert all(saved["baseline_checks"].values())
  assert all(r["shapes_agree"] for r in saved["speed"].values())
  for name in ("fig_w1.png", "fig_dim.png"):
    assert (tmp_path / name).stat().st_size > 0


@pytest.mark.slow(reason="the classic PCA/ERM benchmark's options (diffprivlib when present)")
def test_classic_options(tmp_path):
  """benchmarks/classic.py with every option at tiny sizes: the documented JSON summary schema,
  both PNGs, diffprivlib measured or reported missing (never a crash)."""
  pytest.importorskip("matplotlib")
  pytest.importorskip("sklearn")
  path, prefix = tmp_path / "out.json", tmp_path / "fig"
  bench = _load("classic")
  out = bench.main(["--quick", "--epsilons", "1", "--delta", "1e-4", "--k", "2", "--sweeps", "2",
                    "--gamma", "0.2", "--seeds", "1", "--spiked-n", "600", "--spiked-d", "10",
                    "--spiked-noise", "0.1", "--repeats", "1", "--diffprivlib-timeout", "20",
                    "--speed-epsilon", "0.5",
                    "--seed", "2", "--json",
                    str(path), "--plot", str(prefix)])
  saved = json.loads(path.read_text())
  summary = saved["summary"]
  assert summary == json.loads(json.dumps(out["summary"]))
  assert set(summary) == {"pca_captured_variance", "erm_accuracy", "speedup_vs_diffprivlib"}
  assert set(saved["more"]) == {"spiked_captured_variance", "erm_accuracy_balanced"}
  assert set(summary["pca_captured_variance"]) == set(bench.PCA_METHODS)
  assert set(summary["erm_accuracy"]) == set(bench.ERM_METHODS)
  for method in ("mod_sulq", "ppca", "analyze_gauss"):
    assert 0.0 <= summary["pca_captured_variance"][method]["1.0"] <= 1.0 + 1e-6
  assert 0.0 < summary["erm_accuracy"]["objective"]["1.0"] <= 1.0
  assert set(summary["speedup_vs_diffprivlib"]) == {"pca", "erm"}
  if summary["speedup_vs_diffprivlib"]["pca"] is None:
    assert saved["notes"] and "diffprivlib" in saved["notes"][0]
  for kind in ("pca", "erm", "erm_balanced"):
    assert (tmp_path / f"fig_{kind}.png").exists()


@pytest.mark.slow(reason="the ERM regularisation benchmark's options")
def test_erm_regularization_options(capsys):
  bench = _load("erm_regularization")
  bench.main(["--quick", "--dataset", "digits", "--epsilons", "1", "--uncentred"])
  bench.main(["--quick", "--dataset", "synthetic", "--repeats", "1"])
  text = capsys.readouterr().out
  assert "κ=" in text and "non-private" in text


@pytest.mark.slow(reason="the scaling benchmark's options: simulated-device and streaming "
                         "worker processes")
def test_scaling_options(tmp_path):
  """Every documented option of benchmarks/scaling.py at tiny sizes (--gpu only where a GPU is:
  it runs the same workers on the host's real devices)."""
  path = tmp_path / "out.json"
  tiny = ["--n-train", "400", "--features", "12", "--width", "8", "--batch", "32", "--rank", "3",
          "--steps", "2", "--n-dpase", "6000", "--d-dpase", "12", "--n-stream", "6000", "--d", "12",
          "--k", "2", "--worker-timeout", "600",
          "--gap", "1e-6", "--chunk", "700", "--repeats", "1"]
  out = _load("scaling").main(["--quick", "--devices", "1,2,4", "--n-in-memory", "3000",
                                "--json", str(path), *tiny])
  saved = json.loads(path.read_text())
  assert out["more"]["in_memory"]["n"] == 3000          # the file's first rows
  assert set(saved["summary"]["dpsgd_examples_per_s"]) == {"1", "2", "4"}
  assert set(saved["summary"]["dpase_seconds"]) == {"1", "4"}
  assert set(saved["summary"]["streaming"]) == {"n", "d", "seconds", "peak_rss_bytes"}
  assert saved["summary"]["streaming"]["n"] == 6000
  assert out["more"]["in_memory"]["seconds"] > 0 and out["more"]["streaming"]["seconds"] > 0
  assert all(r["ok"] for r in out["more"]["dpase"].values())
  rest = _load("scaling").main(["--devices", "1", "--skip-in-memory", "--clipped-sum", "vmap",
                                *tiny])
  assert rest["more"]["in_memory"] is None and rest["more"]["dpsgd"][1]["clipped_sum"] == "vmap"
  assert rest["config"]["n_in_memory"] == 6000           # min(n-stream, 10^6): the whole file
  if any(d.platform == "gpu" for d in jax.devices()):
    _load("scaling").main(["--gpu", "--devices", "1", "--skip-in-memory", *tiny])


@pytest.mark.slow(reason="the DP-SGD step benchmark's options, its peers' steps included")
def test_dpsgd_step_options(tmp_path):
  """Every option at tiny sizes: one model above --max-per-example-gb (micro-batched per-example
  sides), one below (ghost checked against the vmap path); the summary has the issue's keys."""
  path = tmp_path / "out.json"
  out = _load("dpsgd_step").main(
      ["--quick", "--models", "20-16-4", "10-4", "--batch", "16", "--repeats", "1",
       "--microbatch", "8", "--max-per-example-gb", "5e-6", "--subspace-rank", "4",
       "--json", str(path)])
  saved = json.loads(path.read_text())
  assert saved["summary"] == json.loads(json.dumps(out["summary"]))
  for key in ("ratio_vs_nonprivate", "ratio_vs_optax_dpsgd", "ratio_vs_jax_privacy"):
    assert set(saved["summary"][key]) == {"404", "44"}
  assert all(r > 0 for r in saved["summary"]["ratio_vs_nonprivate"].values())
  big, small = saved["models"]["404"], saved["models"]["44"]
  assert big["microbatch"] == 8 and small["microbatch"] is None
  assert small["ghost_vs_vmap_max_rel_diff"] < 1e-5
  assert set(big["median_s"]) >= {"nonprivate", "ghost", "ghost_no_noise", "vmap", "optax_dpsgd",
                                  "ghost_subspace", "vmap_per_layer", "ghost_bandmf",
                                  "ghost_subspace_bandmf", "ghost_blt", "ghost_adaptive"}
  # The subspace release draws k·h normals on the first kernel (--subspace-rank 4: 4·16, not
  # 20·16): 404 − 320 + 64 = 148; on 10-4, 44 − 40 + 16 = 20.
  assert big["noise_draws"] == {"full": 404, "subspace": 148}
  assert small["noise_draws"] == {"full": 44, "subspace": 20}
  assert set(saved["summary"]["full_release_vs_subspace"]) == {"404", "44"}
  assert set(saved["summary"]["per_layer_clipping_vs_global"]) == {"404", "44"}


@pytest.mark.slow(reason="the Flax CNN and transformer through every side of the step "
                         "benchmark (compiles ~12 programs)")
def test_dpsgd_step_flax_models(tmp_path):
  """The named Flax models at tiny sizes: keyed by name, ghost checked against the vmap path,
  memory reported per side."""
  path = tmp_path / "out.json"
  _load("dpsgd_step").main(["--models", "cnn", "transformer", "--seq", "8", "--batch", "8",
                            "--repeats", "1", "--microbatch", "4", "--json", str(path)])
  saved = json.loads(path.read_text())
  for key in ("ratio_vs_nonprivate", "ratio_vs_jax_privacy", "memory_mb", "num_params"):
    assert set(saved["summary"][key]) == {"cnn", "transformer"}
  assert saved["summary"]["num_params"]["cnn"] == 144_266
  assert saved["config"]["seq"] == 8
  for model in saved["models"].values():
    assert model["ghost_vs_vmap_max_rel_diff"] < 1e-4
    assert all(m is None or m > 0 for m in model["memory_mb"].values())
    assert all(1 <= c <= 50 for c in model["calls_per_sample"].values())


@pytest.mark.slow(reason="four learn_gaussian runs at its minimum n (1.7·10⁶ rows); "
                         "tests/ashtiani_liaw runs it at small n")
def test_learn_gaussian_at_its_minimum_n_on_the_model_data_answers_accurately():
  """Issue 16's end-to-end check at the new calibration (d = 5, rank 3, ε = 1, ‖μ‖ = 10⁶,
  eigenvalues 10^U(−6, 6)): trial 3 answered ok=True with a mean off by 10⁶ before the
  float-safe releases of CoinPress's mean and of the orthogonal-mean PPME stopped saturating at
  their clamps. Every run must answer and be accurate (no garbage behind ok=True)."""
  bench = _load("covariance")
  n = bench.gaussian_min_n(5, 3, 1.0, 1e-6)
  cell = bench.gaussian_cell(5, n, 4, 1.0, 1e-6, 0)
  assert cell["bottom_rate"] == 0.0
  assert max(cell["covariance_errors"]) < 0.1           # learn_covariance's refine_accuracy
  assert max(cell["mahalanobis_errors"]) < 0.05
  assert max(cell["orthogonal_mean_errors"]) < 1.0


@pytest.mark.slow(reason="the DPASE success-rate benchmark's options")
def test_dpase_success_options(tmp_path):
  path = tmp_path / "out.json"
  out = _load("dpase_success").main(["--quick", "--trials", "2", "--configs",
                                     "1500,6,1,1e-4;1500,6,1,1e-1", "--json", str(path)])
  saved = json.loads(path.read_text())
  assert saved["points"] == json.loads(json.dumps(out))
  assert [(p["n"], p["d"], p["k"], p["gamma"], p["trials"]) for p in out] == [
      (1500, 6, 1, 1e-4, 2), (1500, 6, 1, 1e-1, 2)]
  for p in out:
    assert 0 <= p["success_rate"] <= 1 and 0 <= p["bottom_rate"] <= 1
    assert p["ci95"][0] <= p["success_rate"] <= p["ci95"][1]


@pytest.mark.slow(reason="the dimension-free reproduction benchmark's options")
def test_subspace_dimension_free_options(tmp_path):
  pytest.importorskip("matplotlib")
  path, prefix = tmp_path / "out.json", tmp_path / "fig"
  bench = _load("subspace_dimension_free")
  out = bench.main(["--quick", "--trials", "1", "--dims", "8", "--grid", "1500,3000", "--k", "1",
                    "--gamma", "1e-4", "--json", str(path), "--plot-prefix", str(prefix)])
  saved = json.loads(path.read_text())
  assert saved["summary"] == json.loads(json.dumps(out["summary"]))
  assert saved["config"]["dims"] == [8] and saved["config"]["grid"] == [1500, 3000]
  assert saved["config"]["gamma"] == 1e-4 and saved["config"]["k"] == 1
  assert {p["method"] for p in out["points"]} | {s["method"] for s in out["skipped"]} == set(
      bench.METHODS)
  assert set(out["summary"]["n_at_alpha"]) == set(bench.METHODS)
  for name in ("fig_error_vs_n.png", "fig_n_vs_d.png"):
    assert (tmp_path / name).stat().st_size > 0
  scaled = bench.main(["--trials", "1", "--dims", "8", "--grid", "1500", "--k", "1",
                       "--gamma-scale", "1e-3"])
  assert scaled["config"]["gamma_scale"] == 1e-3 and scaled["config"]["gamma"] is None


@pytest.mark.slow(reason="the one-run audit benchmark: three DP-SGD runs on scattering features "
                         "(~1 minute, features cached after the first call)")
def test_one_run_audit_options(tmp_path):
  """Every option at a small size: the correct run passes both one-run analyses, both negative
  controls are flagged, each row has its accuracy and bounds, the JSON has the same rows."""
  path = tmp_path / "out.json"
  rc = _load("one_run_audit").main(["--quick", "--rows", "3000", "--canaries", "400",
                                    "--epsilons", "2", "--json", str(path)])
  assert rc == 0
  saved = json.loads(path.read_text())
  rows = {r["control"]: r for r in saved["rows"]}
  assert set(rows) == {"none", "no_noise", "unclipped"}
  assert rows["none"]["one_run_passed"] and rows["none"]["one_run_fdp_passed"]
  for control in ("no_noise", "unclipped"):
    assert rows[control]["one_run"] > 2.0 and not rows[control]["one_run_fdp_passed"]
  assert all(r["canaries"] == 400 and 0.8 < r["test_accuracy"] <= 1.0 for r in rows.values())


@pytest.mark.slow(reason="the correlated-noise benchmark: twelve small DP-SGD runs on scattering "
                         "features (independent and BandMF noise, with and without a DP-PCA "
                         "basis, without a filter, with the low-pass and the Kalman filter)")
def test_correlated_noise_options(tmp_path):
  """Every option at a small size: each (subspace, bands) cell runs at its plan's ε, learns,
  and the JSON has the rows as printed."""
  path = tmp_path / "out.json"
  rc = _load("correlated_noise").main(["--quick", "--rows", "3000", "--epsilons", "2",
                                       "--bands", "1", "4", "--subspace", "none", "dp_pca",
                                       "--filter", "none", "low_pass", "kalman", "--seeds", "1",
                                       "--rank",
                                       "64", "--json", str(path)])
  assert rc == 0
  rows = [r for r in json.loads(path.read_text())["rows"] if r["filter"] == "none"]
  assert {(r["subspace"], r["bands"]) for r in rows} == {("none", 1), ("none", 4),
                                                         ("dp_pca", 1), ("dp_pca", 4)}
  everything = json.loads(path.read_text())["rows"]
  assert len(everything) == 12 and {r["filter"] for r in everything} == {"none", "low_pass",
                                                                          "kalman"}
  assert all(0.5 < r["test_accuracy"] <= 1.0 for r in everything)
  for r in rows:
    assert r["plan_epsilon"] == pytest.approx(2.0, rel=0.02)
    assert 0.5 < r["test_accuracy"] <= 1.0 and len(r["accuracies"]) == 1
  sigma = {(r["subspace"], r["bands"]): r["sigma"] for r in rows}
  assert sigma[("none", 4)] > sigma[("none", 1)]          # fewer rounds at a higher rate

