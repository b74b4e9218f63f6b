"""Research harnesses built on dpjax's public API: NOT part of dpjax's public API.

What lives here reproduces experiments (the gradient-subspace routes of ``python -m dpjax.demo``
and ``benchmarks/gradient_subspace.py``, the NOT private oracle diagnostic). It is assembled from
public pieces (``dpjax.sgd``'s clipped-gradient sums, ``dp_noise``, subspace sources, accounting),
is not re-exported by ``dpjax`` (import it explicitly: ``from dpjax import experiments``), and may
change with the experiments. Its guarantees are stated per function (:func:`train_route`: per
run, under add/remove-one, for the routes of :data:`ROUTES`; the diagnostic routes have none).
For your own training loop use :func:`dpjax.sgd.dp_sgd_plan`.
"""

from dpjax.experiments.routes import (DENSE_ROUTES, DIAGNOSTIC_ROUTES, INPUT_SCALINGS,
                                      PUBLIC_ROUTES, ROUTES, RouteRun, RouteSettings, RunKeys,
                                      first_layer_bases, gep_edge_noise_std, gep_refresh,
                                      input_basis_event, route_plans, route_rank, run_keys,
                                      train_route)

__all__ = ["DENSE_ROUTES", "DIAGNOSTIC_ROUTES", "INPUT_SCALINGS", "PUBLIC_ROUTES", "ROUTES",
           "RouteRun", "RouteSettings", "RunKeys", "first_layer_bases", "gep_edge_noise_std",
           "gep_refresh", "input_basis_event", "route_plans", "route_rank", "run_keys",
           "train_route"]
