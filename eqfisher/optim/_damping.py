"""How the K-FAC preconditioner damps the curvature: damping variants as types.

A damping variant turns one curvature block and a damping λ into the block's damped
inverse, itself a block (`precompute`, once per refresh of the cached inverses);
preconditioning is then that block's `mv` (every step).
"""

import abc
import functools
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ScalarLike

from .. import _linalg as linalg
from .._curvature import Curvature
from .._refusal import int_hint
from ..blocks import (
    AbstractBlock,
    DiagonalBlock,
    EigenKroneckerFactored,
    Full,
    KroneckerFactored,
)
from ..blocks.kronecker import shifted_inverses, stacked_pi_damping_shifts


class AbstractDamping(eqx.Module):
    r"""A way to damp and invert a curvature block for preconditioning.

    `kfac`, `kfac_preconditioner` take one as `damping_variant=`: `Tikhonov()`,
    `FactoredTikhonov()`, or a subclass implementing `precompute`.

    !!! Example

        A variant that damps twice as much as `Tikhonov()`; the preconditioned
        gradient after one curvature estimate is $(C + 2\lambda I)^{-1} g$:

        ```python
        class DoubleTikhonov(ef.optim.AbstractDamping):
            def precompute(self, block, damping):
                return ef.optim.tikhonov_inverse(block, 2 * damping)

        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        opt = ef.optim.kfac_preconditioner(
            like=curv,
            damping=0.1,
            damping_variant=DoubleTikhonov(),
            norm_constraint=None,
        )
        direction, _ = opt.update(grads, opt.init(params), params, curvature=curv)
        expected = curv.solve(grads, 0.2)
        for a, b in zip(jax.tree.leaves(direction), jax.tree.leaves(expected)):
            assert jnp.allclose(a, b, atol=1e-5)
        ```
    """

    @abc.abstractmethod
    def precompute(self, block: AbstractBlock, damping: ScalarLike) -> AbstractBlock:
        r"""The damped inverse of `block`, as a block whose `mv` preconditions.

        **Arguments:**

        - `block`: a curvature block.
        - `damping`: $\lambda > 0$.

        **Returns:**

        A block with the same operand structure.
        """

    def invert(self, curvature: Curvature, damping: ScalarLike) -> Curvature:
        """Every block's `precompute`: the damped inverse of a whole `Curvature`
        (the optimiser's cached inverse). A variant may override it to share work
        between blocks."""
        return curvature.map_blocks(lambda b: precomputed(self, b, damping))


def precomputed(
    variant: AbstractDamping, block: AbstractBlock, damping: ScalarLike
) -> AbstractBlock:
    """`variant.precompute(block, damping)`, refused unless it is a block of the
    same operand: a matrix returned was blamed on `Curvature.map_blocks`, a block
    of other parameters on the gradients' `where=`."""
    out = variant.precompute(block, damping)
    want = [s.shape for s in block.in_structure()]
    got = (
        [s.shape for s in out.in_structure()]
        if isinstance(out, AbstractBlock)
        else None
    )
    if got != want:
        if got is not None:
            what = f"a block on shapes {got}"
        elif getattr(out, "shape", None) is not None:
            what = f"an array of shape {tuple(getattr(out, 'shape', ()))}"
        else:
            what = type(out).__name__
        raise TypeError(
            f"`{type(variant).__name__}.precompute(block, damping)` must return a "
            f"block (an `eqfisher.blocks` block) on the same parameters as `block`, "
            f"shapes {want}; got {what}."
        )
    return out


@functools.singledispatch
def tikhonov_inverse(block: AbstractBlock, damping: ScalarLike) -> AbstractBlock:
    r"""$(B + \lambda I)^{-1}$ as a block (exact for the block type).

    A `functools.singledispatch` function: `tikhonov_inverse.register` adds a block
    type.

    **Raises:**

    `TypeError` for a block type nothing was registered for.

    !!! Example

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        block = curv.blocks["layers[1]"]  # G ⊗ A over 3 x 9 parameters
        inverse = ef.optim.tikhonov_inverse(block, 0.1)  # an EigenKroneckerFactored
        dense = jnp.linalg.inv(block.as_matrix() + 0.1 * jnp.eye(27))
        assert jnp.allclose(inverse.as_matrix(), dense, atol=1e-4)
        ```
    """
    raise TypeError(
        f"`eqfisher.optim.tikhonov_inverse(block, ...)`: no damped inverse for a "
        f"`{type(block).__name__}` block; register one for that type with "
        "`eqfisher.optim.tikhonov_inverse.register`."
    )


@tikhonov_inverse.register
def _(block: KroneckerFactored, damping):
    # (G ⊗ A + λI)⁻¹ = (Q_G ⊗ Q_A) diag(1 / (s_G s_Aᵀ + λ)) (Q_G ⊗ Q_A)ᵀ.
    block = block if block.a_eig is not None else block.precompute()
    assert block.a_eig is not None and block.g_eig is not None  # both, or neither
    (s_a, q_a), (s_g, q_g) = block.a_eig, block.g_eig
    damping = jnp.asarray(damping).astype(q_a.dtype)
    scales = 1 / (jnp.maximum(s_g, 0)[:, None] * jnp.maximum(s_a, 0)[None, :] + damping)
    return EigenKroneckerFactored(
        q_a,
        q_g,
        scales.astype(q_a.dtype),
        weight_perm=block.weight_perm,
        structure=block.structure,
    )


@tikhonov_inverse.register
def _(block: EigenKroneckerFactored, damping):
    damping = jnp.asarray(damping).astype(block.scales.dtype)
    return EigenKroneckerFactored(
        block.q_a,
        block.q_g,
        (1 / (jnp.maximum(block.scales, 0) + damping)).astype(block.scales.dtype),
        weight_perm=block.weight_perm,
        structure=block.structure,
    )


@tikhonov_inverse.register
def _(block: DiagonalBlock, damping):
    damping = jnp.asarray(damping).astype(block.diag[0].dtype)
    return DiagonalBlock(tuple((1 / (jnp.maximum(d, 0) + damping)) for d in block.diag))


@tikhonov_inverse.register
def _(block: Full, damping):
    damping = jnp.asarray(damping).astype(block.matrix.dtype)
    values, vectors = linalg.eigh(block.matrix)
    inverse = (vectors / (jnp.maximum(values, 0) + damping)[None, :]) @ vectors.T
    return Full(inverse, block.structure)


@functools.singledispatch
def _factored_inverse(block: AbstractBlock, damping):
    return tikhonov_inverse(block, damping)


@_factored_inverse.register
def _(block: KroneckerFactored, damping):
    return block.pi_damped_inverse(damping)


@functools.singledispatch
def _inverted_together(block: AbstractBlock) -> bool:
    """Whether `FactoredTikhonov.invert` inverts the block's factors with the other
    blocks': a K-FAC block without cached eigendecompositions."""
    return False


@_inverted_together.register
def _(block: KroneckerFactored) -> bool:
    return block.a_eig is None and block.g_eig is None


class Tikhonov(AbstractDamping):
    r"""Exact damping: $(B + \lambda I)^{-1}$ for every block.

    For K-FAC blocks, from the factors' eigendecompositions (an EKFAC-shaped block
    with scales $1 / (s_G s_A + \lambda)$); four matrix products per layer and step.

    !!! Example

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        B = curv.blocks["layers[0]"].as_matrix()  # (40, 40)
        lam = jnp.asarray(0.1)  # λ, a scalar array
        inverse = ef.optim.Tikhonov().precompute(curv.blocks["layers[0]"], lam)
        identity = inverse.as_matrix() @ (B + 0.1 * jnp.eye(40))
        assert jnp.allclose(identity, jnp.eye(40), atol=1e-4)

        opt = ef.optim.kfac(0.1, like=curv, damping_variant=ef.optim.Tikhonov())
        ```
    """

    def precompute(self, block: AbstractBlock, damping: ScalarLike) -> AbstractBlock:
        return tikhonov_inverse(block, damping)


class FactoredTikhonov(AbstractDamping):
    r"""Martens & Grosse's π-damping for K-FAC blocks; exact damping for the others.

    A K-FAC block $G \otimes A$ becomes

    $$
    \Bigl(G + \frac{\sqrt\lambda}{\pi} I\Bigr)^{-1}
    \otimes \bigl(A + \pi \sqrt\lambda\, I\bigr)^{-1}
    $$

    (`KroneckerFactored.pi_damped_inverse`): two Cholesky inverses per refresh and
    two matrix products per layer and step. It damps directions where both factors
    are small much more than $\lambda I$ does.

    A factor wider than `max_inverse_dim` is inverted as its block diagonal: its
    diagonal blocks, as equal as can be and none wider than `max_inverse_dim`, each
    damped and inverted alone (distributed Shampoo's block partitioning). A
    1,025-input factor then costs a 513- and a 512-wide Cholesky inverse instead of
    one 1,025-wide one, less than half the time; $\pi$ is still that of the whole
    factors. A block whose eigendecompositions are cached (`precompute()`) is
    inverted whole, from them.

    **Fields:**

    - `max_inverse_dim`: the widest factor inverted whole (default 1024, from
      the grid in `benchmarks/RESULTS.md`, "Issue 26, third session"), or `None`:
      every factor whole.
    - `on_host`: where the factors inverted together (`invert`) are inverted.
      `None` (the default): on the host where jax's default backend is the CPU,
      else on the device. On the host, all of them are inverted in one
      `jax.pure_callback` by SciPy's LAPACK (Cholesky, and the clamped
      eigendecomposition where it fails), which XLA compiles as one call. A K-FAC
      step then compiles about a quarter faster than with the same inverses in
      XLA (a batched Cholesky per size class with its fallback), and a refresh
      takes from 0.5 ms less to 0.3 ms more on two cores (the callback's own cost;
      more for factors of 384 and wider with one BLAS thread, which the host
      inverts one after another) (`benchmarks/RESULTS.md`, "Issue 26, eighth
      session"). `False`: in XLA
      on every backend, for a step that JAX's persistent compilation cache can
      store or `jax.export` can serialise (neither takes a program that calls back
      into Python). `True`: on the host on every backend.

    **Raises:**

    `ValueError` when `max_inverse_dim` is not a positive integer or `None`, or
    `on_host` not a bool or `None`.

    !!! Example

        The formula above, by hand:

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        block = curv.blocks["layers[0]"]  # A: (5, 5), G: (8, 8)
        A, G, lam = block.a, block.g, jnp.asarray(0.1)
        pi = jnp.sqrt((jnp.trace(A) / 5) / (jnp.trace(G) / 8))
        inverse = ef.optim.FactoredTikhonov().precompute(block, lam)  # Kronecker too
        G_inv = jnp.linalg.inv(G + jnp.sqrt(lam) / pi * jnp.eye(8))
        A_inv = jnp.linalg.inv(A + pi * jnp.sqrt(lam) * jnp.eye(5))
        assert jnp.allclose(inverse.g, G_inv, rtol=1e-4, atol=1e-4)
        assert jnp.allclose(inverse.a, A_inv, rtol=1e-4, atol=1e-4)
        ```

        With `max_inverse_dim=4`, the 8-wide G is inverted as its two 4-wide
        diagonal blocks:

        ```python
        halves = ef.optim.FactoredTikhonov(max_inverse_dim=4).precompute(block, lam)
        shift = jnp.sqrt(lam) / pi * jnp.eye(4)
        top = jnp.linalg.inv(G[:4, :4] + shift)
        assert jnp.allclose(halves.g[:4, :4], top, rtol=1e-4, atol=1e-4)
        assert jnp.all(halves.g[:4, 4:] == 0)
        ```
    """

    max_inverse_dim: int | None = 1024
    on_host: bool | None = None

    def __check_init__(self):
        if self.on_host is not None and not isinstance(self.on_host, bool):
            raise ValueError(
                "`eqfisher.optim.FactoredTikhonov(on_host=...)`: True, False or None "
                f"(on the host on the CPU), got {self.on_host!r}."
            )
        dim = self.max_inverse_dim
        if dim is not None and (
            isinstance(dim, bool) or not isinstance(dim, int) or dim < 1
        ):
            raise ValueError(
                "`eqfisher.optim.FactoredTikhonov(max_inverse_dim=...)`: a positive "
                f"integer or None (every factor inverted whole), got {dim!r}"
                f"{int_hint(dim)}."
            )

    def precompute(self, block: AbstractBlock, damping: ScalarLike) -> AbstractBlock:
        if not _inverted_together(block):
            return _factored_inverse(block, damping)
        stack = jax.tree_util.tree_map(lambda x: x[None], block)
        (inverse,) = self._pi_inverses([cast(KroneckerFactored, stack)], damping)
        return jax.tree_util.tree_map(lambda x: x[0], inverse)

    def invert(self, curvature: Curvature, damping: ScalarLike) -> Curvature:
        """As `precompute` on every block, with the factors of all K-FAC blocks
        (those of stacked layers too) inverted together
        (`blocks.kronecker.shifted_inverses`): on the host in one callback (see
        `on_host`), or in XLA by size class, one program per size class instead of
        one per factor."""
        stacked = {run[0] for run in curvature.runs}
        together = [k for k, b in curvature.stored.items() if _inverted_together(b)]
        rest = [k for k in curvature.stored if k not in together]
        out = curvature.map_blocks(lambda b: precomputed(self, b, damping), rest)
        stacks = [
            curvature.stored[k]
            if k in stacked  # a stack of one otherwise
            else jax.tree_util.tree_map(lambda x: x[None], curvature.stored[k])
            for k in together
        ]
        inverses = self._pi_inverses(cast(list[KroneckerFactored], stacks), damping)
        stored = dict(out.stored)
        for name, new in zip(together, inverses):
            stored[name] = (
                new if name in stacked else jax.tree_util.tree_map(lambda x: x[0], new)
            )
        return eqx.tree_at(lambda c: c.stored, out, stored)

    def _pi_inverses(
        self, stacks: list[KroneckerFactored], damping: ScalarLike
    ) -> list[KroneckerFactored]:
        """The π-damped inverses of stacks of K-FAC blocks (a leading axis each),
        their factors inverted together, the wide ones by their diagonal blocks."""
        pairs = [(b.a, b.g) for b in stacks]
        shifts = stacked_pi_damping_shifts(pairs, damping)
        # Every A, then every G: their shifts are then the two vectors π·√λ and
        # √λ/π in order, which the host callback's one shift operand joins
        # without a slice per factor (XLA merges adjacent slices).
        inverses = partitioned_inverses(
            [b.a for b in stacks] + [b.g for b in stacks],
            [s for s, _ in shifts] + [s for _, s in shifts],
            self.max_inverse_dim,
            self.on_host,
        )
        out = []
        for b, a, g in zip(stacks, inverses, inverses[len(stacks) :]):

            def block(a, g, b=b):
                return KroneckerFactored(
                    a, g, weight_perm=b.weight_perm, structure=b.structure
                )

            out.append(jax.vmap(block)(a, g))
        return out


def _diagonal_blocks(d: int, max_dim: int) -> list[tuple[int, int]]:
    """`(start, size)` of the fewest diagonal blocks of a `d`-wide matrix none wider
    than `max_dim`, their sizes as equal as can be."""
    count = -(-d // max_dim)
    sizes = [d // count + (i < d % count) for i in range(count)]
    starts = [sum(sizes[:i]) for i in range(count)]
    return list(zip(starts, sizes))


def partitioned_inverses(
    factors: list[Array],
    shifts: list[Array],
    max_dim: int | None,
    on_host: bool | None = None,
) -> list[Array]:
    """`blocks.kronecker.shifted_inverses`, with each matrix factor wider than
    `max_dim` replaced by its block diagonal (`_diagonal_blocks`): the inverse is
    block diagonal, each block the shifted inverse of the factor's block."""
    pieces, shifts_of_pieces, plan = [], [], []
    for f, s in zip(factors, shifts):
        wide = f.ndim == 3 and max_dim is not None and f.shape[-1] > max_dim
        parts = _diagonal_blocks(f.shape[-1], cast(int, max_dim)) if wide else None
        plan.append(parts)
        for start, size in parts or [(0, None)]:
            piece = (
                f if size is None else f[:, start : start + size, start : start + size]
            )
            pieces.append(piece)
            shifts_of_pieces.append(s)
    inverses = iter(shifted_inverses(pieces, shifts_of_pieces, on_host))
    out = []
    for f, parts in zip(factors, plan):
        if parts is None:
            out.append(next(inverses))
            continue
        full = jnp.zeros(f.shape, f.dtype)
        for start, size in parts:
            end = start + size
            full = full.at[:, start:end, start:end].set(next(inverses))
        out.append(full)
    return out
