"""Compute kernels outside Pallas, and the projection backends the model's forward is given.

* :mod:`akv_jax.kernels.projection`: what the forward calls for its products by weights (a
  :class:`~akv_jax.kernels.projection.Projection`) and XLA's own backend;
* :mod:`akv_jax.kernels.cpu`: the XLA:CPU kernels written in C++ (attention, few-row
  products, GEMM), their FFI bindings, the packed weight layout, and the CPU projection
  backend built on them.

Nothing here imports the rest of the project: the model is given a backend (it imports no
CPU kernel: ``tests/test_imports.py``), and the attention factory
(:mod:`akv_jax.pallas.dispatch`) picks the backends (``tests/test_import_graph.py``).
"""
