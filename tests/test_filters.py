import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

from eqfisher import filters


class Net(eqx.Module):
    encoder: eqx.nn.MLP
    head: eqx.nn.Linear
    extra: dict
    count: jax.Array
    scale: float

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.encoder = eqx.nn.MLP(3, 4, 5, 1, activation=jnp.tanh, key=k1)
        self.head = eqx.nn.Linear(4, 2, key=k2)
        self.extra = {"gain": jax.random.normal(k3, (2,)), "table": [jnp.ones(())]}
        self.count = jnp.array(3)  # an integer array: never a parameter
        self.scale = 2.0


def selected_paths(model, where):
    m = filters.mask(model, where)
    return {jtu.keystr(p) for p, s in jtu.tree_flatten_with_path(m)[0] if s}


ENCODER = {".encoder.layers[0].weight", ".encoder.layers[0].bias"}
ENCODER |= {".encoder.layers[1].weight", ".encoder.layers[1].bias"}
HEAD = {".head.weight", ".head.bias"}
EXTRA = {".extra['gain']", ".extra['table'][0]"}


@pytest.mark.parametrize(
    "where, expected",
    [
        (filters.by_path("encoder.layers[0].*"), {p for p in ENCODER if "[0]" in p}),
        (filters.by_path(".encoder.layers[0].*"), {p for p in ENCODER if "[0]" in p}),
        (filters.by_path("*.weight"), {p for p in ENCODER | HEAD if "weight" in p}),
        (
            filters.by_path("encoder.layers[*].bias"),
            {p for p in ENCODER if "bias" in p},
        ),
        (filters.by_path("extra['table']*"), {".extra['table'][0]"}),
        (filters.by_path("*"), ENCODER | HEAD | EXTRA),
        (filters.by_type(eqx.nn.Linear), ENCODER | HEAD),
        (filters.by_type(eqx.nn.MLP), ENCODER),
        (filters.by_type(Net), ENCODER | HEAD | EXTRA),
        (filters.by_type(dict), EXTRA),
        (
            filters.by_type(eqx.nn.Linear) & ~filters.by_path("*bias"),
            {".encoder.layers[0].weight", ".encoder.layers[1].weight", ".head.weight"},
        ),
        (filters.by_type(eqx.nn.MLP) | filters.by_path("extra*"), ENCODER | EXTRA),
        (~filters.by_type(eqx.nn.Linear), EXTRA),
        # Filter specs, as for `eqx.filter`: a bool, a callable, a PyTree prefix.
        (True, ENCODER | HEAD | EXTRA),
        (
            lambda leaf: eqx.is_array(leaf) and leaf.ndim == 2,
            {p for p in ENCODER | HEAD if "weight" in p},
        ),
    ],
)
def test_mask_selects(where, expected):
    model = Net(jax.random.key(0))
    assert selected_paths(model, where) == expected


def test_mask_spec_prefix():
    model = Net(jax.random.key(0))
    spec = jtu.tree_map(lambda _: False, model)
    spec = eqx.tree_at(lambda m: (m.head, m.count), spec, (True, True))
    assert selected_paths(model, spec) == HEAD  # `count` is an integer array


def test_mask_structure():
    model = Net(jax.random.key(0))
    m = filters.mask(model, True)
    assert jtu.tree_structure(m) == jtu.tree_structure(model)
    assert all(isinstance(s, bool) for s in jtu.tree_leaves(m))
    assert m.count is False and m.scale is False


def test_repr():
    f = filters.by_path("layers[0].*") & ~filters.by_type(eqx.nn.Linear)
    assert repr(f) == "by_path('layers[0].*') & ~by_type(Linear)"
    g = ~(filters.by_path("a") | filters.by_path("b")) & filters.by_type(eqx.nn.MLP)
    assert repr(g) == "~(by_path('a') | by_path('b')) & by_type(MLP)"


def test_brackets_are_literal():
    model = Net(jax.random.key(0))
    # As a regex or shell glob, `[01]` would be a character class.
    with pytest.raises(
        ValueError, match=r"`where` = by_path\('encoder.layers\[01\]\*'\)"
    ):
        filters.mask(model, filters.by_path("encoder.layers[01]*"))


def test_a_pattern_with_a_leading_star_picks_a_top_level_leaf():
    # "*.weight" ("every weight, at any depth") missed the `.weight` of a model
    # that is itself a Linear.
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    picked = filters.mask(model, filters.by_path("*.weight"))
    assert picked.weight is True and picked.bias is False
    nested = filters.mask(Net(jax.random.key(0)), filters.by_path("*.weight"))
    assert nested.head.weight is True and nested.head.bias is False


def test_params():
    model = Net(jax.random.key(0))
    p = filters.params(model)
    assert p.count is None and p.scale is None and p.encoder.activation is None
    assert p.head.weight is model.head.weight


def test_partition_combine():
    model = Net(jax.random.key(0))
    first = filters.by_type(eqx.nn.Linear) & ~filters.by_path("*bias")
    parts = filters.partition(model, first, filters.by_type(eqx.nn.MLP))
    assert len(parts) == 3
    weights, encoder, rest = parts
    assert weights.encoder.layers[0].weight is model.encoder.layers[0].weight
    assert weights.encoder.layers[0].bias is None
    # A leaf goes to the first filter that selects it.
    assert encoder.encoder.layers[0].weight is None
    assert encoder.encoder.layers[0].bias is model.encoder.layers[0].bias
    assert encoder.head.weight is None and encoder.extra["gain"] is None
    # The rest holds everything else, non-parameters included.
    assert rest.head.bias is model.head.bias and rest.extra["gain"] is not None
    assert rest.count is model.count and rest.scale == 2.0
    assert rest.encoder.activation is jnp.tanh
    assert eqx.tree_equal(filters.combine(*parts), model)


@pytest.mark.parametrize(
    "name, where",
    [("mask", filters.by_path("foo*")), ("stop_gradient", False)]
    + [("optax_mask", filters.by_path("count"))],  # an integer array
)
def test_selects_nothing(name, where):
    model = Net(jax.random.key(0))
    call = rf"`eqfisher.filters.{name}\(model, where\)`: `where` = "
    with pytest.raises(ValueError, match=call + re.escape(repr(where))) as info:
        getattr(filters, name)(model, where)
    text = str(info.value)
    assert "selects no parameter" in text and "(and 3 more)" in text
    assert "include: .encoder.layers[0].weight, .encoder.layers[0].bias," in text
    # In `partition`, the message names which of the `wheres`.
    with pytest.raises(
        ValueError, match=r"\*wheres\)`: `wheres\[1\]` = by_path\('x'\)"
    ):
        filters.partition(model, True, filters.by_path("x"))


def test_bad_spec_and_type():
    model = Net(jax.random.key(0))
    with pytest.raises(ValueError, match="`where` is neither"):
        filters.mask(model, (True, False))
    with pytest.raises(TypeError, match="cls"):
        filters.by_type("Linear")


def test_stop_gradient_simple():
    model = Net(jax.random.key(0))
    x = jnp.arange(3.0)

    def loss(m):
        m = filters.stop_gradient(m, filters.by_type(eqx.nn.MLP))
        return jnp.sum(m.head(m.encoder(x)) * m.extra["gain"])

    stopped = filters.stop_gradient(model, filters.by_type(eqx.nn.MLP))
    assert eqx.tree_equal(stopped, model)
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model)
    assert all(np.all(g == 0) for g in jtu.tree_leaves(grads.encoder))
    assert np.any(grads.head.weight != 0) and np.any(grads.extra["gain"] != 0)


def _count(jaxpr, name):
    """Equations of primitive `name`, sub-jaxprs (jit, custom rules) included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                n += _count(sub, name) if hasattr(sub, "eqns") else 0
    return n


class Encoding(eqx.Module):
    """The seed's scenario: a code network, an expensive iterated `gln` map, and an
    explanation head, each trained by its own loss within one function."""

    code: eqx.nn.Linear
    gln: eqx.nn.Linear
    explanation: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.code = eqx.nn.Linear(3, 4, key=k1)
        self.gln = eqx.nn.Linear(4, 4, key=k2)
        self.explanation = eqx.nn.Linear(4, 2, key=k3)


STEPS = 6


def infer(model, obs):
    sg = filters.stop_gradient(model, True)
    g = filters.stop_gradient(model, ~filters.by_path("gln*"))
    c = filters.stop_gradient(model, ~filters.by_path("code*"))
    e = filters.stop_gradient(model, ~filters.by_path("explanation*"))
    # Cotangents reach `obs` but no parameter.
    code_message = sg.code(obs)

    def step(state, _):
        state = jnp.tanh(g.gln(state))
        return state, jnp.sum(state**2)

    # The expensive scan: its parameters come from the `g` view only.
    state, losses = jax.lax.scan(
        step, jax.lax.stop_gradient(code_message), None, length=STEPS
    )
    gln_loss = jnp.mean(losses)
    code_loss = jnp.sum((jax.lax.stop_gradient(state) - c.code(obs)) ** 2)
    explained = e.explanation(jnp.tanh(code_message) * jax.lax.stop_gradient(state))
    return gln_loss + code_loss + jnp.sum(explained**2)


def infer_reference(wc, bc, wg, bg, we, be, obs):
    """`infer` by hand, with explicit stop_gradient calls on explicit arrays."""
    sg = jax.lax.stop_gradient
    code_message = sg(wc) @ obs + sg(bc)

    def step(state, _):
        state = jnp.tanh(wg @ state + bg)
        return state, jnp.sum(state**2)

    state, losses = jax.lax.scan(step, sg(code_message), None, length=STEPS)
    code_loss = jnp.sum((sg(state) - (wc @ obs + bc)) ** 2)
    explained = we @ (jnp.tanh(code_message) * sg(state)) + be
    return jnp.mean(losses) + code_loss + jnp.sum(explained**2)


def test_views_seed_scenario():
    model = Encoding(jax.random.key(1))
    obs = jax.random.normal(jax.random.key(2), (3,))
    # Encoding's leaves are code, gln, explanation weights and biases, in order.
    arrays = (*jtu.tree_leaves(model), obs)

    value, (grads, g_obs) = jax.value_and_grad(infer, argnums=(0, 1))(model, obs)
    ref_value, ref = jax.value_and_grad(infer_reference, argnums=range(7))(*arrays)
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    got = (*jtu.tree_leaves(grads), g_obs)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    # Each partition gets a gradient, and without the views the code weights would
    # also be trained through the explanation loss.
    assert all(np.any(g != 0) for g in got)
    no_views = lambda m: (
        infer_reference(*jtu.tree_leaves(m), obs)
        + jnp.sum(m.explanation(jnp.tanh(m.code(obs))))
    )
    assert not np.allclose(jax.grad(no_views)(model).code.weight, grads.code.weight)

    # One forward: four views, yet a single scan.
    assert _count(jax.make_jaxpr(infer)(model, obs).jaxpr, "scan") == 1
    # Reverse mode linearizes the scan (a forward scan saving residuals, plus a
    # linear tangent scan) and transposes the tangent scan into a backward scan:
    # two scans for one forward. Running the scan per view would give more.
    grad_jaxpr = jax.make_jaxpr(jax.grad(infer, argnums=(0, 1)))(model, obs)
    assert _count(grad_jaxpr.jaxpr, "scan") == 2


def test_optax_mask():
    model = Net(jax.random.key(0))
    x = jnp.arange(3.0)
    loss = lambda m: (
        jnp.sum(m.head(m.encoder(x)) * m.extra["gain"]) + m.extra["table"][0] ** 2
    )
    grads = eqx.filter_grad(loss)(model)
    params = filters.params(model)
    frozen = filters.optax_mask(model, filters.by_type(eqx.nn.MLP))
    assert jtu.tree_structure(frozen) == jtu.tree_structure(params)
    assert frozen.encoder.layers[0].weight is True and frozen.head.weight is False

    def check(updated):
        leaves = map(jtu.tree_leaves, (params, frozen, updated, grads))
        for p, s, u, g in zip(*leaves, strict=True):
            np.testing.assert_allclose(u, p if s else p - 0.1 * g, rtol=1e-14)

    # The labels idiom: frozen leaves get zero updates.
    labels = jtu.tree_map(lambda s: "freeze" if s else "train", frozen)
    opt = optax.multi_transform(
        {"train": optax.sgd(0.1), "freeze": optax.set_to_zero()}, labels
    )
    updates, _ = opt.update(grads, opt.init(params), params)
    check(filters.params(eqx.apply_updates(model, updates)))
    # The masked idiom: zero the updates of the frozen leaves after the optimiser.
    opt = optax.chain(optax.sgd(0.1), optax.masked(optax.set_to_zero(), frozen))
    updates, _ = opt.update(grads, opt.init(params), params)
    check(filters.params(eqx.apply_updates(model, updates)))


class _Returns(filters.AbstractFilter):
    answer: object = eqx.field(static=True)

    def __call__(self, path, leaf, nodes):
        return leaf if self.answer == "leaf" else self.answer


@pytest.mark.parametrize(
    "answer, got",
    [(None, r"NoneType \(a missing `return`\?\)"), ("leaf", "shape"), ("False", "str")],
)
def test_a_filter_returning_no_bool_is_named(answer, got):
    """A filter returning None raised a PyTree-structure error, one returning the
    leaf NumPy's "truth value ... is ambiguous"; one returning the string "False"
    selected every parameter."""
    with pytest.raises(TypeError, match=rf"`where` must return a bool .*{got}"):
        filters.mask(Net(jax.random.key(0)), _Returns(answer))
    with pytest.raises(TypeError, match="`where` must return a bool"):
        filters.mask(Net(jax.random.key(0)), lambda leaf: leaf)


def test_a_filter_deciding_by_values_names_the_mask_outside_jit():
    """`jnp.any(leaf != 0)` is a concrete bool array outside `jit` (accepted, as
    before) and a tracer inside: JAX's bare `TracerBoolConversionError` before."""

    class NonZero(filters.AbstractFilter):
        def __call__(self, path, leaf, nodes):
            return eqx.is_array(leaf) and jnp.any(leaf != 0)

    model = Net(jax.random.key(0))
    model = eqx.tree_at(lambda m: m.head.bias, model, jnp.zeros(2))
    eager = selected_paths(model, NonZero())
    assert eager == (ENCODER | HEAD | EXTRA) - {".head.bias"}
    with pytest.raises(TypeError, match="from its values.*mask = eqfisher"):
        eqx.filter_jit(lambda m: filters.mask(m, NonZero()))(model)
    spec = filters.mask(model, NonZero())  # the fix the message names
    jitted = eqx.filter_jit(lambda m: filters.mask(m, spec))(model)
    assert jtu.tree_leaves(jitted) == jtu.tree_leaves(spec)


def test_a_path_and_leaf_callable_is_named():
    """optax's `(path, leaf)` callbacks gave Python's "missing 1 required
    positional argument: 'leaf'"."""
    with pytest.raises(TypeError, match=r"called with one leaf.*takes \(path, leaf\)"):
        filters.mask(Net(jax.random.key(0)), lambda path, leaf: True)
    assert selected_paths(Net(jax.random.key(0)), lambda leaf, *rest: True)
