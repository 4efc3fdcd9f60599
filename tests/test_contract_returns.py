"""Return values checked as Equinox checks them; no parameters; the size guard."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqfisher as ef

from .helpers import compiled_during, dense_ggn


def _setup():
    model = eqx.nn.MLP(3, 2, 4, 1, key=jr.key(0))
    model = jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, model
    )
    x = jr.normal(jr.key(1), (5, 3), jnp.float64)
    t = jr.normal(jr.key(2), (5, 2), jnp.float64)
    return model, (x, t)


def _loss(m, b):
    return ef.squared_error(jax.vmap(m)(b[0]), b[1])


def _pair(m, b):
    return _loss(m, b), {"n": b[0].shape[0]}


def _vector(m, b):
    return jnp.stack([_loss(m, b)] * 3)


def _curvature(loss_fn, model, batch):
    return ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())


def _vgc(loss_fn, model, batch, **kw):
    fn = ef.value_grad_and_curvature(
        loss_fn, estimator=ef.GGN(), structure=ef.KFAC(), **kw
    )
    return fn(model, batch)


@pytest.mark.parametrize(
    "call", [_curvature, ef.ggn_operator, _vgc], ids=["curvature", "ggn", "vgc"]
)
def test_tuple_without_has_aux(call):
    model, batch = _setup()
    with pytest.raises(TypeError, match="has_aux"):
        call(_pair, model, batch)


@pytest.mark.parametrize(
    "call", [_curvature, ef.ggn_operator, _vgc], ids=["curvature", "ggn", "vgc"]
)
def test_non_scalar_loss_names_the_shape(call):
    model, batch = _setup()
    with pytest.raises(ValueError, match=r"scalar, got shape \(3,\)"):
        call(_vector, model, batch)


def test_has_aux_with_a_scalar():
    model, batch = _setup()
    with pytest.raises(TypeError, match=r"has_aux=True.*pair"):
        _vgc(_loss, model, batch, has_aux=True)
    with pytest.raises(TypeError, match=r"surrogate=True.*pair"):
        _vgc(_loss, model, batch, surrogate=True)


def test_has_aux_with_a_non_scalar_loss():
    model, batch = _setup()
    with pytest.raises(ValueError, match=r"scalar, got shape \(3,\)"):
        _vgc(lambda m, b: (_vector(m, b), 0), model, batch, has_aux=True)


def test_has_aux_returns_aux_and_the_exact_curvature():
    model, batch = _setup()
    (value, aux), _, curv = ef.value_grad_and_curvature(
        _pair, estimator=ef.GGN(), structure=ef.Dense(), has_aux=True
    )(model, batch)
    assert aux == {"n": 5}
    ref = dense_ggn(
        lambda m: jax.vmap(m)(batch[0]),
        lambda o: jnp.mean(0.5 * jnp.sum((o - batch[1]) ** 2, -1)),
        model,
    )
    np.testing.assert_allclose(curv.as_matrix(), ref, rtol=1e-10, atol=1e-12)


def _constants(m, b):
    # Constants a `loss_fn` returns in its aux: a BatchNorm state's flag
    # (`jnp.array(False)`), weakly typed scalars, and arrays of a given dtype.
    aux = {
        "flag": jnp.array(False),
        "half": jnp.array(0.5),
        "three": jnp.asarray(3),
        "zero": jnp.zeros(()),
        "two": jnp.array(2.0, jnp.float32),
        "row": jnp.ones(3, jnp.int32),
    }
    return _loss(m, b), aux


def _signature(tree):
    return jax.tree.map(lambda x: (type(x).__name__, x.dtype, x.weak_type), tree)


def test_constant_aux_comes_back_as_jit_returns_it():
    """Constant outputs are arrays of their dtype and weak type, as from
    `eqx.filter_value_and_grad` under `jit`; a Python scalar would be static, and
    passing it back in (a BatchNorm state) would compile the step again."""
    model, batch = _setup()
    (_, expected), _ = eqx.filter_jit(
        eqx.filter_value_and_grad(_constants, has_aux=True)
    )(model, batch)
    vgc = ef.value_grad_and_curvature(
        _constants, estimator=ef.GGN(), structure=ef.KFAC(), has_aux=True
    )
    for call in (vgc, eqx.filter_jit(vgc)):
        (_, aux), _, _ = call(model, batch)
        assert _signature(aux) == _signature(expected)
    like = ef.optim.curvature_like(vgc, model, batch)
    opt = ef.optim.kfac(1e-2, like=like)
    step = ef.optim.kfac_step(
        _constants, opt, estimator=ef.GGN(), structure=ef.KFAC(), has_aux=True
    )
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    model, state, (_, aux) = step(model, state, batch)
    assert _signature(aux) == _signature(expected)
    # The flag goes back in with the batch, as a BatchNorm state does: one compile.
    step(model, state, (*batch, aux["flag"]))
    assert compiled_during(lambda: step(model, state, (*batch, aux["flag"]))) == []


class _NoFloats(eqx.Module):
    table: jax.Array

    def __call__(self, x):
        return x[:, :2] + self.table[:2].astype(x.dtype)


@pytest.mark.parametrize("structure", [ef.Dense(), ef.KFAC()], ids=repr)
def test_no_parameters(structure):
    model = _NoFloats(jnp.arange(3))
    _, batch = _setup()
    with pytest.raises(ValueError, match="no parameter selected") as info:
        ef.curvature(
            lambda m, b: ef.squared_error(m(b[0]), b[1]),
            model,
            batch,
            estimator=ef.GGN(),
            structure=structure,
        )
    assert "optax_mask" not in str(info.value)


def test_empty_where_gives_the_same_error():
    model, batch = _setup()
    with pytest.raises(ValueError, match="no parameter selected") as info:
        ef.curvature(
            _loss,
            model,
            batch,
            estimator=ef.GGN(),
            structure=ef.KFAC(),
            where=ef.filters.by_path("nothing*"),
        )
    assert "optax_mask" not in str(info.value)
    assert "layers[0].weight" in str(info.value)


def test_size_guard():
    # The README's quickstart model: 26,122 parameters, a 5.08 GiB float64 matrix.
    model = eqx.nn.MLP(64, 10, 128, 2, key=jr.key(0))
    model = jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, model
    )
    batch = (jnp.ones((4, 64)), jnp.zeros(4, dtype=jnp.int32))

    def loss_fn(m, b):
        return ef.softmax_cross_entropy(jax.vmap(m)(b[0]), b[1])

    with pytest.raises(ValueError, match=r"5\.08 GiB.*max_gib"):
        ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Dense())
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    with pytest.raises(ValueError, match=r"5\.08 GiB.*as_matrix\(max_gib=...\)"):
        curv.as_matrix()


def test_size_guard_limit_is_an_argument():
    model, batch = _setup()
    with pytest.raises(ValueError, match="GiB"):
        ef.curvature(
            _loss, model, batch, estimator=ef.GGN(), structure=ef.Dense(max_gib=1e-9)
        )
    curv = ef.curvature(_loss, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    with pytest.raises(ValueError, match="GiB"):
        curv.as_matrix(max_gib=1e-9)
    assert curv.as_matrix(max_gib=2).shape == (26, 26)
