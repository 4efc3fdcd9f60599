import abc
import contextlib
import contextvars
import math
from typing import ClassVar, TypeVar, cast

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jaxtyping import Array, Float, ScalarLike


Operand = tuple[Float[Array, "..."], ...]
Structure = tuple[jax.ShapeDtypeStruct, ...]


class AbstractBlock(lx.AbstractLinearOperator):
    """The curvature matrix B (symmetric positive semidefinite) of one layer.

    A block is a `lineax.AbstractLinearOperator` whose operand is a tuple of
    arrays: the layer's parameter leaves, e.g. `(weight, bias)` (a detected
    layer's weight first; `Curvature.leaf_indices` gives their positions).
    Dense matrices (`as_matrix`) order coordinates as
    `jax.flatten_util.ravel_pytree` of that tuple: leaf 0 ravelled row-major, then
    leaf 1, and so on.

    Every block is tagged symmetric and positive semidefinite for lineax, so
    `lineax.linear_solve(block, v, lineax.CG(...))` works. `lineax` cannot tell the
    sign of a scalar held in an array, so wrap a damped sum in
    `lineax.TaggedLinearOperator(block + damping * identity,
    lineax.positive_semidefinite_tag)` before solving it with CG.

    A block type whose `ema` averages what the block is estimated from sets the
    class variable `averages_batches = True` (`Full`, `DiagonalBlock` and
    `KroneckerFactored` do; `EigenKroneckerFactored`'s keeps the newer
    eigenbases): `eqfisher.dataset_curvature` refuses the others.

    `damping` must be a positive scalar, `decay` a scalar in [0, 1], `c` a
    non-negative scalar: a concrete value out of range raises `ValueError`; a
    traced one is checked at run time with `eqx.error_if`.

    !!! Example

        ```python
        curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
        block = curv.blocks["layers[0]"]  # the 4 → 8 layer, a KroneckerFactored block
        v = (grads.layers[0].weight, grads.layers[0].bias)  # its operand: (weight, bias)
        print(block.as_matrix().shape)  # (40, 40): 8·4 weights, then 8 biases

        # The same damped solve by lineax's CG, on the block as an operator.
        damped = lx.TaggedLinearOperator(
            block + 0.1 * lx.IdentityLinearOperator(block.in_structure()),
            lx.positive_semidefinite_tag,
        )
        by_cg = lx.linear_solve(damped, v, lx.CG(rtol=1e-6, atol=1e-6)).value
        exact = block.solve(v, 0.1)  # (B + 0.1·I)⁻¹ v
        assert all(jnp.allclose(p, q, atol=1e-5) for p, q in zip(by_cg, exact))
        ```
    """

    @abc.abstractmethod
    def solve(self, vector: Operand, damping: ScalarLike) -> Operand:
        r"""The exact damped inverse product $(B + \text{damping} \cdot I)^{-1} v$.

        **Arguments:**

        - `vector`: a tuple of arrays shaped like the operand.
        - `damping`: a positive scalar.

        **Returns:**

        A tuple of arrays shaped like `vector`.
        """

    @abc.abstractmethod
    def diagonal(self) -> Operand:
        """The diagonal of B, as a tuple of arrays shaped like the operand."""

    @abc.abstractmethod
    def logdet(self, damping: ScalarLike) -> Float[Array, ""]:
        """log det(B + damping·I), for a positive scalar `damping`."""

    @abc.abstractmethod
    def trace(self) -> Float[Array, ""]:
        """The trace of B."""

    @abc.abstractmethod
    def eigenvalues(self) -> Float[Array, " size"]:
        """All eigenvalues of B (with multiplicity) as a flat vector.

        The order depends on the block type; see its documentation.
        """

    # Whether `ema` averages what the block is estimated from, so that the blocks
    # of several batches, each scaled by `scale` and averaged with weights
    # proportional to their rows, are the block of the batches together
    # (`eqfisher.dataset_curvature` needs it). False unless a block type says so:
    # EKFAC's `ema` keeps the newer eigenbases.
    averages_batches: ClassVar[bool] = False

    @abc.abstractmethod
    def ema(self, other: "AbstractBlock", decay: ScalarLike) -> "AbstractBlock":
        """An exponential moving average `decay·self + (1 − decay)·other`.

        **Arguments:**

        - `other`: a block of the same type and operand structure (the new estimate).
        - `decay`: a scalar in [0, 1]; the weight of `self` (the old estimate).

        **Returns:**

        A block of the same type. See the block type for what is averaged.
        """

    @abc.abstractmethod
    def scale(self, c: ScalarLike) -> "AbstractBlock":
        """The block c·B, for a non-negative scalar `c`."""

    def precompute(self) -> "AbstractBlock":
        """This block with what its repeated solves reuse computed (the
        eigendecompositions of `Full` and `KroneckerFactored`); the block itself
        for a block type that computes nothing ahead."""
        return self

    def transpose(self) -> "AbstractBlock":
        return self

    def out_structure(self) -> Structure:
        return self.in_structure()


# Set while a caller passes the blocks scalars whose range it has established
# (`scalars_checked`).
_SCALARS_CHECKED = contextvars.ContextVar("scalars_checked", default=False)


@contextlib.contextmanager
def scalars_checked():
    """Inside, the traced `damping`, `decay` and `c` given to blocks are taken as
    in range, as their caller made sure (the K-FAC optimiser clips its decay and
    checks its damping once): no runtime check is compiled for them. Each would
    be a host callback in the compiled step, about 10 ms of compile time."""
    token = _SCALARS_CHECKED.set(True)
    try:
        yield
    finally:
        _SCALARS_CHECKED.reset(token)


def _check_real(value, name: str) -> None:
    """`value` a real number: a Python int or float, or an array (NumPy, JAX,
    traced) of a real dtype; not `None`, a string, a bool or a complex number."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None:
        ok = jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        got = f"an array of {dtype}" if dtype is not None else repr(value)
        raise TypeError(
            f"`{name}` must be a real scalar (a float or a scalar array), got {got}."
        )


def check_damping(damping: ScalarLike, dtype) -> Float[Array, ""]:
    """`damping` as a scalar array of `dtype`, after checking it is positive and
    finite, in `dtype` too: a float32 block's damping of 1e-40 is 0 there (a NaN
    solve), one of 1e39 is inf."""
    _check_real(damping, "damping")
    if jnp.shape(damping) != ():
        raise ValueError(f"`damping` must be a scalar, got shape {jnp.shape(damping)}.")
    message = (
        "`damping` must be positive and finite: B + damping·I must be positive "
        "definite."
    )
    if jnp.issubdtype(dtype, jnp.floating):
        info = jnp.finfo(dtype)
        low, high = float(info.tiny), float(info.max)
        message += (
            f" In {jnp.dtype(dtype).name}, the curvature's dtype, that is "
            f"{low:.3g} <= damping <= {high:.3g}."
        )
    else:
        low, high = 0.0, math.inf
    if isinstance(damping, jax.core.Tracer):
        cast = jnp.asarray(damping, dtype)
        if _SCALARS_CHECKED.get():
            return cast
        # `~(0 < d < inf)`, not `d <= 0`: NaN is refused too; and `cast`, the
        # value the block computes with, in range.
        d = jnp.asarray(damping)
        ok = (d > 0) & (d < jnp.inf) & (cast >= low) & (cast <= high)
        return eqx.error_if(cast, ~ok, message)
    value = float(np.asarray(damping))
    if not (0 < value < math.inf and low <= value <= high):
        raise ValueError(f"{message} Got {damping}.")
    return jnp.asarray(damping, dtype)


def check_scalar(value: ScalarLike, name: str, dtype, *, upper: float | None = None):
    """`value` as a scalar array of `dtype`, after checking 0 <= value (<= upper)."""
    _check_real(value, name)
    if jnp.shape(value) != ():
        raise ValueError(f"`{name}` must be a scalar, got shape {jnp.shape(value)}.")
    bounds = "[0, inf)" if upper is None else f"[0, {upper:g}]"
    message = f"`{name}` must lie in {bounds}."
    if isinstance(value, jax.core.Tracer):
        if _SCALARS_CHECKED.get():
            return jnp.asarray(value, dtype)
        x = jnp.asarray(value)
        bad = ~((x >= 0) & (x < jnp.inf))  # NaN refused too
        if upper is not None:
            bad = bad | (x > upper)
        return eqx.error_if(jnp.asarray(value, dtype), bad, message)
    v = float(np.asarray(value))
    if not (0 <= v < math.inf and (upper is None or v <= upper)):
        raise ValueError(f"{message} Got {value}.")
    return jnp.asarray(value, dtype)


_Block = TypeVar("_Block", bound=AbstractBlock)


def check_same(block: _Block, other: AbstractBlock, method: str) -> _Block:
    """`other`, after checking that it has the type and operand structure of `block`."""
    if type(other) is not type(block):
        raise TypeError(
            f"`{type(block).__name__}.{method}(other, ...)` needs `other` of type "
            f"{type(block).__name__}, got {type(other).__name__}."
        )
    if other.in_structure() != block.in_structure():
        raise ValueError(
            f"`{type(block).__name__}.{method}(other, ...)`: `other` acts on "
            f"{other.in_structure()}, but this block on {block.in_structure()}."
        )
    return cast(_Block, other)  # `type(other) is type(block)`, checked above


def structure_size(structure: Structure) -> int:
    return sum(math.prod(s.shape) for s in structure)


def normalise_structure(structure) -> Structure:
    """A tuple of plain `jax.ShapeDtypeStruct` (no sharding, no weak type)."""
    return tuple(jax.ShapeDtypeStruct(tuple(s.shape), s.dtype) for s in structure)


def ravel(vector: Operand) -> Float[Array, " size"]:
    return jnp.concatenate([jnp.ravel(x) for x in vector])


def unravel(flat: Float[Array, " size"], structure: Structure) -> Operand:
    out = []
    start = 0
    for s in structure:
        size = math.prod(s.shape)
        out.append(flat[start : start + size].reshape(s.shape))
        start += size
    return tuple(out)


def check_operand(vector: Operand, structure: Structure, method: str) -> None:
    shapes = tuple(jnp.shape(x) for x in vector)
    if shapes != tuple(s.shape for s in structure):
        raise ValueError(
            f"`{method}(vector, ...)`: `vector` has leaf shapes {shapes}, but the "
            f"block acts on {tuple(s.shape for s in structure)}."
        )


# lineax queries its operators through `functools.singledispatch` functions; each
# needs a registration, or lineax raises `NotImplementedError`.


def register_psd_operator(cls: type) -> type:
    """Registers `cls` with lineax as a real, symmetric, positive-semidefinite operator
    whose `diagonal()` method returns the diagonal as a PyTree like the operand.

    Used for `AbstractBlock` (dispatch follows the MRO, so every block is covered;
    `DiagonalBlock` overrides the structural tags in its own file) and for `Curvature`.
    """
    for query in (lx.is_symmetric, lx.is_positive_semidefinite):
        query.register(cls)(lambda operator: True)
    register_unstructured(cls)
    for transform in (lx.linearise, lx.materialise, lx.conj):  # conj: real operators
        transform.register(cls)(lambda operator: operator)
    lx.diagonal.register(cls)(
        lambda operator: ravel(tuple(jax.tree_util.tree_leaves(operator.diagonal())))
    )

    @lx.tridiagonal.register(cls)
    def _(operator):
        matrix = operator.as_matrix()
        return (
            jnp.diagonal(matrix),
            jnp.diagonal(matrix, offset=-1),
            jnp.diagonal(matrix, offset=1),
        )

    return cls


def register_unstructured(cls: type) -> None:
    """Registers `cls` with lineax as neither negative semidefinite nor diagonal,
    tridiagonal, triangular or of unit diagonal."""
    for query in (
        lx.is_negative_semidefinite,
        lx.is_diagonal,
        lx.is_tridiagonal,
        lx.is_lower_triangular,
        lx.is_upper_triangular,
        lx.has_unit_diagonal,
    ):
        query.register(cls)(lambda operator: False)


register_psd_operator(AbstractBlock)
