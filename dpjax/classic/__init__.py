"""Classic private PCA and ERM (Chaudhuri, Monteleoni & Sarwate 2011; Chaudhuri, Sarwate & Sinha
2013): MOD-SuLQ and PPCA (docs/algorithms.md §5.3), output and objective perturbation (§5.1,
§5.2). scikit-learn-style wrappers: :mod:`dpjax.estimators`."""

from dpjax.classic import erm, pca
from dpjax.classic.erm import (ERMParameters, ObjectivePerturbationBudget, default_regularization,
                               erm_required_n,
                               erm_core, erm_parameters, loss_curvature, objective_perturbation,
                               objective_perturbation_budget, one_vs_rest, one_vs_rest_core,
                               output_perturbation, predict)
from dpjax.classic.pca import (bingham_sample, matrix_bingham_sample, mod_sulq, mod_sulq_beta,
                               mod_sulq_core, mod_sulq_required_n, ppca, ppca_core,
                               ppca_required_n, scatter_matrix)

# The names a user meets; each module's own __all__ holds the rest (docs/reference/map.rst).
__all__ = ["default_regularization", "erm_required_n", "mod_sulq", "mod_sulq_required_n", "objective_perturbation",
           "one_vs_rest", "output_perturbation", "ppca", "ppca_required_n", "predict"]
