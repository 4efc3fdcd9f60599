"""Products at the registered losses' inputs, for the whole parameter PyTree:
`loss_tags_vjp`, `loss_tags_jvp` and `loss_tags_hvp`."""

from collections.abc import Callable

import jax
from jaxtyping import PyTree

from .capture import LossProgram, Split, StagedLoss, split


def _params_fn(processed: LossProgram, s: Split):
    coefs = processed.coefficients(s.inputs)

    def fn(p_leaves):
        ev = processed.run(list(p_leaves) + s.others + s.batch)
        return tuple(t[0] for t in ev.tags), processed.losses(ev, coefs)

    return fn


def _unflatten(s: Split, leaves) -> PyTree:
    return jax.tree_util.tree_unflatten(s.params_def, list(leaves))


def loss_tags_vjp(loss_fn: Callable) -> Callable:
    """`(model, batch) -> (losses, vjp_fn)`; `vjp_fn(tangents)` gives parameter
    cotangents (a PyTree like `eqx.filter(model, eqx.is_inexact_array)`) of the
    registered losses' inputs.

    !!! Example

        The loss's gradient in the logits, pulled back, is the gradient:

        ```python
        losses, vjp_fn = ef.loss_tags_vjp(loss_fn)(model, batch)
        logits = losses[0].inputs  # (32, 3)
        dlogits = (jax.nn.softmax(logits) - jax.nn.one_hot(y, 3)) / 32
        pulled = vjp_fn((dlogits,))  # like params
        for a, b in zip(jax.tree.leaves(pulled), jax.tree.leaves(grads)):
            assert jnp.allclose(a, b, atol=1e-6)
        ```
    """
    staged = StagedLoss(loss_fn, "eqfisher.loss_tags_vjp")

    def transformed(model, batch):
        s = split(model, batch)
        fn = _params_fn(staged.stage(s, layers=False), s)
        _, vjp, losses = jax.vjp(fn, s.params, has_aux=True)
        return losses, lambda tangents: _unflatten(s, vjp(tuple(tangents))[0])

    return transformed


def loss_tags_jvp(loss_fn: Callable) -> Callable:
    """`(model, batch, params_tangent) -> (losses, tangents of the losses' inputs)`.

    !!! Example

        The tangent of the logits, J v, against `eqx.filter_jvp`:

        ```python
        losses, (dlogits,) = ef.loss_tags_jvp(loss_fn)(model, batch, grads)
        _, expected = eqx.filter_jvp(lambda m: jax.vmap(m)(x), (model,), (grads,))
        assert dlogits.shape == (32, 3)
        assert jnp.allclose(dlogits, expected, atol=1e-6)
        ```
    """
    staged = StagedLoss(loss_fn, "eqfisher.loss_tags_jvp")

    def transformed(model, batch, params_tangent):
        s = split(model, batch)
        fn = _params_fn(staged.stage(s, layers=False), s)
        t_leaves = jax.tree_util.tree_leaves(params_tangent)
        _, tangents, losses = jax.jvp(fn, (s.params,), (t_leaves,), has_aux=True)
        return losses, tangents

    return transformed


def loss_tags_hvp(loss_fn: Callable) -> Callable:
    """`(model, batch, params_tangent) -> (losses, H v)`, with H the Hessian of the
    registered losses' values weighted by their coefficients in the value `loss_fn`
    returns, by forward-over-reverse differentiation. The losses come first, as in
    `loss_tags_vjp` and `loss_tags_jvp` (and `jax.jvp`).

    !!! Example

        Here the value is the registered loss itself, so H is the Hessian of
        `loss_fn`:

        ```python
        losses, hv = ef.loss_tags_hvp(loss_fn)(model, batch, grads)
        grad_fn = lambda m: eqx.filter_grad(loss_fn)(m, batch)
        _, expected = eqx.filter_jvp(grad_fn, (model,), (grads,))
        for a, b in zip(jax.tree.leaves(hv), jax.tree.leaves(expected)):
            assert jnp.allclose(a, b, atol=1e-5)
        ```
    """
    staged = StagedLoss(loss_fn, "eqfisher.loss_tags_hvp")

    def transformed(model, batch, params_tangent):
        s = split(model, batch)
        fn = _params_fn(staged.stage(s, layers=False), s)

        def total(p):
            losses = fn(p)[1]
            return sum(loss.value() for loss in losses), losses

        # The losses come out of the same forward as the product (no second run).
        t_leaves = jax.tree_util.tree_leaves(params_tangent)
        (_, losses), (hvp, _) = jax.jvp(
            jax.grad(total, has_aux=True), (s.params,), (t_leaves,)
        )
        return losses, _unflatten(s, hvp)

    return transformed
