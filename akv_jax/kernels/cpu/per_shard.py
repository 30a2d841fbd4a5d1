"""The CPU kernels under a tensor-parallel mesh: each device runs the kernel on its own shard
(``shard_map``), where GSPMD, which cannot partition an FFI call, would otherwise give the
product to XLA, whose sums depend on the number of rows (a request's bits would move with the
batch). Megatron's split, read off the product's letters: a product that keeps a split axis
(the q/kv heads ``h`` or the FFN width ``f`` of ``w``'s outputs) is column-parallel, its output
split alike; one that contracts a split axis is row-parallel, each device's partial product
summed across the mesh (``psum``: an order fixed by the mesh, not by the batch); any other
runs whole on every device. A dimension the mesh does not divide is not split, as
:func:`akv_jax.model.params.logical_to_spec` leaves it replicated.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

AXIS = "tensor"
SPLIT_LETTERS = "hf"  # the forward's letters for what SHARDING_RULES splits over AXIS


def tensor_size() -> int:
    """The context mesh's automatic (not yet per-shard) "tensor" axis size; 1 without."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.shape:
        return 1
    if AXIS in getattr(mesh, "manual_axes", ()):
        return 1
    return mesh.shape[AXIS]


def unsharded() -> bool:
    """No mesh that splits work, or inside a per-shard body: a kernel call runs as is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return True
    manual = set(getattr(mesh, "manual_axes", ()))
    return all(n == 1 or name in manual for name, n in mesh.shape.items())


def sharded_product(
    eq: str,
    x: jax.Array,
    w: jax.Array,
    live: jax.Array | None,
    local: Callable[[str, jax.Array, jax.Array, jax.Array | None], jax.Array],
) -> jax.Array | None:
    """``einsum(eq, x, w)`` (rows from ``live`` on zero) with ``local`` run per shard of the
    context mesh; None outside a tensor-parallel mesh or for a product that is not ``x [T,
    in...]`` by ``w [in..., out...]`` in order."""
    tp = tensor_size()
    if tp == 1 or not isinstance(w, jax.Array):
        return None
    xs, rest = eq.replace(" ", "").split(",")
    ws, out = rest.split("->")
    n_in = x.ndim - 1
    if not (ws[:n_in] == xs[1:] and out == xs[0] + ws[n_in:]):
        return None
    split = next((i for i, c in enumerate(ws) if c in SPLIT_LETTERS and w.shape[i] % tp == 0),
                 None)
    w_spec = [None] * w.ndim
    x_spec, o_spec, row_parallel = [None] * x.ndim, [None] * len(out), False
    if split is not None:
        w_spec[split] = AXIS
        if split >= n_in:  # column-parallel: the output's axis split alike
            o_spec[1 + split - n_in] = AXIS
        else:  # row-parallel: x split on the contracted axis, partial sums added
            x_spec[1 + split], row_parallel = AXIS, True

    def body(x, w, *live):
        y = local(eq, x, w, *live)
        return jax.lax.psum(y, AXIS) if row_parallel else y

    args, specs = (x, w), (P(*x_spec), P(*w_spec))
    if live is not None:
        args, specs = (*args, live), (*specs, P())
    return per_shard(body, specs, P(*o_spec))(*args)


def per_shard(fn: Callable[..., jax.Array], in_specs: tuple, out_spec: P
              ) -> Callable[..., jax.Array]:
    """``fn`` run on each device's shards of the context mesh."""
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs,
                         out_specs=out_spec, check_vma=False)
