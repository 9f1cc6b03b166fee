"""Compiling TileLang kernels from several threads (the tests' and dsa-bench's parallel builds)."""

import sys
import threading
from collections.abc import Callable

import tilelang

# TileLang's frontend parses Python source with `ast` when it builds a kernel, and so does its
# lowering (the gemm macros) on the way to nvcc. CPython 3.11 builds ASTs with interpreter-wide
# state that threads can corrupt ("AST constructor recursion depth mismatch", seen in the CPU
# test that compiles the backward table in threads): there the whole compile holds the lock.
# Elsewhere only the build does, and the nvcc compiles run in parallel (the GPU host's Python
# 3.12 built the dsa-bench table with 16 threads without a failure).
_LOCK = threading.Lock()
_WHOLE_COMPILE_LOCKED = sys.version_info < (3, 12)


def compile_kernel(build: Callable[[], object], **compile_kwargs) -> tilelang.JITKernel:
    """``tilelang.compile(build(), **compile_kwargs)``, safe to call from several threads."""
    if _WHOLE_COMPILE_LOCKED:
        with _LOCK:
            return tilelang.compile(build(), **compile_kwargs)
    with _LOCK:
        func = build()
    return tilelang.compile(func, **compile_kwargs)
