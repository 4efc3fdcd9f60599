"""The small classification problem the optimiser tests share (test_optim.py,
test_graft.py): an MLP 3-8-2, 64 points, the GGN in K-FAC form. The problem and its
curvature template are built once, so tests that use the same configuration reuse
one compilation."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp

import eqfisher as ef


@ft.cache
def problem():
    key = jax.random.key(0)
    model = eqx.nn.MLP(3, 2, 8, 1, activation=jnp.tanh, key=key)
    w = jax.random.normal(jax.random.key(1), (3, 2))
    x = jax.random.normal(jax.random.key(2), (64, 3))
    y = jnp.argmax(x @ w, axis=-1)
    return model, (x, y)


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


VGC = ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=ef.KFAC())


@ft.cache
def like():
    model, batch = problem()
    return ef.optim.curvature_like(VGC, model, batch)
