"""Block-by-block maps over a `Curvature`'s operand, and the square root of each block
type's damped inverse (for posterior samples)."""

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._curvature import Curvature, leaf_shapes
from ..blocks import (
    AbstractBlock,
    DiagonalBlock,
    EigenKroneckerFactored,
    Full,
    KroneckerFactored,
)
from ..blocks._layout import from_matrix, rotate_scale, to_matrix


def block_parts(curv: Curvature) -> list[tuple[str, tuple[int, ...], tuple]]:
    """`(name, leaf positions, leaf slices)` for each block of `curv`."""
    slices = curv.leaf_slices or [((),) * len(i) for _, i in curv.leaf_indices]
    return [(n, i, sl) for (n, i), sl in zip(curv.leaf_indices, slices)]


def check_vector(curv: Curvature, vector: PyTree, caller: str) -> list[Array]:
    leaves = jax.tree_util.tree_leaves(vector)
    shapes = [s.shape for s in jax.tree_util.tree_leaves(curv.structure)]
    if leaf_shapes(leaves) != shapes:
        raise ValueError(
            f"`{caller}`: the vector must have the structure of the parameters the "
            f"posterior covers (its leaves' shapes {leaf_shapes(leaves)}, expected "
            f"{shapes})."
        )
    return leaves


def map_blocks(
    curv: Curvature,
    vector: PyTree,
    fn: Callable[[str, AbstractBlock, tuple[Array, ...]], tuple[Array, ...]],
    caller: str,
) -> PyTree:
    """Applies `fn(name, block, parts)` to each block's part of `vector`."""
    leaves = check_vector(curv, vector, caller)
    out = list(leaves)
    for name, idx, sl in block_parts(curv):
        parts = tuple(leaves[i][k] if k else leaves[i] for i, k in zip(idx, sl))
        for i, k, x in zip(idx, sl, fn(name, curv.blocks[name], parts)):
            out[i] = out[i].at[k].set(x) if k else x
    treedef = jax.tree_util.tree_structure(vector)
    return jax.tree_util.tree_unflatten(treedef, out)


def block_values(
    curv: Curvature, vector: PyTree, caller: str
) -> dict[str, tuple[Array, ...]]:
    """Each block's part of `vector`, by block name."""
    leaves = check_vector(curv, vector, caller)
    return {
        name: tuple(leaves[i][k] if k else leaves[i] for i, k in zip(idx, sl))
        for name, idx, sl in block_parts(curv)
    }


def block_size(block: AbstractBlock) -> int:
    return sum(math.prod(s.shape) for s in block.in_structure())


@functools.singledispatch
def sqrt_inverse_mv(
    block: AbstractBlock, vector: tuple[Array, ...], scale, prior
) -> tuple[Array, ...]:
    r"""$(\text{scale} \cdot B + \text{prior} \cdot I)^{-1/2} v$, for one block type.

    It uses the symmetric square root. Applied to a standard normal $v$ it gives a
    sample of $\mathcal{N}(0, (\text{scale} \cdot B + \text{prior} \cdot I)^{-1})$.
    `Laplace.sample` uses it; a new block type registers its own implementation
    with `eqfisher.laplace.sqrt_inverse_mv.register`.

    **Raises:**

    `TypeError` for a block type nothing was registered for.

    !!! Example

        ```python
        root = jax.random.normal(key, (3, 3))
        block = ef.blocks.Full(root @ root.T, (jnp.zeros(3),))
        v = (jnp.ones(3),)
        half = ef.laplace.sqrt_inverse_mv(block, v, 2.0, 0.5)
        (twice,) = ef.laplace.sqrt_inverse_mv(block, half, 2.0, 0.5)
        (inverse,) = block.solve(v, 0.5 / 2.0)  # (B + ¼·I)⁻¹ v = 2·(2·B + ½·I)⁻¹ v
        assert jnp.allclose(twice, inverse / 2.0, rtol=1e-4)
        ```
    """
    raise TypeError(
        f"`eqfisher.laplace.sqrt_inverse_mv(block, ...)`: no posterior samples for "
        f"a `{type(block).__name__}` block; register them for that type with "
        "`eqfisher.laplace.sqrt_inverse_mv.register`."
    )


def _cast(values, structure):
    return tuple(x.astype(s.dtype) for x, s in zip(values, structure))


@sqrt_inverse_mv.register
def _(block: Full, vector, scale, prior):
    flat = jnp.concatenate([jnp.ravel(x) for x in vector]).astype(block.matrix.dtype)
    # Rounding can leave a PSD matrix with small negative eigenvalues: clamped, as
    # `Full.solve` does when its Cholesky factorisation fails.
    eig = block.precompute().eig if block.eig is None else block.eig
    assert eig is not None  # `precompute` fills it
    values, vectors = eig
    factor = 1 / jnp.sqrt(scale * jnp.maximum(values, 0) + prior)
    out = vectors @ (factor * (vectors.T @ flat))
    parts, start = [], 0
    for s in block.structure:
        size = math.prod(s.shape)
        parts.append(out[start : start + size].reshape(s.shape))
        start += size
    return _cast(parts, block.structure)


@sqrt_inverse_mv.register
def _(block: DiagonalBlock, vector, scale, prior):
    out = tuple(
        x.astype(d.dtype) / jnp.sqrt(scale * d + prior)
        for d, x in zip(block.diag, vector)
    )
    return _cast(out, block.in_structure())


@sqrt_inverse_mv.register
def _(block: KroneckerFactored, vector, scale, prior):
    block = block.precompute()  # clamps the factors' eigenvalues at zero
    assert block.a_eig is not None and block.g_eig is not None  # and fills them
    (s_a, q_a), (s_g, q_g) = block.a_eig, block.g_eig
    factor = 1 / jnp.sqrt(scale * s_g[:, None] * s_a[None, :] + prior)
    matrix = to_matrix(
        tuple(x.astype(block.a.dtype) for x in vector), block.weight_perm, q_g.shape[0]
    )
    out = from_matrix(
        rotate_scale(matrix, q_g, q_a, factor), block.weight_perm, block.structure
    )
    return _cast(out, block.structure)


@sqrt_inverse_mv.register
def _(block: EigenKroneckerFactored, vector, scale, prior):
    factor = 1 / jnp.sqrt(scale * block.scales + prior)
    matrix = to_matrix(
        tuple(x.astype(block.scales.dtype) for x in vector),
        block.weight_perm,
        block.q_g.shape[0],
    )
    out = from_matrix(
        rotate_scale(matrix, block.q_g, block.q_a, factor),
        block.weight_perm,
        block.structure,
    )
    return _cast(out, block.structure)


@functools.singledispatch
def prepare_block(block: AbstractBlock) -> AbstractBlock:
    """The block with the factorisations its repeated solves reuse (the
    eigendecompositions of K-FAC's factors and of a dense block), so that tuning the
    prior differentiates no factorisation; other block types unchanged."""
    return block


@prepare_block.register
def _(block: KroneckerFactored) -> AbstractBlock:
    return block.precompute()


@prepare_block.register
def _(block: Full) -> AbstractBlock:
    return block.precompute()
