"""The README example and the notebooks run as written (so they cannot rot)."""

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(source: str, name: str) -> dict:
  namespace: dict = {"__name__": name}
  exec(compile(source, name, "exec"), namespace)  # noqa: S102 - our own documentation
  return namespace


@pytest.mark.slow
def test_readme_example_runs():
  text = (ROOT / "README.md").read_text()
  code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  ns = _run(code, "README.md")
  assert bool(ns["res"].ok) and float(ns["metrics"].projection_distance(
      ns["res"].basis, ns["model"].basis)) < 0.1
  assert ns["out"].budget.epsilon <= 2.0 + 1e-9


@pytest.mark.slow
def test_readme_covariance_example_runs():
  text = (ROOT / "README.md").read_text()
  code = re.findall(r"```python\n(.*?)```", text, re.S)[1]
  ns = _run(code, "README.md#covariance")
  assert bool(ns["cov"].ok) and ns["metrics"].covariance_error(ns["cov"].estimate,
                                                               ns["Sigma"]) < 0.1


def test_readme_privatizer_example_runs():
  """The optax-loop example: at most 5 DP-specific lines (issue 11 §3), and it learns."""
  text = (ROOT / "README.md").read_text()
  code = re.findall(r"```python\n(.*?)```", text, re.S)[2]
  assert 1 <= code.count("# DP") <= 5
  ns = _run(code, "README.md#privatizer")
  assert float(ns["jnp"].linalg.norm(ns["params"] - ns["jnp"].arange(1.0, 6.0))) < 0.5
  assert ns["dp"].budget.epsilon <= 2.0 + 1e-9


@pytest.mark.slow    # a subprocess; the sharded step's audit runs by default
def test_readme_several_devices_example_runs():
  """The mesh example runs (on however many devices this process has) and learns."""
  text = (ROOT / "README.md").read_text()
  code = re.findall(r"```python\n(.*?)```", text, re.S)[3]
  assert "mesh=mesh" in code
  ns = _run(code, "README.md#devices")
  assert float(ns["out"].params[0]) > 0.5 and ns["out"].budget.epsilon <= 2.0 + 1e-9


@pytest.mark.slow
def test_quickstart_notebook_runs():
  nb = json.loads((ROOT / "notebooks" / "quickstart.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "quickstart.ipynb")
  assert ns["out"].subspace_ok is True and ns["out"].history[-1]["accuracy"] > 0.9


@pytest.mark.slow
def test_private_subspaces_notebook_runs_reduced(monkeypatch):
  monkeypatch.setenv("DPJAX_NOTEBOOK_QUICK", "1")
  nb = json.loads((ROOT / "notebooks" / "private_subspaces.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "private_subspaces.ipynb")
  assert bool(ns["res"].ok)                                  # DPASEB answered
  assert all(r[1] < 0.1 for r in ns["rows"])                 # DPASE accurate at every d


@pytest.mark.slow
def test_private_gaussians_notebook_runs_reduced(monkeypatch):
  monkeypatch.setenv("DPJAX_NOTEBOOK_QUICK", "1")
  nb = json.loads((ROOT / "notebooks" / "private_gaussians.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "private_gaussians.ipynb")
  assert ns["baseline_error"] > 1.0                          # the guessed clip bound fails
  assert bool(ns["refined"].ok) and ns["refined_error"] < min(0.05, ns["coarse_error"])
  assert ns["gauss"].ok and ns["gauss_cov_error"] < 0.1   # singular Σ; refine_accuracy at min n
  assert ns["bad"].failed_step_name == "covariance" and ns["lines"].failed_step_name == "subspace"


# --- The specification ships with the project ----------------------------------------------------

_CITED_TREES = ("dpjax", "tests", "benchmarks", "notebooks", "README.md")
# "docs/algorithms.md §3.5", "docs/algorithms.md §3.5–3.6", "docs/algorithms.md §1.3, §1.4",
# "docs/algorithms.md\n  # §2.2": the section numbers that follow one citation.
_CITATION = re.compile(r"algorithms\.md[\s#\"]*((?:§\s*\d+(?:\.\d+)?(?:\s*[–/-]\s*\d+(?:\.\d+)?)?"
                       r"(?:\s*(?:,|and|or)\s*(?=§))?\s*)+)")


def _documentation_texts():
  for entry in _CITED_TREES:
    path = ROOT / entry
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
      if f.suffix == ".ipynb":
        nb = json.loads(f.read_text())
        yield f, "\n".join("".join(c["source"]) for c in nb["cells"])
      elif f.suffix in (".py", ".md"):
        yield f, f.read_text()


def _spec_sections() -> set[str]:
  text = (ROOT / "docs" / "algorithms.md").read_text()
  return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)[. ]", text, re.M))


def test_every_cited_section_exists():
  sections = _spec_sections()
  assert {"0", "1", "1.10", "2.2", "3.8", "6.2", "8"} <= sections
  cited, missing = 0, []
  for f, text in _documentation_texts():
    assert "ALGORITHMS" + ".md" not in text, f"{f}: cites the specification outside the repository"
    for run in _CITATION.finditer(text):
      for number in re.findall(r"\d+(?:\.\d+)?", run.group(1)):
        cited += 1
        if number not in sections:
          missing.append(f"{f.relative_to(ROOT)}: §{number}")
  assert cited > 100, cited                                   # the pattern still finds them
  assert not missing, missing


@pytest.mark.slow
def test_synthetic_data_notebook_runs_reduced(monkeypatch):
  import matplotlib
  import numpy as np
  matplotlib.use("Agg")                                      # plt.show() opens no window
  monkeypatch.setenv("DPJAX_NOTEBOOK_QUICK", "1")
  nb = json.loads((ROOT / "notebooks" / "synthetic_data.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "synthetic_data.ipynb")
  for res in ns["results"].values():                         # n rows in the cube, a finite plane
    S = np.asarray(res.synthetic)
    assert S.shape == (ns["N"], ns["D"]) and S.min() >= 0.0 and S.max() <= 1.0
    assert res.basis.shape == (ns["D"], ns["DIM"])
    assert np.isfinite(float(ns["metrics"].projection_distance(res.basis, ns["U"])))
  assert all(1 <= k <= ns["D"] for k in ns["chosen"].values())
  for eps, curve in ns["curves"].items():                    # projecting beats d-dim PMM
    assert np.median(curve["pipeline"][-1]) < np.median(curve["pmm"][-1]), eps
  ns["plt"].close("all")


@pytest.mark.slow
def test_classic_pca_erm_notebook_runs_reduced(monkeypatch):
  """The notebook's lessons hold at its reduced size: PPCA and Analyze Gauss capture more
  variance at the larger ε than MOD-SuLQ, and objective perturbation at ε = 3 beats the
  majority class."""
  import matplotlib
  matplotlib.use("Agg")
  monkeypatch.setenv("DPJAX_NOTEBOOK_QUICK", "1")
  nb = json.loads((ROOT / "notebooks" / "classic_pca_erm.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "classic_pca_erm.ipynb")
  pca = {name: vals.mean(0)[-1] for name, vals in ns["pca_results"].items()}
  sulq = next(v for k, v in pca.items() if k.startswith("MOD-SuLQ"))
  assert all(v > sulq for k, v in pca.items() if not k.startswith("MOD-SuLQ")), pca
  objective = ns["erm_results"]["objective perturbation"].mean(0)[-1]
  assert objective > 0.7, objective
  ns["plt"].close("all")
