"""The matrix view of a layer's parameters, shared by the Kronecker-factored blocks.

The operand `(weight,)` or `(weight, bias)` maps to a matrix M of shape
`(d_out, d_in')`: `jnp.transpose(weight, weight_perm).reshape(d_out, d_in)`, then,
with a bias, `bias.reshape(d_out, 1)` appended as the last column (the bias is the
coefficient of the homogeneous input coordinate 1). Kronecker blocks act on the
row-major vec of M.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._base import Operand, Structure


def check_layout(
    name: str,
    weight_perm: tuple[int, ...],
    structure: Structure,
    d_out: int,
    d_in_total: int,
    d_out_field: str,
    d_in_field: str,
) -> None:
    """Raises `ValueError` unless the factor sizes fit `structure` and `weight_perm`."""
    if len(structure) not in (1, 2):
        raise ValueError(
            f"`{name}(..., structure=...)` must be `(weight,)` or `(weight, bias)`, "
            f"got {len(structure)} leaves."
        )
    weight_shape = structure[0].shape
    if sorted(weight_perm) != list(range(len(weight_shape))):
        raise ValueError(
            f"`{name}(..., weight_perm={weight_perm})` must be a permutation of the "
            f"{len(weight_shape)} axes of the weight, shape {weight_shape}."
        )
    permuted = [weight_shape[i] for i in weight_perm]
    prefixes = [math.prod(permuted[:k]) for k in range(len(permuted) + 1)]
    if d_out not in prefixes:
        raise ValueError(
            f"`{name}`: `{d_out_field}` has size {d_out}, which is not the product of "
            f"leading axes {prefixes} of the permuted weight, shape {tuple(permuted)}."
        )
    has_bias = len(structure) == 2
    if has_bias and math.prod(structure[1].shape) != d_out:
        raise ValueError(
            f"`{name}`: the bias, shape {structure[1].shape}, must have "
            f"{d_out} elements (the size of `{d_out_field}`)."
        )
    expected = math.prod(weight_shape) // d_out + has_bias
    if d_in_total != expected:
        raise ValueError(
            f"`{name}`: `{d_in_field}` has size {d_in_total}, expected {expected} "
            f"(the weight's input size{' plus 1 for the bias' if has_bias else ''})."
        )


def to_matrix(
    vector: Operand, weight_perm: tuple[int, ...], d_out: int
) -> Float[Array, "d_out d_in"]:
    """The matrix view M of an operand `(weight,)` or `(weight, bias)`."""
    weight = jnp.transpose(vector[0], weight_perm).reshape(d_out, -1)
    if len(vector) == 1:
        return weight
    # [W b] as a select of two padded arrays, not a concatenation: XLA:CPU fuses
    # the select into a kernel it compiles once for all layers of one shape, where
    # each `concatenate` is a kernel of its own (an unrolled 32-layer MLP's K-FAC
    # step: XLA compile 1.71 -> 1.49 s on jax 0.12; benchmarks/RESULTS.md, "Issue
    # 26, twenty-eighth session").
    d_in = weight.shape[1]
    bias = vector[1].reshape(d_out, 1)
    column = jax.lax.broadcasted_iota(jnp.int32, (d_out, d_in + 1), 1)
    return jnp.where(
        column < d_in,
        jnp.pad(weight, ((0, 0), (0, 1))),
        jnp.pad(bias, ((0, 0), (d_in, 0))),
    )


def from_matrix(
    matrix: Float[Array, "d_out d_in"],
    weight_perm: tuple[int, ...],
    structure: Structure,
) -> Operand:
    """The operand whose matrix view is `matrix`: the inverse of `to_matrix`."""
    weight_shape = structure[0].shape
    permuted = tuple(weight_shape[i] for i in weight_perm)
    d_in = math.prod(weight_shape) // matrix.shape[0]
    weight = matrix[:, :d_in].reshape(permuted)
    weight = jnp.transpose(weight, tuple(np.argsort(weight_perm)))
    if len(structure) == 1:
        return (weight,)
    return (weight, matrix[:, d_in].reshape(structure[1].shape))


def _operand_positions(
    weight_perm: tuple[int, ...], shapes: tuple[tuple[int, ...], ...], d_out: int
) -> np.ndarray:
    # Entry p is the position in vec(M) of the operand's p-th ravelled coordinate.
    sizes = [math.prod(s) for s in shapes]
    positions = np.arange(sum(sizes))
    leaves = np.split(positions, np.cumsum(sizes)[:-1])
    matrix = np.transpose(leaves[0].reshape(shapes[0]), weight_perm).reshape(d_out, -1)
    if len(shapes) == 2:
        matrix = np.concatenate([matrix, leaves[1].reshape(d_out, 1)], axis=1)
    return np.argsort(matrix.ravel())


def to_operand_order(
    dense: Float[Array, "size size"],
    weight_perm: tuple[int, ...],
    structure: Structure,
    d_out: int,
) -> Float[Array, "size size"]:
    """Reorders a dense matrix from vec(M) order to the operand's ravel order."""
    shapes = tuple(tuple(s.shape) for s in structure)
    order = _operand_positions(weight_perm, shapes, d_out)
    return dense[np.ix_(order, order)]


def rotate_scale(
    matrix: Float[Array, "d_out d_in"],
    q_g: Float[Array, "d_out d_out"],
    q_a: Float[Array, "d_in d_in"],
    factor: Float[Array, "d_out d_in"],
) -> Float[Array, "d_out d_in"]:
    """Q_G [factor ∘ (Q_Gᵀ M Q_A)] Q_Aᵀ: the map (Q_G⊗Q_A) diag(factor) (Q_G⊗Q_A)ᵀ."""
    return q_g @ (factor * (q_g.T @ matrix @ q_a)) @ q_a.T
