"""DP primitives (ALGORITHMS.md §1)."""
