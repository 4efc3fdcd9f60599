"""Scans kept as scans: statistics through a `lax.scan` of any length, against dense
float64 references and factors built by hand, and a statistics program whose size
does not grow with the number of steps."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqfisher as ef
from eqfisher import internal as stats
from eqfisher.internal import StagedLoss, layer_outputs_vjp, split

from .helpers import block_slices, dense_ggn_cross_entropy


F64 = jnp.float64
H, F, C, N = 3, 2, 2, 4  # hidden units, input features, classes, examples


class Recurrent(eqx.Module):
    """`h ← tanh(W [h; x] + b)` over the steps of `xs`; weights are scan consts."""

    cell: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.Linear(H + F, H, dtype=F64, key=k1)
        self.head = eqx.nn.Linear(H, C, dtype=F64, key=k2)

    def __call__(self, xs, deltas=None):  # xs: (T, F); deltas: (T, H) or None
        deltas = jnp.zeros(xs.shape[:1] + (H,), F64) if deltas is None else deltas

        def body(h, inp):
            x, d = inp
            a = jnp.concatenate([h, x])
            return jnp.tanh(self.cell(a) + d), a

        h, inputs = jax.lax.scan(body, jnp.zeros(H, F64), (xs, deltas))
        return self.head(h), inputs


class Stacked(eqx.Module):
    """`depth` stacked layers applied by a scan over their leaves."""

    layers: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key, depth, d=2):
        k1, k2 = jax.random.split(key)
        make = lambda k: eqx.nn.Linear(d, d, dtype=F64, key=k)  # noqa: E731
        self.layers = eqx.filter_vmap(make)(jax.random.split(k1, depth))
        self.head = eqx.nn.Linear(d, C, dtype=F64, key=k2)

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None

        return self.head(jax.lax.scan(body, x, params)[0])


class _Logits(eqx.Module):
    model: Recurrent

    def __call__(self, x):
        return self.model(x)[0]


def ce_recurrent(model, batch):
    xs, y = batch
    return ef.softmax_cross_entropy(jax.vmap(lambda x: model(x)[0])(xs), y)


def ce(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def _batch(shape, n=N, seed=1):
    x = jax.random.normal(jax.random.key(seed), (n,) + shape, F64)
    y = jax.random.randint(jax.random.key(seed + 1), (n,), 0, C)
    return x, y


def _recurrent_reference(model, batch):
    """K-FAC's A and G for the shared cell, by hand: A is the mean of ã ãᵀ over
    every example and step (ã = [h; x; 1]), G = Σₜ Σₙ Jₙₜᵀ Hₙ Jₙₜ / N with Jₙₜ the
    Jacobian of example n's logits in the cell's output at step t and Hₙ the
    softmax cross-entropy Hessian."""
    xs, y = batch
    steps = xs.shape[1]
    rows = jax.vmap(lambda x: model(x)[1])(xs).reshape(-1, H + F)
    rows = jnp.concatenate([rows, jnp.ones((rows.shape[0], 1), F64)], axis=1)
    a = rows.T @ rows / rows.shape[0]
    zero = jnp.zeros((steps, H), F64)

    def one(x):
        logits = model(x)[0]
        jac = jax.jacfwd(lambda d: model(x, d)[0])(zero)  # (C, T, H)
        p = jax.nn.softmax(logits)
        hess = jnp.diag(p) - jnp.outer(p, p)
        return jnp.einsum("ctj,cd,dtk->jk", jac, hess, jac)

    g = jnp.sum(jax.vmap(one)(xs), axis=0) / xs.shape[0]
    return np.asarray(a), np.asarray(g)


# Kept scans have no length limit: `max_unroll` (default 128) bounds only the scans
# eqfisher must unroll. It is set to 16 here so that 40 steps are "long".
LONG = 40


@pytest.fixture(autouse=True)
def _small_unroll_limit():
    with ef.configure(max_unroll=16):
        yield


@pytest.mark.parametrize("steps", [LONG])
def test_long_recurrent_scan_kfac_and_dense(steps):
    model, batch = Recurrent(jax.random.key(0)), _batch((steps, F))
    report = ef.find_layers(ce_recurrent, model, batch)
    assert [(li.name, li.uses) for li in report.layers] == [
        ("cell", steps),
        ("head", 1),
    ]
    assert report.unmatched == ()
    kfac = ef.curvature(
        ce_recurrent, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
    )
    a, g = _recurrent_reference(model, batch)
    np.testing.assert_allclose(kfac.blocks["cell"].a, a, atol=1e-10)
    np.testing.assert_allclose(kfac.blocks["cell"].g, g, atol=1e-10)
    ref = dense_ggn_cross_entropy(_Logits(model), *batch)
    dense = ef.curvature(
        ce_recurrent, model, batch, estimator=ef.GGN(), structure=ef.Dense()
    )
    np.testing.assert_allclose(dense.as_matrix(), ref, atol=1e-10)


def _rows(model, step):
    """Ravelled rows of `layers[step]` (weight, then bias)."""
    params = eqx.filter(model, eqx.is_inexact_array)
    sizes = [x.size for x in jax.tree_util.tree_leaves(params)]
    w, b = model.layers.weight, model.layers.bias
    w_rows = np.arange(w.size).reshape(w.shape)[step].ravel()
    b_rows = sizes[0] + np.arange(b.size).reshape(b.shape)[step].ravel()
    return np.concatenate([w_rows, b_rows])


def test_long_stacked_scan_is_exact_per_step_for_one_example():
    depth = LONG
    model, batch = Stacked(jax.random.key(0), depth), _batch((2,), n=1)
    ref = dense_ggn_cross_entropy(model, *batch)
    kfac = ef.curvature(ce, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    assert len(kfac.blocks) == depth + 1
    dense = ef.curvature(ce, model, batch, estimator=ef.GGN(), structure=ef.Dense())
    np.testing.assert_allclose(dense.as_matrix(), ref, atol=1e-12)
    for step in (0, 1, 16, 23, depth - 1):
        rows = _rows(model, step)
        np.testing.assert_allclose(
            np.asarray(kfac.blocks[f"layers[{step}]"].as_matrix()),
            ref[np.ix_(rows, rows)],
            atol=1e-12,
        )


def _count(jaxpr) -> int:
    """Equations of a jaxpr, those of the jaxprs inside its equations included."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _count(inner)
    return total


def _statistics_size(model, batch, loss_fn) -> int:
    """Equations of the program K-FAC's statistics come from: one forward with
    zero perturbations on the layers' outputs, two stacked VJPs pulling vectors
    back to them, and the layers' inputs."""
    staged = StagedLoss(loss_fn, "test")

    def statistics(model, batch):
        s = split(model, batch)
        processed = staged.stage(s)
        lin = layer_outputs_vjp(processed, s, processed.layers, value_and_grad=False)
        vectors = tuple(jnp.ones((2,) + x.inputs.shape, F64) for x in lin.losses)
        _, cotangents = jax.vmap(lin.vjp)(vectors)
        return cotangents.values, lin.layer_inputs.values.values

    return _count(jax.make_jaxpr(statistics)(model, batch).jaxpr)


def test_statistics_program_does_not_grow_with_the_scan():
    sizes = [
        _statistics_size(Recurrent(jax.random.key(0)), _batch((t, F)), ce_recurrent)
        for t in (4, 64)
    ]
    assert sizes[0] == sizes[1]
    stacked = [
        _statistics_size(Stacked(jax.random.key(0), depth), _batch((2,)), ce)
        for depth in (4, 64)
    ]
    assert stacked[0] == stacked[1]


@pytest.mark.parametrize("reduce, max_factor_dim", [(None, None), (N, None), (None, 3)])
def test_pooled_factors_of_a_shared_cell_equal_the_per_step_sum(reduce, max_factor_dim):
    # `pooled_factors` computes the factors of every step's use at once; the
    # per-step sum, A = Σₜ Aₜ nₜ / Σₜ nₜ and G = Σₜ Gₜ, is the definition.
    model, batch = Recurrent(jax.random.key(0)), _batch((8, F))
    staged = StagedLoss(ce_recurrent, "test")
    s = split(model, batch)
    processed = staged.stage(s)
    cell = [r for r in processed.layers if r.name == "cell"]
    assert len(cell) == 8
    lin = layer_outputs_vjp(processed, s, processed.layers, value_and_grad=False)
    inputs = lin.layer_inputs
    vectors = tuple(
        jax.random.normal(jax.random.key(5), (3,) + loss.inputs.shape, F64)
        for loss in lin.losses
    )
    _, cotangents = jax.vmap(lin.vjp)(vectors)
    options = dict(reduce_examples=reduce, max_factor_dim=max_factor_dim)
    a, g, rows = stats.pooled_factors(cell, inputs, cotangents, True, F64, **options)
    parts = [
        stats.kronecker_factors(
            r,
            inputs[processed.layers.index(r)],
            cotangents[r.outputs],
            True,
            F64,
            **options,
        )
        for r in cell
    ]
    total = sum(n for _, _, n in parts)
    assert rows == total  # the rows A averages: every step's
    np.testing.assert_allclose(
        a, sum(a_t * (n / total) for a_t, _, n in parts), atol=1e-14
    )
    np.testing.assert_allclose(g, sum(g_t for _, g_t, _ in parts), atol=1e-14)
    assert a.shape == ((H + F + 1,) * (2 if max_factor_dim is None else 1))


class _Viewed(eqx.Module):
    """`Stacked`, its stack scanned through `view` (a reversal or a slice)."""

    model: Stacked
    view: Callable = eqx.field(static=True)

    def __call__(self, x):
        params, static = eqx.partition(self.model.layers, eqx.is_array)

        def body(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None

        params = jax.tree_util.tree_map(self.view, params)
        return self.model.head(jax.lax.scan(body, x, params)[0])


@pytest.mark.parametrize(
    "view, primitive", [(lambda a: a[::-1], "rev"), (lambda a: a[1:], "slice")]
)
def test_a_view_of_a_stack_is_named_and_exact(view, primitive):
    """A stacked leaf scanned through `leaf[::-1]` or `leaf[1:]` is not matched as
    layers (its steps get exact diagonals); `find_layers` said "no layer pattern"
    and now names the view."""
    model = _Viewed(Stacked(jax.random.key(0), 3), view)
    x = jax.random.normal(jax.random.key(1), (N, 2), F64)
    batch = (x, jnp.arange(N) % C)
    report = ef.find_layers(ce, model, batch)
    assert [layer.name for layer in report.layers] == ["model.head"]
    reasons = dict(zip(report.unmatched, report.reasons))
    assert set(reasons) == {".model.layers.weight", ".model.layers.bias"}
    assert all(f"read through `{primitive}`" in r for r in reasons.values())
    reference = dense_ggn_cross_entropy(model, *batch)
    curv = ef.curvature(
        ce, model, batch, estimator=ef.GGN(), structure=ef.BlockDiagonal()
    )
    blocks = np.asarray(curv.as_matrix())
    kept = np.zeros_like(reference)
    slices = block_slices(model)
    for _, positions in curv.leaf_indices:
        idx = np.concatenate(
            [np.arange(s.start, s.stop) for s in (slices[i] for i in positions)]
        )
        kept[np.ix_(idx, idx)] = reference[np.ix_(idx, idx)]
    np.testing.assert_allclose(blocks, kept, rtol=1e-12, atol=1e-15)


class _FlippedConv(eqx.Module):
    kernel: jax.Array  # (out, in, kh, kw)

    def __call__(self, x):
        flipped = jnp.flip(self.kernel, (2, 3))
        y = jax.lax.conv_general_dilated(x[None], flipped, (1, 1), "SAME")[0]
        return y.reshape(-1)[:C]


def test_a_kernel_flipped_on_other_axes_is_named_as_such():
    # A convolution's kernel flipped on its spatial axes (a hand-written
    # transposed convolution) was said to be read through "a reversed or sliced
    # view of its leading axis, as `leaf[::-1]`": neither applies.
    model = _FlippedConv(jax.random.normal(jax.random.key(0), (3, 2, 2, 2), F64))
    x = jax.random.normal(jax.random.key(1), (N, 2, 4, 4), F64)
    report = ef.find_layers(ce, model, (x, jnp.arange(N) % C))
    (reason,) = report.reasons
    assert "read flipped along axes (2, 3)" in reason
    assert "leading axis" not in reason
