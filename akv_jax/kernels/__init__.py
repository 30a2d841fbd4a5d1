"""Compute kernels outside Pallas. :mod:`akv_jax.kernels.cpu`: the XLA:CPU kernels written in
C++ (attention, few-row products, GEMM), their FFI bindings and the packed weight layout.

Nothing here imports the rest of the project: the model and the attention factory
(:mod:`akv_jax.pallas.dispatch`) call these (``tests/test_import_graph.py``).
"""
