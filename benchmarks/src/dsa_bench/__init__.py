"""Benchmarks of the DSA kernels (a workspace member, never published).

``dsa-bench`` (:mod:`dsa_bench.sparse_attention`) times sparse attention at the model shapes of
:mod:`dsa_bench.models`; :mod:`dsa_bench.topk` and :mod:`dsa_bench.indexer` benchmark the other
two ops, :mod:`dsa_bench.sweep_backward` sweeps the sparse-attention backward tilings and
:mod:`dsa_bench.memcheck` is the driver for ``compute-sanitizer``. They share timing, argument
types, the printed table, CSV and plots through :mod:`dsa_bench.common`; :mod:`dsa_bench.dense`
is the dense float64 formulation of sparse attention that the CPU precision check uses.
"""
