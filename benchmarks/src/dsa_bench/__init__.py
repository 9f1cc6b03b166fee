"""Benchmarks of the DSA kernels (a workspace member, never published): ``dsa-bench`` and one
module per op, sharing timing, table, CSV and plot code."""
