"""How the examples of a batch relate inside `loss_fn`: a typed option of `curvature`
and `value_grad_and_curvature`, for the structures that need per-example vectors
(`Dense`, `BlockDiagonal`, `Diagonal`, EKFAC's scales, K-FAC's exact diagonal
blocks)."""

import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree


class AbstractExamples(eqx.Module):
    """How the examples of a batch relate inside `loss_fn`.

    `IndependentExamples` and `InteractingExamples` are its two kinds; both give
    the exact curvature, the first at a much lower cost.

    !!! Example

        For examples that do not interact, both give the same matrix:

        ```python
        def exact_diagonal(examples: ef.AbstractExamples):
            curv = ef.curvature(
                loss_fn,
                model,
                batch,
                estimator=ef.GGN(),
                structure=ef.Diagonal(),
                examples=examples,
            )
            return curv.as_matrix()

        independent = exact_diagonal(ef.IndependentExamples())
        interacting = exact_diagonal(ef.InteractingExamples())
        assert jnp.allclose(independent, interacting, atol=1e-6)
        ```
    """


class IndependentExamples(AbstractExamples):
    """Examples do not interact inside `loss_fn` (the default).

    Per-example vectors come from re-running `loss_fn` on one example at a time; the
    outputs of that run, and their derivative along a fixed pseudo-random parameter
    direction, are compared with the same example's in the full batch, and a
    mismatch (batch statistics, shared randomness, a wrong example axis, a
    straight-through `m - jax.lax.stop_gradient(m)` of a batch mean, zero in value
    but not in derivative) raises an error.

    **Arguments:**

    - `axis`: where the example axis is in the batch's arrays: an int for all of
      them, or a PyTree prefix of `batch` of ints (or `None` for arrays shared by
      all examples), as `jax.vmap`'s `in_axes`. Default 0; time-major data
      `(T, N, F)` with labels `(N,)` is `axis=(1, 0)`. Scalar arrays are always
      shared. Each registered loss's example axis is found by comparison with the
      one-example run.

    !!! Example

        Inputs stored feature-major, `(4, 32)`, with labels `(32,)`:

        ```python
        def loss_t(model, batch):
            xt, y = batch
            return ef.softmax_cross_entropy(jax.vmap(model, in_axes=1)(xt), y)

        curv = ef.curvature(
            loss_t,
            model,
            (x.T, y),
            estimator=ef.GGN(),
            structure=ef.Diagonal(),
            examples=ef.IndependentExamples(axis=(1, 0)),
        )
        usual = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Diagonal()
        )
        assert jnp.allclose(curv.as_matrix(), usual.as_matrix(), atol=1e-6)
        ```
    """

    axis: PyTree[int | None] = eqx.field(static=True, default=0)


class InteractingExamples(AbstractExamples):
    r"""Examples interact inside `loss_fn` (BatchNorm with batch statistics, ...).

    The exact curvature then comes from full-batch products: one VJP through the
    whole batch per loss output coordinate (`GGN`, `FisherExact`), or per example
    (`EmpiricalFisher`, `FisherMC`), so its cost is about batch × outputs backward
    passes, against one per-example pass for `IndependentExamples`.

    **Arguments:**

    - `axis`: the example axis among each registered loss's leading axes (for
      `EmpiricalFisher` and `FisherMC`, whose vectors belong to whole examples).

    !!! Example

        A hidden layer normalised with batch statistics, against the exact GGN
        $\sum_n J_n^\top H_n J_n$ from `jax.jacfwd` ($J_n$: the Jacobian of example
        $n$'s logits in all parameters, through the batch statistics):

        ```python
        from jax.flatten_util import ravel_pytree

        def features(model, x):  # (32, 4) -> (32, 8), normalised over the batch
            h = jnp.tanh(jax.vmap(model.layers[0])(x))
            return (h - h.mean(axis=0)) / (h.std(axis=0) + 1e-3)

        def loss_bn(model, batch):
            x, y = batch
            logits = jax.vmap(model.layers[1])(features(model, x))
            return ef.softmax_cross_entropy(logits, y)

        curv = ef.curvature(
            loss_bn,
            model,
            batch,
            estimator=ef.GGN(),
            structure=ef.Dense(),
            examples=ef.InteractingExamples(),
        )

        theta, unravel = ravel_pytree(params)
        static = eqx.filter(model, eqx.is_inexact_array, inverse=True)

        def logits(theta):
            m = eqx.combine(unravel(theta), static)
            return jax.vmap(m.layers[1])(features(m, x))

        J = jax.jacfwd(logits)(theta)  # (32, 3, 67)
        p = jax.nn.softmax(logits(theta))
        H = (jax.vmap(jnp.diag)(p) - p[:, :, None] * p[:, None, :]) / 32
        ggn = jnp.einsum("nip,nij,njq->pq", J, H, J)
        assert jnp.allclose(curv.as_matrix(), ggn, atol=1e-5)
        ```
    """

    axis: int = eqx.field(static=True, default=0)


def split_along(v: Array, axes: tuple[int, ...]) -> Array:
    """`(k, *leading, out)` vectors → `(P·k, *leading, out)`, P the number of index
    combinations along the given leading `axes`, each new vector nonzero at one
    combination only."""
    axes = tuple(1 + a for a in axes)
    rest = [a for a in range(1, v.ndim) if a not in axes]
    moved = jnp.transpose(v, (0,) + axes + tuple(rest))
    k = v.shape[0]
    p = math.prod(v.shape[a] for a in axes)
    flat = moved.reshape((k, p, -1))
    out = jnp.einsum("kqr,pq->pkqr", flat, jnp.eye(p, dtype=v.dtype))
    out = out.reshape((p * k,) + moved.shape[1:])
    perm = (0,) + axes + tuple(rest)
    return jnp.transpose(out, tuple(int(i) for i in np.argsort(perm)))
