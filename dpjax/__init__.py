"""dpjax: differential privacy in JAX that learns low-dimensional structure privately."""
