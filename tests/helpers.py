"""Dense float64 references written without eqfisher.

Every curvature quantity eqfisher computes is compared against these: Jacobians by
`jax.jacfwd`, loss Hessians by `jax.hessian`, GGN = Jᵀ H J, the Hessian of the
ravelled parameters by `jax.hessian`, and the empirical Fisher from
`jax.vmap(jax.grad(...))`.
"""

import logging
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree


def tree_allclose(x, y, *, rtol=1e-10, atol=1e-10) -> bool:
    """True when two PyTrees have the same structure and allclose leaves."""
    if jax.tree_util.tree_structure(x) != jax.tree_util.tree_structure(y):
        return False
    return all(
        np.shape(a) == np.shape(b) and np.allclose(a, b, rtol=rtol, atol=atol)
        for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y))
    )


def ravelled(model):
    """`(flat_params, rebuild)` where `rebuild(flat)` gives back a full model."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, unravel = ravel_pytree(params)
    return flat, lambda f: eqx.combine(unravel(f), static)


def dense_ggn(outputs_fn: Callable, loss_of_outputs: Callable, model) -> np.ndarray:
    """Jᵀ H J with J = d outputs / d params (jacfwd) and H = d² loss / d outputs².

    `outputs_fn(model)` returns the model outputs (any shape), `loss_of_outputs(out)`
    the scalar loss as a function of those outputs. Rows and columns follow
    `ravel_pytree(eqx.filter(model, eqx.is_inexact_array))`.
    """
    flat, rebuild = ravelled(model)
    out = outputs_fn(model)
    jac = jax.jacfwd(lambda f: outputs_fn(rebuild(f)))(flat)
    jac = jac.reshape(out.size, flat.size)
    hess = jax.hessian(lambda o: loss_of_outputs(o.reshape(out.shape)))(out.ravel())
    return np.asarray(jac.T @ hess @ jac)


def dense_ggn_cross_entropy(model, x, labels) -> np.ndarray:
    """`dense_ggn` of the mean softmax cross-entropy of `jax.vmap(model)(x)` against
    integer `labels`, averaged over every leading axis (examples, positions)."""

    def loss(out):
        onehot = jax.nn.one_hot(labels, out.shape[-1], dtype=out.dtype)
        return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(out), axis=-1))

    return dense_ggn(lambda m: jax.vmap(m)(x), loss, model)


def dense_hessian(loss_of_model: Callable, model) -> np.ndarray:
    """The Hessian of `loss_of_model(model)` with respect to the ravelled parameters."""
    flat, rebuild = ravelled(model)
    return np.asarray(jax.hessian(lambda f: loss_of_model(rebuild(f)))(flat))


def dense_empirical_fisher(
    per_example_loss: Callable, model, batch, weights=None
) -> np.ndarray:
    """Σₙ wₙ ∇ℓₙ ∇ℓₙᵀ with per-example gradients from `jax.vmap(jax.grad(...))`.

    `per_example_loss(model, example)` is the loss of one example; `weights` default
    to 1/N (the mean).
    """
    flat, rebuild = ravelled(model)
    grads = jax.vmap(
        jax.grad(lambda f, ex: per_example_loss(rebuild(f), ex)), (None, 0)
    )(flat, batch)
    n = grads.shape[0]
    w = jnp.full((n,), 1.0 / n) if weights is None else jnp.asarray(weights)
    return np.asarray(jnp.einsum("n,ni,nj->ij", w, grads, grads))


def block_slices(model) -> list[slice]:
    """The slice of each parameter leaf in `ravel_pytree` order."""
    params = eqx.filter(model, eqx.is_inexact_array)
    out, start = [], 0
    for leaf in jax.tree_util.tree_leaves(params):
        out.append(slice(start, start + leaf.size))
        start += leaf.size
    return out


def perturbed(model, key, scale=0.3):
    """`model` with normal noise added to every parameter: LayerNorm scales and
    shifts away from 1 and 0, so that every entry of a reference is informative."""
    leaves, tree = jax.tree_util.tree_flatten(eqx.filter(model, eqx.is_inexact_array))
    keys = jax.random.split(key, len(leaves))
    leaves = [
        x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)
    ]
    return eqx.combine(jax.tree_util.tree_unflatten(tree, leaves), model)


def compiled_during(call) -> list[str]:
    """The messages of the compilations that `call()` (results waited for) ran:
    `jax.log_compiles`' records, caught from the "jax" logger."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            jax.block_until_ready(jax.tree_util.tree_leaves(call()))
    finally:
        logger.removeHandler(handler)
    return [r.getMessage() for r in records if "Compiling" in r.getMessage()]
