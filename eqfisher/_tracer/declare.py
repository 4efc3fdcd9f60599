"""Declared layers: a tag in model code saying that a computation is a dense
layer, for the tracer to find whatever computes it (an `einsum` with batch axes, a
custom primitive, a Pallas kernel), as kfac_jax's layer tags do."""

import jax.numpy as jnp
from jaxtyping import Array, Float

from .. import _compat


def _jvp(primals, tangents, **params):
    # The tag is the identity on `y`; its other operands only say where the layer
    # is, so their tangents are dropped (they reach `y` through its computation).
    return layer_tag_p.bind(*primals, **params), _compat.instantiate_zeros(tangents[0])


def _batch(args, dims, *, has_bias: bool, groups: int):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    params_batched = any(d is not None for d in dims[2:])
    if params_batched:
        # One weight per batch entry: one more group, cut into layers by the tracer.
        moved = [_compat.move_batch_axis(a, d, size) for a, d in zip(args, dims)]
        return layer_tag_p.bind(*moved, has_bias=has_bias, groups=groups + 1), 0
    # A shared weight applied to a batch: one more location axis, after the groups.
    y, x = (
        jnp.moveaxis(_compat.move_batch_axis(a, d, size), 0, groups)
        for a, d in zip(args[:2], dims[:2])
    )
    out = layer_tag_p.bind(y, x, *args[2:], has_bias=has_bias, groups=groups)
    return out, groups


layer_tag_p = _compat.define_identity_primitive("eqfisher_layer_tag", _jvp, _batch)
layer_tag_p.__doc__ = """Identity on `y`; operands `(y, x, w[, b])` of a dense layer
`y = x @ w + b`, each with `groups` leading axes of independent layers."""


def register_dense(
    y: Float[Array, "*locations d_out"],
    x: Float[Array, "*locations d_in"],
    w: Float[Array, "d_in d_out"],
    b: Float[Array, " d_out"] | None = None,
) -> Float[Array, "*locations d_out"]:
    """Declares that `y` is a dense layer `y = x @ w + b`, however it is computed.

    Use it where the tracer cannot see a layer (`eqfisher.find_layers` reports
    its parameters as unmatched): a blocked `einsum`, a custom primitive, a Pallas
    kernel. The tracer then treats the declared layer as it treats a `x @ w + b` it
    found itself, so K-FAC and EKFAC give it a Kronecker-factored block.

    **Arguments:**

    - `y`: the layer's output, computed from `x`, `w` and `b` in any way.
    - `x`: its input, `(*locations, d_in)`.
    - `w`: its weight as a `(d_in, d_out)` matrix: a parameter leaf, or a transpose
      of one (pass `linear.weight.T` for an `eqx.nn.Linear`).
    - `b`: its bias, a `(d_out,)` parameter leaf, or None.

    **Returns:**

    `y`, unchanged (use it in place of `y`, so that the tag stays in the program).

    Under `jax.vmap`, a weight shared by the mapped axis makes that axis one more
    location; a mapped weight (mapped along its leading axis) declares one layer
    per entry, each with its own Kronecker block (block-diagonal over the entries):

    !!! Example

        ```python
        # FermiNet-style per-group weights w: (groups, d_in, d_out), inputs
        # xs: (batch, groups, d_in); in a model, w is a parameter leaf.
        w, xs = jnp.ones((3, 4, 2)), jnp.ones((32, 3, 4))
        ys = jnp.einsum("ngi,gio->ngo", xs, w)
        ys = jax.vmap(ef.register_dense, in_axes=(1, 1, 0), out_axes=1)(ys, xs, w)
        ```
    """
    operands = (y, x, w) if b is None else (y, x, w, b)
    _check_shapes(y, x, w, b)
    return layer_tag_p.bind(*operands, has_bias=b is not None, groups=0)


def _check_shapes(y, x, w, b) -> None:
    shapes = f"y {y.shape}, x {x.shape}, w {w.shape}" + (
        "" if b is None else f", b {b.shape}"
    )
    if (
        w.ndim != 2
        or x.ndim < 1
        or x.shape[-1] != w.shape[0]
        or y.shape != x.shape[:-1] + (w.shape[1],)
        or (b is not None and b.shape != (w.shape[1],))
    ):
        raise ValueError(
            "`eqfisher.register_dense(y, x, w, b)`: expected y = x @ w + b with "
            f"x (*locations, d_in), w (d_in, d_out), b (d_out,); got {shapes}."
        )
