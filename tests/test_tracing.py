"""`layer_vjp` and the loss-tag transforms against hand-written JAX references."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqfisher as ef
from eqfisher.internal import LayerRecord, split, stage_loss

from .helpers import tree_allclose
from .zoo import BY_NAME, ZOO, ZooEntry


IDS = [e.name for e in ZOO]


def _params(model):
    return eqx.partition(model, eqx.is_inexact_array)


def _tangent_like(tree, seed):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jr.split(jr.key(seed), len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef,
        [jr.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=False)],
    )


def _reference_vjp(entry: ZooEntry, model, batch, cotangent):
    """d<cotangent, predict>/d params by `jax.vjp`, as a list of parameter leaves."""
    params, static = _params(model)
    _, vjp = jax.vjp(lambda p: entry.predict(eqx.combine(p, static), batch), params)
    return jax.tree_util.tree_leaves(vjp(cotangent)[0])


# --- layer_vjp on an MLP, against a hand-written network ---------------------------


def _manual_mlp(weights, biases, perturbs, x):
    """The MLP written out, with a perturbation added to each pre-activation."""
    h, inputs, pre = x, [], []
    for i, (w, b, e) in enumerate(zip(weights, biases, perturbs, strict=False)):
        inputs.append(h)
        z = h @ w.T + b[None] + e
        pre.append(z)
        h = jnp.tanh(z) if i < len(weights) - 1 else z
    return h, (inputs, pre)


def test_layer_vjp_mlp_by_hand():
    entry = BY_NAME["mlp"]
    model, (x, y) = entry.build()
    ws = [layer.weight for layer in model.layers]
    bs = [layer.bias for layer in model.layers]
    zeros = [jnp.zeros((x.shape[0], w.shape[0]), x.dtype) for w in ws]
    logits, (inputs, pre) = _manual_mlp(ws, bs, zeros, x)
    t = jr.normal(jr.key(1), logits.shape, logits.dtype)

    _, vjp_perturb = jax.vjp(lambda e: _manual_mlp(ws, bs, e, x)[0], zeros)
    (out_cts,) = vjp_perturb(t)
    _, vjp_params = jax.vjp(lambda w, b: _manual_mlp(w, b, zeros, x)[0], ws, bs)
    w_cts, b_cts = vjp_params(t)

    losses, vjp_fn = ef.layer_vjp(entry.loss_fn)(model, (x, y))
    (loss,) = losses
    assert isinstance(loss, ef.RegisteredLoss)
    assert loss.family == ef.losses.Categorical()
    np.testing.assert_allclose(loss.inputs, logits, rtol=1e-12)
    np.testing.assert_array_equal(loss.targets, y)
    np.testing.assert_array_equal(loss.mask, jnp.ones(5))
    np.testing.assert_allclose(loss.value(), entry.loss_fn(model, (x, y)), rtol=1e-12)

    data = vjp_fn((t,))
    assert len(data) == 3
    for i, d in enumerate(data):
        assert isinstance(d, ef.LayerData)
        np.testing.assert_allclose(d.inputs, inputs[i], rtol=1e-12)
        np.testing.assert_allclose(d.outputs, pre[i], rtol=1e-12)
        assert d.params[0] is ws[i] and d.params[1] is bs[i]
        np.testing.assert_allclose(
            d.outputs_tangent, out_cts[i], rtol=1e-12, atol=1e-14
        )
        np.testing.assert_allclose(
            d.params_tangent[0], w_cts[i], rtol=1e-12, atol=1e-14
        )
        np.testing.assert_allclose(
            d.params_tangent[1], b_cts[i], rtol=1e-12, atol=1e-14
        )
        # The dense identity on the plain arrays: dW = gᵀ a, db = Σ g.
        np.testing.assert_allclose(
            d.params_tangent[0], out_cts[i].T @ inputs[i], rtol=1e-12, atol=1e-14
        )


def test_layer_vjp_wrong_number_of_tangents():
    entry = BY_NAME["mlp"]
    model, batch = entry.build()
    _, vjp_fn = ef.layer_vjp(entry.loss_fn)(model, batch)
    with pytest.raises(ValueError, match="one tangent per registered loss"):
        vjp_fn(())


# --- every zoo model: parameter cotangents and the K-FAC building blocks -----------


def _matrix(x, order, cols):
    return jnp.transpose(x, order).reshape(-1, cols)


def _conv_patches(record: LayerRecord, x, kernel):
    """`(locations, d_in)` patches of a conv's input, in core output location order."""
    p = record.core.params
    dn = p["dimension_numbers"]
    rhs_spec, out_spec = tuple(dn.rhs_spec), tuple(dn.out_spec)
    patches = jax.lax.conv_general_dilated_patches(
        x,
        tuple(kernel.shape[d] for d in rhs_spec[2:]),
        p["window_strides"],
        p["padding"],
        lhs_dilation=p["lhs_dilation"],
        rhs_dilation=p["rhs_dilation"],
        dimension_numbers=dn,
    )
    order = tuple(a for a in range(len(out_spec)) if a != out_spec[1]) + (out_spec[1],)
    return _matrix(patches, order, record.d_in)


def _rebuilt_params_tangent(record: LayerRecord, d: ef.LayerData):
    """Each parameter's cotangent rebuilt from the layer's inputs and output
    cotangents, the way K-FAC factors them."""
    g = _matrix(d.outputs_tangent, record.out_order, record.d_out)
    leaves = []
    if record.kind.name == "scale_and_shift":
        a = _matrix(d.inputs, record.in_order, record.d_in)
        for leaf, is_scale in zip(
            d.params, (record.core.name == "mul", False), strict=False
        ):
            grad = jnp.sum(a * g, 0) if is_scale else jnp.sum(g, 0)
            leaves.append(grad.reshape(leaf.shape))
        return tuple(leaves)
    if record.kind.name == "dense":
        a = _matrix(d.inputs, record.in_order, record.d_in)
    elif record.kind.name == "embedding":
        (c,) = record.in_order
        a = jax.nn.one_hot(d.inputs[..., c].reshape(-1), record.d_in, dtype=g.dtype)
    else:
        a = _conv_patches(record, d.inputs, d.params[0])
    w_mat = g.T @ a  # (d_out, d_in)
    weight = d.params[0]
    perm = record.weight_perm
    view_shape = tuple(weight.shape[p] for p in perm)
    leaves.append(jnp.transpose(w_mat.reshape(view_shape), np.argsort(perm)))
    if len(d.params) == 2:  # and a bias
        leaves.append(jnp.sum(g, 0).reshape(d.params[1].shape))
    return tuple(leaves)


@pytest.mark.parametrize("entry", ZOO, ids=IDS)
def test_layer_vjp_zoo(entry: ZooEntry):
    model, batch = entry.build()
    logits = entry.predict(model, batch)
    t = jr.normal(jr.key(2), logits.shape, logits.dtype)
    reference = _reference_vjp(entry, model, batch, t)

    losses, vjp_fn = ef.layer_vjp(entry.loss_fn)(model, batch)
    np.testing.assert_allclose(losses[0].inputs, logits, rtol=1e-12)
    np.testing.assert_allclose(
        losses[0].value(), entry.loss_fn(model, batch), rtol=1e-12
    )
    data = vjp_fn((t,))

    records = stage_loss(entry.loss_fn, split(model, batch)).layers
    assert [r.name for r in records] == [name for name, _, _ in entry.layers]
    assert len(data) == len(records)
    kinds_checked = set()
    for record, d in zip(records, data, strict=False):
        assert d.outputs.shape == d.outputs_tangent.shape
        assert math.prod(d.outputs.shape) % record.d_out == 0
        for index, leaf, ct in zip(
            record.param_indices, d.params, d.params_tangent, strict=False
        ):
            assert leaf.shape == ct.shape
            np.testing.assert_allclose(ct, reference[index], rtol=1e-10, atol=1e-12)
        rebuilt = _rebuilt_params_tangent(record, d)
        assert len(rebuilt) == len(d.params_tangent)
        for r, ct in zip(rebuilt, d.params_tangent, strict=False):
            np.testing.assert_allclose(r, ct, rtol=1e-10, atol=1e-12)
        kinds_checked.add(record.kind.name)
    assert kinds_checked == {kind for _, kind, _ in entry.layers}


def test_layer_vjp_output_tangents_transformer():
    """The cotangent of each perturbed output equals that of a zero perturbation
    added to the same value in a hand-written forward pass (checked for the head
    and the layer norm, whose outputs are easy to reach by hand)."""
    entry = BY_NAME["transformer"]
    model, batch = entry.build()
    tokens = batch[0]
    t = jr.normal(jr.key(3), entry.predict(model, batch).shape, jnp.float64)

    def forward(e_norm, e_head):
        def one(tokens, e_norm, e_head):
            h = jax.vmap(model.embed)(tokens)
            h = h + model.attn(h, h, h)
            h = jax.vmap(model.norm)(h) + e_norm
            return jax.vmap(model.head)(h) + e_head

        return jax.vmap(one)(tokens, e_norm, e_head)

    shape = tokens.shape
    zeros = (jnp.zeros(shape + (8,)), jnp.zeros(shape + (11,)))
    _, vjp = jax.vjp(forward, *zeros)
    ct_norm, ct_head = vjp(t)

    names = [name for name, _, _ in entry.layers]
    data = ef.layer_vjp(entry.loss_fn)(model, batch)[1]((t,))
    norm, head = data[names.index("norm")], data[names.index("head")]
    np.testing.assert_allclose(norm.outputs_tangent, ct_norm, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(head.outputs_tangent, ct_head, rtol=1e-10, atol=1e-12)
    embed = data[names.index("embed")]
    assert embed.inputs.shape[:2] == tokens.shape
    # vmapped eqx.nn.Embedding gathers (1, features) slices: the perturbed output is
    # the gather's, with a size-1 row axis (its label is None, ordered last).
    assert embed.outputs.shape == tokens.shape + (1, 8)
    np.testing.assert_array_equal(embed.outputs[:, :, 0], model.embed.weight[tokens])


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "jit_checkpoint"])
def test_layer_vjp_under_filter_jit(name):
    entry = BY_NAME[name]
    model, batch = entry.build()
    t = jr.normal(jr.key(4), entry.predict(model, batch).shape, jnp.float64)

    def run(model, batch, t):
        losses, vjp_fn = ef.layer_vjp(entry.loss_fn)(model, batch)
        return losses, vjp_fn((t,))

    eager = run(model, batch, t)
    jitted = eqx.filter_jit(run)(model, batch, t)
    assert tree_allclose(
        eqx.filter(eager, eqx.is_array), eqx.filter(jitted, eqx.is_array)
    )


def test_layer_vjp_traces_once_per_structure():
    entry = BY_NAME["mlp"]
    model, batch = entry.build()
    transformed = ef.layer_vjp(entry.loss_fn)
    transformed(model, batch)
    transformed(model, (batch[0] + 1.0, batch[1]))
    assert len(transformed.staged.cache) == 1
    transformed(model, (batch[0][:2], batch[1][:2]))
    assert len(transformed.staged.cache) == 2


# --- loss-tag transforms ------------------------------------------------------------


@pytest.mark.parametrize("entry", ZOO, ids=IDS)
def test_loss_tags_vjp(entry: ZooEntry):
    model, batch = entry.build()
    logits = entry.predict(model, batch)
    t = jr.normal(jr.key(5), logits.shape, logits.dtype)
    losses, vjp_fn = ef.loss_tags_vjp(entry.loss_fn)(model, batch)
    np.testing.assert_allclose(losses[0].inputs, logits, rtol=1e-12)
    got = vjp_fn((t,))
    params, static = _params(model)
    _, vjp = jax.vjp(lambda p: entry.predict(eqx.combine(p, static), batch), params)
    assert tree_allclose(got, vjp(t)[0])


@pytest.mark.parametrize("entry", ZOO, ids=IDS)
def test_loss_tags_jvp(entry: ZooEntry):
    model, batch = entry.build()
    params, static = _params(model)
    v = _tangent_like(params, 6)
    losses, tangents = ef.loss_tags_jvp(entry.loss_fn)(model, batch, v)
    # J v from the reverse-mode Jacobian: `jax.jvp` refuses the custom_vjp model.
    predict = lambda p: entry.predict(eqx.combine(p, static), batch)  # noqa: E731
    out = predict(params)
    jac = jax.jacrev(predict)(params)
    expected = sum(
        jnp.tensordot(j, t, t.ndim)
        for j, t in zip(
            jax.tree_util.tree_leaves(jac), jax.tree_util.tree_leaves(v), strict=False
        )
    )
    np.testing.assert_allclose(losses[0].inputs, out, rtol=1e-12)
    assert len(tangents) == 1
    np.testing.assert_allclose(tangents[0], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("entry", ZOO, ids=IDS)
def test_loss_tags_hvp(entry: ZooEntry):
    model, batch = entry.build()
    params, static = _params(model)
    v = _tangent_like(params, 7)
    losses, hv = ef.loss_tags_hvp(entry.loss_fn)(model, batch, v)
    grad = jax.grad(lambda p: entry.loss_fn(eqx.combine(p, static), batch))
    _, expected = jax.jvp(grad, (params,), (v,))
    assert tree_allclose(hv, expected, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(
        losses[0].value(), entry.loss_fn(model, batch), rtol=1e-12
    )


def test_two_registered_losses():
    entry = BY_NAME["mlp"]
    model, (x, y) = entry.build()
    targets = jr.normal(jr.key(8), (5, 3), jnp.float64)

    def loss_fn(model, batch):
        x, y, targets = batch
        logits = jax.vmap(model)(x)
        return ef.softmax_cross_entropy(logits, y) + 0.5 * ef.squared_error(
            logits, targets
        )

    batch = (x, y, targets)
    params, static = _params(model)
    v = _tangent_like(params, 9)
    losses, hv = ef.loss_tags_hvp(loss_fn)(model, batch, v)
    assert [type(loss.family) for loss in losses] == [
        ef.losses.Categorical,
        ef.losses.Gaussian,
    ]
    # Each registered loss is weighted by its coefficient in the returned value:
    # the Hessian of CE + 0.5·MSE.
    assert [float(loss.coefficient) for loss in losses] == [1.0, 0.5]
    total = lambda p: (  # noqa: E731
        ef.softmax_cross_entropy(jax.vmap(eqx.combine(p, static))(x), y)
        + 0.5 * ef.squared_error(jax.vmap(eqx.combine(p, static))(x), targets)
    )
    _, expected = jax.jvp(jax.grad(total), (params,), (v,))
    assert tree_allclose(hv, expected, rtol=1e-9, atol=1e-11)

    t1, t2 = (jr.normal(k, (5, 3), jnp.float64) for k in jr.split(jr.key(10)))
    _, vjp_fn = ef.loss_tags_vjp(loss_fn)(model, batch)
    _, vjp = jax.vjp(lambda p: jax.vmap(eqx.combine(p, static))(x), params)
    (ref,) = vjp(t1 + t2)
    assert tree_allclose(vjp_fn((t1, t2)), ref)


def test_custom_vjp_rule_is_bypassed():
    """A limitation, by design: custom-derivative calls that carry parameters are
    inlined so the layers inside them can be found and perturbed, so eqfisher
    differentiates their primal body and their custom rule is not used."""

    @jax.custom_vjp
    def scaled_layer(w, x):
        return w @ x

    def fwd(w, x):
        return w @ x, (w, x)

    def bwd(res, g):
        w, x = res
        return 2.0 * jnp.outer(g, x), w.T @ g  # twice the true weight gradient

    scaled_layer.defvjp(fwd, bwd)

    class Model(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return scaled_layer(self.w, x)

    model = Model(jr.normal(jr.key(11), (2, 3), jnp.float64))
    x = jr.normal(jr.key(12), (4, 3), jnp.float64)
    t = jr.normal(jr.key(13), (4, 2), jnp.float64)

    def loss_fn(model, x):
        return ef.squared_error(jax.vmap(model)(x), jnp.zeros((4, 2), jnp.float64))

    assert ef.find_layers(loss_fn, model, x).layers == (
        ef.LayerInfo("w", "dense", (".w",)),
    )
    got = ef.loss_tags_vjp(loss_fn)(model, x)[1]((t,)).w
    with_rule = jax.vjp(lambda m: jax.vmap(m)(x), model)[1](t)[0].w
    np.testing.assert_allclose(got, t.T @ x, rtol=1e-12)
    np.testing.assert_allclose(with_rule, 2.0 * t.T @ x, rtol=1e-12)
