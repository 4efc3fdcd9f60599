"""Models with lax.cond and BatchNorm: handled exactly where eqfisher can, refused
with a clear message where it cannot; never a crash. (Scans: test_scan.py.)"""

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqfisher as ef

from .helpers import dense_ggn


F64 = jnp.float64


class Branchy(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __call__(self, x, flag):
        return jax.lax.cond(flag, lambda z: self.a(z), lambda z: self.b(z), x)


def ce(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def _data(n_in, n_classes):
    x = jax.random.normal(jax.random.key(1), (6, n_in), F64)
    y = jax.random.randint(jax.random.key(2), (6,), 0, n_classes)
    return x, y


def test_cond_layers_are_reported_with_the_reason():
    key = jax.random.key(0)
    model = Branchy(
        eqx.nn.Linear(4, 3, dtype=F64, key=key), eqx.nn.Linear(4, 3, dtype=F64, key=key)
    )
    x, y = _data(4, 3)

    def loss(model, batch):
        x, y = batch
        out = jax.vmap(lambda z: model(z, True))(x)
        return ef.softmax_cross_entropy(out, y)

    report = ef.find_layers(loss, model, (x, y))
    assert report.layers == ()
    assert all("`cond`" in r for r in report.reasons)
    curv = ef.curvature(loss, model, (x, y), estimator=ef.GGN(), structure=ef.Dense())
    ref = dense_ggn(
        lambda m: jax.vmap(lambda z: m(z, True))(x),
        lambda o: -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(o), y[:, None], 1)),
        model,
    )
    np.testing.assert_allclose(curv.as_matrix(), ref, atol=1e-12)


def test_batchnorm_is_refused_with_a_message():
    class Net(eqx.Module):
        lin: eqx.nn.Linear
        bn: eqx.nn.BatchNorm

        def __init__(self, key):
            self.lin = eqx.nn.Linear(4, 3, dtype=F64, key=key)
            self.bn = eqx.nn.BatchNorm(3, "batch", mode="batch", dtype=F64)

        def __call__(self, x, state):
            return self.bn(self.lin(x), state)

    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    x, y = _data(4, 3)

    def loss(model, batch):
        x, y, state = batch
        out, _ = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(x, state)
        return ef.softmax_cross_entropy(out, y)

    with pytest.raises(ValueError, match="BatchNorm"):
        ef.curvature(
            loss, model, (x, y, state), estimator=ef.GGN(), structure=ef.Diagonal()
        )


class _CheckpointedLoop(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __call__(self, x):
        def body(carry):
            i, h = carry
            return i + 1, jnp.tanh(self.b(h))

        _, h = eqxi.while_loop(
            lambda c: c[0] < 2, body, (0, self.a(x)), max_steps=4, kind="checkpointed"
        )
        return h


def test_a_checkpointed_while_loop_is_found_and_refused_by_jax_not_crashed():
    # `eqx.internal.while_loop(kind="checkpointed")` (diffrax's adjoint) made the
    # tracer fail with an IndexError (a custom_jvp call with no outputs). Its
    # layers are now reported; the curvature meets JAX's own refusal, because
    # the inlined loop has no reverse-mode derivative (docs/layers.md).
    model = _CheckpointedLoop(
        eqx.nn.Linear(3, 3, dtype=F64, key=jax.random.key(0)),
        eqx.nn.Linear(3, 3, dtype=F64, key=jax.random.key(1)),
    )
    x = jax.random.normal(jax.random.key(2), (4, 3), F64)

    def loss(model, batch):
        return ef.squared_error(jax.vmap(model)(batch[0]), batch[1])

    batch = (x, jnp.zeros((4, 3), F64))
    report = ef.find_layers(loss, model, batch)
    assert [layer.name for layer in report.layers] == ["a"]
    assert len(report.unmatched) == 2
    assert all("`while`" in reason for reason in report.reasons)
    with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
        ef.curvature(loss, model, batch, estimator=ef.GGN(), structure=ef.Diagonal())
