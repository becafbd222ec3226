"""Building the parallel model: mesh roles (mesh), TP plan checks (plan) and styles
(tensor_parallel), DP before TP (data_parallel), the global gradient norm (grad_norm).

Kept import-free: the launcher validates plans through framework.parallel.plan without
importing DTensor."""
