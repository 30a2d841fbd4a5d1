"""The XLA:CPU kernels written in C++ (``*.cc``, ``*.h``), built on first use by
:mod:`~akv_jax.kernels.cpu.ffi`, with their bindings: :mod:`~akv_jax.kernels.cpu.attention`
(fused segment attention), :mod:`~akv_jax.kernels.cpu.matmul` (few-row products and the GEMM)
and :mod:`~akv_jax.kernels.cpu.projection` (the projection backend of a CPU device group).
Design and measurements: ``docs/cpu-kernels.md``."""
