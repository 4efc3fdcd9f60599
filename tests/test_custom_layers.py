"""Layers declared with `eqfisher.register_dense`, where the detector sees none:
FermiNet-style per-group weights in one blocked `einsum`, and a matmul computed by
a custom primitive. K-FAC factors are checked against float64 factors built by
hand from `jax.jacfwd`, the exact structures against a `jax.jacfwd` GGN."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

import eqfisher as ef

from .helpers import dense_ggn, ravelled


F64 = jnp.float64
N, GROUPS, IN, HID, OUT = 5, 3, 4, 2, 3


# A matmul the tracer cannot look into: a primitive of its own, differentiated by
# a JVP rule written with ordinary operations (so that JAX transposes it).
matmul_p = Primitive("test_opaque_matmul")
matmul_p.def_impl(lambda x, w: jnp.matmul(x, w))
matmul_p.def_abstract_eval(
    lambda x, w: jax.core.ShapedArray(x.shape[:-1] + w.shape[-1:], x.dtype)
)
mlir.register_lowering(
    matmul_p, mlir.lower_fun(lambda x, w: jnp.matmul(x, w), multiple_results=False)
)


def _matmul_jvp(primals, tangents):
    (x, w), (tx, tw) = primals, map(ad.instantiate_zeros, tangents)
    return matmul_p.bind(x, w), jnp.matmul(tx, w) + jnp.matmul(x, tw)


def _matmul_batch(args, dims):
    (x, w), (dx, dw) = args, dims
    if dw is None:  # a shared weight: the mapped axis is one more row axis
        return matmul_p.bind(jnp.moveaxis(x, dx, 0), w), 0
    size = x.shape[dx] if dx is not None else w.shape[dw]
    x = batching.bdim_at_front(x, dx, size)
    return jnp.einsum("b...i,bio->b...o", x, jnp.moveaxis(w, dw, 0)), 0


ad.primitive_jvps[matmul_p] = _matmul_jvp
batching.primitive_batchers[matmul_p] = _matmul_batch


class Grouped(eqx.Module):
    """One `(IN, HID)` weight and bias per group, applied by one blocked einsum."""

    weight: jax.Array
    bias: jax.Array

    def __call__(self, x):  # x: (N, GROUPS, IN)
        y = jnp.einsum("ngi,gio->ngo", x, self.weight) + self.bias[None]
        tag = jax.vmap(ef.register_dense, in_axes=(1, 1, 0, 0), out_axes=1)
        return tag(y, x, self.weight, self.bias)


class Opaque(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __call__(self, x):  # x: (N, GROUPS, IN), the weight shared by the groups
        y = matmul_p.bind(x, self.weight) + self.bias[None, None]
        return ef.register_dense(y, x, self.weight, self.bias)


class Model(eqx.Module):
    first: eqx.Module
    head: eqx.nn.Linear

    def __call__(self, x):
        h = jnp.tanh(self.first(x))
        return jax.vmap(self.head)(h.reshape(x.shape[0], -1))


def _build(kind: str) -> tuple[Model, tuple]:
    k = jr.split(jr.key(0), 6)
    shape = (GROUPS, IN, HID) if kind == "grouped" else (IN, HID)
    b_shape = (GROUPS, HID) if kind == "grouped" else (HID,)
    cls = Grouped if kind == "grouped" else Opaque
    first = cls(jr.normal(k[0], shape, F64), jr.normal(k[1], b_shape, F64))
    head = eqx.nn.Linear(GROUPS * HID, OUT, key=k[2], dtype=F64)
    x = jr.normal(k[3], (N, GROUPS, IN), F64)
    y = jr.normal(k[4], (N, OUT), F64)
    return Model(first, head), (x, y)


def _loss(model, batch):
    x, y = batch
    return ef.squared_error(model(x), y)


def _per_example(out, y):
    return 0.5 * jnp.sum((out - y) ** 2)


# name: (layer name -> (group index, or None for all groups))
CASES = {
    "grouped": {f"first[{g}]": g for g in range(GROUPS)},
    "opaque": {"first": None},
}


def _first_outputs(model: Model, x):
    """The first layer's pre-activation `(N, GROUPS, HID)`, computed plainly."""
    w, b = model.first.weight, model.first.bias
    if w.ndim == 3:
        return jnp.einsum("ngi,gio->ngo", x, w) + b[None]
    return x @ w + b[None, None]


def _hand_factors(model: Model, batch, group):
    """A = mean over rows of [x; 1][x; 1]ᵀ, G = (1/N) Σ_n Σ_rows Jᵀ H J, with J the
    Jacobian of example n's output with respect to the layer output at that row."""
    x, y = batch
    z = _first_outputs(model, x)

    def out_of_z(z_n):
        return model.head(jnp.tanh(z_n).reshape(-1))

    jac = jax.vmap(jax.jacfwd(out_of_z))(z)  # (N, OUT, GROUPS, HID)
    hess = jax.vmap(jax.hessian(_per_example))(jax.vmap(out_of_z)(z), y)
    groups = range(GROUPS) if group is None else [group]
    rows = jnp.concatenate([x[:, g] for g in groups])
    a = jnp.concatenate([rows, jnp.ones((rows.shape[0], 1), F64)], axis=1)
    g_factor = sum(
        jnp.einsum("noh,nop,npk->hk", jac[:, :, g], hess, jac[:, :, g]) for g in groups
    )
    return a.T @ a / a.shape[0], g_factor / N


@pytest.mark.parametrize("kind", CASES)
def test_declared_layers_are_found(kind):
    model, batch = _build(kind)
    report = ef.find_layers(_loss, model, batch, strict=True)
    names = [(li.name, li.kind) for li in report.layers]
    assert names == [(name, "dense") for name in CASES[kind]] + [("head", "dense")]


@pytest.mark.parametrize("kind", CASES)
def test_undeclared_layers_are_not_found(kind):
    model, batch = _build(kind)

    def undeclared(model, batch):
        x, y = batch
        first = model.first
        if kind == "grouped":
            z = jnp.einsum("ngi,gio->ngo", x, first.weight) + first.bias[None]
        else:
            z = matmul_p.bind(x, first.weight) + first.bias[None, None]
        out = jax.vmap(model.head)(jnp.tanh(z).reshape(N, -1))
        return ef.squared_error(out, y)

    report = ef.find_layers(undeclared, model, batch)
    assert ".first.weight" in report.unmatched
    assert all(".first.weight" not in li.param_paths for li in report.layers)


@pytest.mark.parametrize("kind", CASES)
def test_declared_kfac_factors_by_hand(kind):
    model, batch = _build(kind)
    curv = ef.curvature(_loss, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    for name, group in CASES[kind].items():
        a, g = _hand_factors(model, batch, group)
        block = curv.blocks[name]
        assert isinstance(block, ef.blocks.KroneckerFactored)
        np.testing.assert_allclose(block.a, a, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(block.g, g, rtol=1e-10, atol=1e-12)


def _reference_ggn(model: Model, batch) -> np.ndarray:
    x, y = batch
    return dense_ggn(
        lambda m: m(x), lambda out: jnp.mean(jax.vmap(_per_example)(out, y)), model
    )


def _block_ids(model: Model) -> np.ndarray:
    """The block of each ravelled parameter: per group (weight and bias) for the
    grouped layer, per layer otherwise."""
    ids = jax.tree_util.tree_map(lambda leaf: np.zeros(leaf.shape), model)
    first = ids.first
    if first.weight.ndim == 3:
        per_group = np.arange(GROUPS, dtype=float)
        first = Grouped(
            np.broadcast_to(per_group[:, None, None], first.weight.shape),
            np.broadcast_to(per_group[:, None], first.bias.shape),
        )
    head = eqx.tree_at(
        lambda h: (h.weight, h.bias),
        ids.head,
        (ids.head.weight + 99, ids.head.bias + 99),
    )
    flat, _ = ravelled(Model(first, head))
    return np.asarray(flat)


@pytest.mark.parametrize("kind", CASES)
def test_declared_exact_structures_against_jacfwd(kind):
    model, batch = _build(kind)
    ref = _reference_ggn(model, batch)
    dense = ef.curvature(_loss, model, batch, estimator=ef.GGN(), structure=ef.Dense())
    np.testing.assert_allclose(dense.as_matrix(), ref, rtol=1e-10, atol=1e-12)
    blocks = ef.curvature(
        _loss, model, batch, estimator=ef.GGN(), structure=ef.BlockDiagonal()
    )
    ids = _block_ids(model)
    mask = ids[:, None] == ids[None, :]
    np.testing.assert_allclose(blocks.as_matrix(), ref * mask, rtol=1e-10, atol=1e-12)


def test_register_dense_shape_error(unchecked):
    x, w = jnp.ones((5, 4)), jnp.ones((4, 2))
    with pytest.raises(ValueError, match="register_dense"):
        ef.register_dense(jnp.ones((5, 3)), x, w)


def test_an_unused_declaration_is_named():
    """`register_dense`'s result dropped: the declaration claims the weight from the
    dense layer the tracer would find, so the parameters are reported with the
    mistake and its fix rather than as "no layer pattern"."""
    lin = eqx.nn.Linear(IN, OUT, key=jr.key(0))
    x, y = jnp.ones((N, IN)), jnp.arange(N) % OUT

    def loss_fn(model, batch):
        x, y = batch
        out = x @ model.weight.T + model.bias[None]
        ef.register_dense(out, x, model.weight.T, model.bias)  # result unused
        return ef.softmax_cross_entropy(out, y)

    report = ef.find_layers(loss_fn, lin, (x, y))
    assert report.unmatched == (".weight", ".bias")
    assert all("use the value it returns" in r for r in report.reasons)


class _Declared(eqx.Module):
    """A dense layer declared by hand; subclasses make the two mistakes below."""

    weight: jax.Array
    bias: jax.Array

    def __call__(self, x):
        y = x @ self.weight + self.bias[None]
        return ef.register_dense(y, x, self.weight, self.bias)


class _ComputedWeight(_Declared):
    def __call__(self, x):
        w = 2.0 * self.weight  # declared with a weight computed from the parameter
        return ef.register_dense(x @ w + self.bias[None], x, w, self.bias)


class _DeclaredTwice(_Declared):
    def __call__(self, x):
        y = super().__call__(x)
        return ef.register_dense(y, x, self.weight, self.bias)


def _declared_case(cls):
    key_w, key_x = jr.split(jr.key(3))
    model = cls(jr.normal(key_w, (IN, OUT), F64), jnp.ones(OUT, F64))
    x, y = jr.normal(key_x, (1, IN), F64), jnp.zeros((1, OUT), F64)
    return model, (x, y), lambda m, b: ef.squared_error(m(b[0]), b[1])


def test_a_declaration_with_a_computed_weight_is_named():
    # The reasons were "no layer pattern" for the weight and "also used outside its
    # scale_and_shift layer (by `eqfisher_layer_tag`)" for the bias.
    model, batch, loss_fn = _declared_case(_ComputedWeight)
    report = ef.find_layers(loss_fn, model, batch)
    assert report.unmatched == (".weight", ".bias")
    for reason in report.reasons:
        assert "`eqfisher.register_dense`, not honoured" in reason
        assert "pass the parameter itself as `w`" in reason


def test_a_layer_declared_twice_is_one_use():
    # The repeated tag counted as a second application of a tied layer: its K-FAC
    # block, exact for one example of one dense layer, was 100% off.
    model, batch, loss_fn = _declared_case(_DeclaredTwice)
    (layer,) = ef.find_layers(loss_fn, model, batch).layers
    assert layer.uses == 1
    ref = dense_ggn(
        lambda m: _Declared(m.weight, m.bias)(batch[0]),
        lambda out: ef.squared_error(out, batch[1]),
        model,
    )
    kfac = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    np.testing.assert_allclose(kfac.as_matrix(), ref, rtol=1e-10, atol=1e-12)
