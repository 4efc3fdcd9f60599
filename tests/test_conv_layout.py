"""Convolutions evaluated channels-last with an HWOI kernel (`conv_layout`): the
same values and derivatives as the equation as written, for every layout and
window option; and a K-FAC step whose statistics pull back through a CNN inside a
`lax.cond` compiles every convolution into XLA:CPU's channels-last form."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqfisher as ef
from eqfisher._tracer.program.conv_layout import conv_evaluator


F64 = jnp.float64

# (input shape, kernel shape, dimension numbers, window options)
CONVS = {
    "nchw": ((3, 2, 6, 5), (4, 2, 3, 3), ("NCHW", "OIHW", "NCHW"), {}),
    "nhwc": ((3, 6, 5, 2), (3, 3, 2, 4), ("NHWC", "HWIO", "NHWC"), {}),
    "mixed": ((2, 6, 3, 5), (3, 4, 3, 3), ("NHCW", "HOWI", "CNWH"), {}),
    "strided": (
        (2, 2, 7, 6),
        (3, 2, 3, 2),
        ("NCHW", "OIHW", "NCHW"),
        dict(window_strides=(2, 3), padding=((1, 2), (0, 1))),
    ),
    "dilated": (
        (2, 2, 7, 7),
        (3, 2, 2, 3),
        ("NCHW", "OIHW", "NCHW"),
        dict(lhs_dilation=(2, 1), rhs_dilation=(1, 2), padding=((1, 1), (2, 0))),
    ),
    "1d": ((2, 3, 9), (4, 3, 4), ("NCH", "OIH", "NCH"), dict(window_strides=(2,))),
    "3d": (
        (2, 2, 4, 5, 3),
        (3, 2, 2, 3, 2),
        ("NCHWD", "OIHWD", "NCHWD"),
        dict(padding="SAME"),
    ),
}


def _conv(x, w, dn, options):
    options = {"window_strides": (1,) * (x.ndim - 2), "padding": "VALID", **options}
    return jax.lax.conv_general_dilated(x, w, dimension_numbers=dn, **options)


def _evaluator(x, w, dn, options):
    jaxpr = jax.make_jaxpr(lambda x, w: _conv(x, w, dn, options))(x, w)
    (eqn,) = jaxpr.jaxpr.eqns
    evaluate = conv_evaluator(eqn)
    assert evaluate is not None
    return lambda x, w: evaluate(x, w)[0]


@pytest.mark.parametrize("name", list(CONVS))
def test_same_values_and_derivatives(name):
    x_shape, w_shape, dn, options = CONVS[name]
    kx, kw, kt = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape, F64)
    w = jax.random.normal(kw, w_shape, F64)
    written = lambda x, w: _conv(x, w, dn, options)  # noqa: E731
    relaid = _evaluator(x, w, dn, options)

    expected, pull = jax.vjp(written, x, w)
    actual, pull_relaid = jax.vjp(relaid, x, w)
    np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=1e-12)
    cotangent = jax.random.normal(kt, expected.shape, F64)
    for a, e in zip(pull_relaid(cotangent), pull(cotangent)):
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-12)
    tangents = (jnp.cos(x), jnp.sin(w))
    _, jvp = jax.jvp(written, (x, w), tangents)
    _, jvp_relaid = jax.jvp(relaid, (x, w), tangents)
    np.testing.assert_allclose(jvp_relaid, jvp, rtol=1e-12, atol=1e-12)


def test_grouped_convolutions_are_left_as_written():
    x = jnp.ones((2, 4, 5, 5), F64)
    w = jnp.ones((6, 2, 3, 3), F64)

    def grouped(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=2)

    (eqn,) = jax.make_jaxpr(grouped)(x, w).jaxpr.eqns
    assert conv_evaluator(eqn) is None
    (eqn,) = jax.make_jaxpr(jnp.sin)(x).jaxpr.eqns
    assert conv_evaluator(eqn) is None


class _CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(4, 4, 3, padding=1, key=k2)
        self.head = eqx.nn.Linear(4 * 6 * 6, 3, key=k3)

    def __call__(self, x):
        x = jax.nn.relu(self.conv1(x))
        x = jax.nn.relu(self.conv2(x))
        return self.head(x.ravel())


def _loss(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's layouts")
def test_kfac_step_convolutions_are_channels_last_inside_the_cond():
    model = _CNN(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 1, 6, 6))
    batch = (x, jnp.arange(8) % 3)
    estimator, structure = ef.FisherMC(), ef.KFAC()
    vgc = ef.value_grad_and_curvature(_loss, estimator=estimator, structure=structure)
    key = jax.random.key(2)
    opt = ef.optim.kfac(1e-2, like=ef.optim.curvature_like(vgc, model, batch, key=key))
    step = ef.optim.kfac_step(
        _loss,
        opt,
        estimator=estimator,
        structure=structure,
        curvature_update_period=2,
    )
    params, static = eqx.partition(model, eqx.is_inexact_array)
    state = opt.init(params)

    def run(params, state, batch, key):
        out, state, loss = step(eqx.combine(params, static), state, batch, key)
        return eqx.filter(out, eqx.is_inexact_array), state, loss

    hlo = jax.jit(run).lower(params, state, batch, key).compile().as_text()
    labels = re.findall(r" convolution\(.*?dim_labels=([^,\s]+)", hlo)
    # The forward, the weights' and the input's cotangents in the main path, and
    # the input's cotangent of the sampled labels inside the statistics' cond.
    assert len(labels) >= 4
    assert all(re.fullmatch(r"b\d+f_\d+io->b\d+f", label) for label in labels), labels
