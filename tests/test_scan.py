"""`lax.scan` over stacked layers: every step's layer is found, on its slice of the
stacked leaves, and its curvature blocks agree with dense float64 references."""

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import eqfisher as ef

from .helpers import dense_ggn_cross_entropy, tree_allclose


F64 = jnp.float64
D = 4


def _linear(key):
    return eqx.nn.Linear(D, D, dtype=F64, key=key)


class Scanned(eqx.Module):
    layers: eqx.nn.Linear  # stacked: weight (3, D, D), bias (3, D)
    head: eqx.nn.Linear

    def __init__(self, key, depth=3):
        k1, k2 = jax.random.split(key)
        self.layers = eqx.filter_vmap(_linear)(jax.random.split(k1, depth))
        self.head = eqx.nn.Linear(D, 2, dtype=F64, key=k2)

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None

        return self.head(jax.lax.scan(body, x, params)[0])


class Looped(Scanned):
    """The stacked layers of `Scanned`, read one step at a time by a Python loop:
    `a[k]` is a `slice` and a `squeeze` of the whole leaf (no layer before)."""

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)
        for k in range(3):
            step = jax.tree.map(lambda a, k=k: a[k], params)
            x = jnp.tanh(eqx.combine(step, static)(x))
        return self.head(x)


class Nested(eqx.Module):
    """Two groups of two stacked layers: leaves of shape (2, 2, ...), two scans."""

    layers: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        keys = jax.random.split(k1, 4).reshape(2, 2)
        self.layers = eqx.filter_vmap(eqx.filter_vmap(_linear))(keys)
        self.head = eqx.nn.Linear(D, 2, dtype=F64, key=k2)

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)

        def inner(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None

        def outer(h, group):
            return jax.lax.scan(inner, h, group)[0], None

        return self.head(jax.lax.scan(outer, x, params)[0])


class Outputs(eqx.Module):
    """A reversed scan whose per-step outputs (`ys`) all reach the loss."""

    layers: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = eqx.filter_vmap(_linear)(jax.random.split(k1, 3))
        self.head = eqx.nn.Linear(3 * D, 2, dtype=F64, key=k2)

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, p):
            h = jnp.tanh(eqx.combine(p, static)(h))
            return h, h

        _, ys = jax.lax.scan(body, x, params, reverse=True)
        return self.head(ys.ravel())


class Recurrent(eqx.Module):
    """One cell applied at every time step: its weights are scan constants."""

    cell: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.Linear(2 * D, D, dtype=F64, key=k1)
        self.head = eqx.nn.Linear(D, 2, dtype=F64, key=k2)

    def __call__(self, xs):  # xs: (T, D)
        def body(h, x):
            return jnp.tanh(self.cell(jnp.concatenate([h, x]))), None

        return self.head(jax.lax.scan(body, jnp.zeros(D, F64), xs)[0])


class ConvStack(eqx.Module):
    convs: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        make = lambda k: eqx.nn.Conv2d(2, 2, 3, padding=1, dtype=F64, key=k)  # noqa: E731
        self.convs = eqx.filter_vmap(make)(jax.random.split(k1, 2))
        self.head = eqx.nn.Linear(2 * 4 * 4, 2, dtype=F64, key=k2)

    def __call__(self, x):
        params, static = eqx.partition(self.convs, eqx.is_array)

        def body(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None

        return self.head(jax.lax.scan(body, x, params)[0].ravel())


def ce(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def _data(shape, n=5, seed=1):
    x = jax.random.normal(jax.random.key(seed), (n,) + shape, F64)
    y = jax.random.randint(jax.random.key(seed + 1), (n,), 0, 2)
    return x, y


def _ggn(model, batch):
    return dense_ggn_cross_entropy(model, *batch)


def _positions(model, paths_and_index):
    """Rows of the ravelled parameters for `(leaf path, index)` pairs, in order."""
    params = eqx.filter(model, eqx.is_inexact_array)
    offsets, start = {}, 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        offsets[jax.tree_util.keystr(path)] = (start, leaf.shape)
        start += leaf.size
    out = []
    for path, index in paths_and_index:
        begin, shape = offsets[path]
        out.append(begin + np.arange(np.prod(shape)).reshape(shape)[index].ravel())
    return np.concatenate(out)


def _layer_rows(model, name):
    """Ravelled rows of a scan-step layer `layers[k]` (weight, then bias)."""
    field, rest = name.split("[", 1)
    index = tuple(int(k) for k in rest.rstrip("]").split("]["))
    return _positions(model, [(f".{field}.weight", index), (f".{field}.bias", index)])


CASES = {
    "scanned": (lambda: Scanned(jax.random.key(0)), (D,)),
    "python loop": (lambda: Looped(jax.random.key(0)), (D,)),
    "nested": (lambda: Nested(jax.random.key(0)), (D,)),
    "outputs": (lambda: Outputs(jax.random.key(0)), (D,)),
    "conv": (lambda: ConvStack(jax.random.key(0)), (2, 4, 4)),
}
NAMES = {
    "scanned": ["layers[0]", "layers[1]", "layers[2]", "head"],
    "python loop": ["layers[0]", "layers[1]", "layers[2]", "head"],
    "nested": ["layers[0][0]", "layers[0][1]", "layers[1][0]", "layers[1][1]", "head"],
    "outputs": ["layers[0]", "layers[1]", "layers[2]", "head"],
    "conv": ["convs[0]", "convs[1]", "head"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_step_is_a_layer(case):
    make, shape = CASES[case]
    report = ef.find_layers(ce, make(), _data(shape))
    assert [li.name for li in report.layers] == NAMES[case]
    kinds = {li.kind for li in report.layers[:-1]}
    assert kinds == ({"conv"} if case == "conv" else {"dense"})
    assert report.unmatched == ()
    first = report.layers[0]
    suffix = first.name[first.name.index("[") :]
    assert all(p.endswith(suffix) for p in first.param_paths)


@pytest.mark.parametrize("case", list(CASES))
def test_exact_structures_match_the_dense_ggn(case):
    make, shape = CASES[case]
    model, batch = make(), _data(shape)
    ref = _ggn(model, batch)
    dense = ef.curvature(ce, model, batch, estimator=ef.GGN(), structure=ef.Dense())
    np.testing.assert_allclose(dense.as_matrix(), ref, atol=1e-12)
    diag = ef.curvature(ce, model, batch, estimator=ef.GGN(), structure=ef.Diagonal())
    np.testing.assert_allclose(diag.as_matrix(), np.diag(np.diag(ref)), atol=1e-12)
    blocks = ef.curvature(
        ce, model, batch, estimator=ef.GGN(), structure=ef.BlockDiagonal()
    )
    got = np.asarray(blocks.as_matrix())
    mask = np.zeros_like(got, bool)
    for name in NAMES[case][:-1]:
        rows = _layer_rows(model, name)
        np.testing.assert_allclose(
            np.asarray(blocks.blocks[name].as_matrix()),
            ref[np.ix_(rows, rows)],
            atol=1e-12,
        )
        mask[np.ix_(rows, rows)] = True
    rows = _positions(model, [(".head.weight", ()), (".head.bias", ())])
    mask[np.ix_(rows, rows)] = True
    np.testing.assert_allclose(got, np.where(mask, ref, 0.0), atol=1e-12)


@pytest.mark.parametrize("case", ["scanned", "python loop", "nested"])
def test_kfac_is_exact_per_step_for_one_example(case):
    make, shape = CASES[case]
    model, batch = make(), _data(shape, n=1)
    ref = _ggn(model, batch)
    for structure in (ef.KFAC(), ef.EKFAC()):
        curv = ef.curvature(ce, model, batch, estimator=ef.GGN(), structure=structure)
        for name in NAMES[case][:-1]:
            rows = _layer_rows(model, name)
            np.testing.assert_allclose(
                np.asarray(curv.blocks[name].as_matrix()),
                ref[np.ix_(rows, rows)],
                atol=1e-12,
            )


def test_operator_methods_on_slices():
    model, batch = Scanned(jax.random.key(0)), _data((D,))
    curv = ef.curvature(ce, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    params = eqx.filter(model, eqx.is_inexact_array)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    v = jax.random.normal(jax.random.key(3), flat.shape, F64)
    mat = np.asarray(curv.as_matrix())
    mv = jax.flatten_util.ravel_pytree(curv.mv(unravel(v)))[0]
    np.testing.assert_allclose(mv, mat @ v, atol=1e-12)
    x = jax.flatten_util.ravel_pytree(curv.solve(unravel(mat @ v + 0.1 * v), 0.1))[0]
    np.testing.assert_allclose(x, v, rtol=1e-8)
    diag = jax.flatten_util.ravel_pytree(curv.diagonal())[0]
    np.testing.assert_allclose(diag, np.diag(mat), atol=1e-12)
    sign, logdet = np.linalg.slogdet(mat + 0.1 * np.eye(len(v)))
    np.testing.assert_allclose(curv.logdet(0.1), logdet, rtol=1e-10)


def test_where_selects_the_stacked_leaves():
    model, batch = Scanned(jax.random.key(0)), _data((D,))
    where = ef.filters.by_path("layers.*")
    curv = ef.curvature(
        ce, model, batch, estimator=ef.GGN(), structure=ef.KFAC(), where=where
    )
    assert sorted(curv.blocks) == ["layers[0]", "layers[1]", "layers[2]"]
    full = ef.curvature(ce, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    n = 3 * D * D + 3 * D
    np.testing.assert_allclose(
        curv.as_matrix(), np.asarray(full.as_matrix())[:n, :n], atol=1e-12
    )


def test_shared_cell_is_one_layer_used_at_every_step():
    model = Recurrent(jax.random.key(0))
    batch = _data((3, D))
    report = ef.find_layers(ce, model, batch)
    assert [(li.name, li.uses) for li in report.layers] == [("cell", 3), ("head", 1)]
    ref = _ggn(model, batch)
    for structure in (ef.Dense(), ef.Diagonal()):
        curv = ef.curvature(ce, model, batch, estimator=ef.GGN(), structure=structure)
        expected = ref if isinstance(structure, ef.Dense) else np.diag(np.diag(ref))
        np.testing.assert_allclose(curv.as_matrix(), expected, atol=1e-12)


def test_kept_scans_have_no_length_limit():
    # A scan over stacked leaves stays a scan: `max_unroll` does not apply to it.
    model, batch = Scanned(jax.random.key(0)), _data((D,))
    with ef.configure(max_unroll=2):
        report = ef.find_layers(ce, model, batch)
    assert [li.name for li in report.layers] == NAMES["scanned"]
    assert report.unmatched == ()


def test_long_unrolled_scans_are_not_unrolled():
    # Nested scans over stacked leaves are unrolled (the inner one), up to
    # `max_unroll` steps; a longer inner scan stays opaque inside the outer one.
    model, batch = Nested(jax.random.key(0)), _data((D,))
    with ef.configure(max_unroll=1):
        report = ef.find_layers(ce, model, batch)
        curv = ef.curvature(ce, model, batch, estimator=ef.GGN(), structure=ef.Dense())
    assert [li.name for li in report.layers] == ["head"]
    assert report.unmatched == tuple(
        f".layers.{leaf}[{k}]" for leaf in ("weight", "bias") for k in range(2)
    )
    assert all("not unrolled" in r for r in report.reasons)
    np.testing.assert_allclose(curv.as_matrix(), _ggn(model, batch), atol=1e-12)


def _loss_per_step(model, batch):
    """A loss registered at every step of a scan over time that reads no
    parameter: the model runs outside it (features (T, N, D), labels (T, N))."""
    x, y = batch
    logits = jax.vmap(jax.vmap(model))(x)

    def step(carry, xy):
        return carry, ef.softmax_cross_entropy(*xy)

    return jnp.mean(jax.lax.scan(step, None, (logits, y))[1])


def test_a_loss_registered_in_a_scan_reading_no_parameter():
    # Such a scan was not unrolled, so its losses went unseen ("registers no
    # loss"); beyond `max_unroll` it is refused, naming the option.
    model = eqx.nn.MLP(D, 3, 5, 1, activation=jnp.tanh, key=jax.random.key(0))
    model = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, model
    )
    x = jax.random.normal(jax.random.key(1), (4, 6, D), jnp.float64)
    y = jnp.arange(24).reshape(4, 6) % 3
    examples = ef.IndependentExamples(axis=1)
    curv = ef.curvature(
        _loss_per_step,
        model,
        (x, y),
        estimator=ef.GGN(),
        structure=ef.Dense(),
        examples=examples,
    )
    # The same objective, written without the scan.
    expected = dense_ggn_cross_entropy(model, x.reshape(24, D), y.reshape(24))
    np.testing.assert_allclose(curv.as_matrix(), expected, rtol=1e-10, atol=1e-12)
    with ef.configure(max_unroll=3), pytest.raises(ValueError, match=r"max_unroll=4"):
        ef.curvature(
            _loss_per_step, model, (x, y), estimator=ef.GGN(), structure=ef.KFAC()
        )


def test_stacked_leaf_also_read_outside_the_scan():
    class Leaky(Scanned):
        def __call__(self, x):
            return super().__call__(x) + jnp.sum(self.layers.bias)

    model, batch = Leaky(jax.random.key(0)), _data((D,))
    report = ef.find_layers(ce, model, batch)
    assert [li.name for li in report.layers] == ["head"]
    assert report.unmatched == tuple(
        f".layers.{leaf}[{k}]" for leaf in ("weight", "bias") for k in range(3)
    )
    assert any("outside the scan" in r for r in report.reasons)
    ref = _ggn(model, batch)
    curv = ef.curvature(ce, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    n = 3 * D * D + 3 * D
    np.testing.assert_allclose(
        np.asarray(curv.as_matrix())[:n, :n], np.diag(np.diag(ref)[:n]), atol=1e-12
    )


def test_stacked_leaves_scanned_twice():
    class Twice(Scanned):
        def __call__(self, x):
            params, static = eqx.partition(self.layers, eqx.is_array)

            def body(h, p):
                return jnp.tanh(eqx.combine(p, static)(h)), None

            h = jax.lax.scan(body, x, params)[0]
            return self.head(jax.lax.scan(body, h, params)[0])

    model, batch = Twice(jax.random.key(0)), _data((D,))
    report = ef.find_layers(ce, model, batch)
    assert [li.name for li in report.layers] == ["head"]
    assert len(report.unmatched) == 6
    assert all("outside the scan" in r for r in report.reasons)
    ref = _ggn(model, batch)
    for structure in (ef.Dense(), ef.Diagonal(), ef.KFAC()):
        curv = ef.curvature(ce, model, batch, estimator=ef.GGN(), structure=structure)
        got = np.asarray(curv.as_matrix())
        n = got.shape[0] if isinstance(structure, ef.Diagonal) else 3 * D * D + 3 * D
        if isinstance(structure, ef.Dense):
            np.testing.assert_allclose(got, ref, atol=1e-12)
        else:  # the stacked leaves' units (all for Diagonal) are exact diagonals
            np.testing.assert_allclose(
                got[:n, :n], np.diag(np.diag(ref)[:n]), atol=1e-12
            )


def test_value_grad_and_curvature_and_kfac_training():
    model, batch = Scanned(jax.random.key(0)), _data((D,), n=32)
    fn = ef.value_grad_and_curvature(ce, estimator=ef.GGN(), structure=ef.KFAC())
    loss, grads, curv = fn(model, batch)
    ref_loss, ref_grads = eqx.filter_value_and_grad(ce)(model, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
    assert tree_allclose(grads, ref_grads)
    assert len(curv.blocks) == 4

    like = ef.optim.curvature_like(fn, model, batch)
    opt = ef.optim.kfac(0.2, like=like, damping=1e-2, inverse_every=1)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = opt.init(params)

    @eqx.filter_jit
    def step(model, state):
        loss, grads, curv = fn(model, batch)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = opt.update(grads, state, params, curvature=curv)
        return eqx.apply_updates(model, updates), state, loss

    for _ in range(15):
        model, state, loss = step(model, state)
    assert float(ce(model, batch)) < 0.5 * float(ref_loss)


def _while_loops(fn, model, batch) -> int:
    """The number of XLA `while` loops in the compiled program of `fn(model, batch)`."""
    params, static = eqx.partition(model, eqx.is_array)
    jitted = jax.jit(lambda p, b: fn(eqx.combine(p, static), b))
    return jitted.lower(params, batch).compile().as_text().count(" while(")


class _Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    up: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(D, dtype=F64)
        self.attention = eqx.nn.MultiheadAttention(2, D, dtype=F64, key=k1)
        self.up = eqx.nn.Linear(D, D, dtype=F64, key=k2)

    def __call__(self, x):  # (T, D)
        h = jax.vmap(self.norm)(x)
        x = x + self.attention(h, h, h)
        return x + jax.vmap(self.up)(jnp.tanh(x))


class TinyGPT(eqx.Module):
    """Stacked attention blocks applied by `lax.scan`, as in a GPT."""

    blocks: _Block
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.blocks = eqx.filter_vmap(_Block)(jax.random.split(k1, 2))
        self.head = eqx.nn.Linear(D, 2, dtype=F64, key=k2)

    def __call__(self, x):  # (T, D) -> (2,)
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def body(h, p):
            return eqx.combine(p, static)(h), None

        return self.head(jax.lax.scan(body, x, params)[0].mean(0))


def _while_loops(fn, model, batch) -> int:
    """The number of XLA `while` loops in the compiled program of `fn(model, batch)`."""
    params, static = eqx.partition(model, eqx.is_array)
    jitted = jax.jit(lambda p, b: fn(eqx.combine(p, static), b))
    return jitted.lower(params, batch).compile().as_text().count(" while(")


def test_statistics_run_each_scan_forward_once():
    # The gradient and the curvature vectors pull back through one linearisation:
    # the scan runs forward once, backward once for the gradient and once (batched)
    # for the vectors. XLA merged the forward traced twice for a small MLP stack,
    # but not for attention blocks.
    model, batch = TinyGPT(jax.random.key(0)), _data((3, D))
    kfac = ef.filters.by_path("blocks.attention.*") | ef.filters.by_path("*up.*")
    grad = eqx.filter_value_and_grad(ce)
    vgc = ef.value_grad_and_curvature(
        ce,
        estimator=ef.GGN(),
        structure=ef.KFAC(),
        where=kfac | ef.filters.by_path("head.*"),
    )
    assert _while_loops(grad, model, batch) == 2
    assert _while_loops(vgc, model, batch) == 3


class _OneRow(eqx.Module):
    """One row of a table read as a shift: no stack of layers."""

    linear: eqx.nn.Linear
    table: jax.Array

    def __call__(self, x):
        return self.linear(x) + self.table[1]


def test_one_step_of_a_leaf_read_alone_is_no_layer():
    # Had `table[1]` been cut from the table as a loop's layer, the other rows
    # would have been in no block: `mv` disagreed with `as_matrix` by 1.0.
    linear = eqx.nn.Linear(D, 2, dtype=F64, key=jax.random.key(0))
    model = _OneRow(linear, jax.random.normal(jax.random.key(1), (3, 2), F64))
    batch = _data((D,))
    assert ef.find_layers(ce, model, batch).unmatched == (".table",)
    v = jax.tree.map(jnp.ones_like, eqx.filter(model, eqx.is_inexact_array))
    flat = jax.flatten_util.ravel_pytree
    for structure in (ef.Diagonal(), ef.KFAC()):
        curv = ef.curvature(ce, model, batch, estimator=ef.GGN(), structure=structure)
        np.testing.assert_allclose(
            flat(curv.mv(v))[0], curv.as_matrix() @ flat(v)[0], atol=1e-14
        )
    ref = _ggn(model, batch)
    diag = ef.curvature(ce, model, batch, estimator=ef.GGN(), structure=ef.Diagonal())
    np.testing.assert_allclose(diag.as_matrix(), np.diag(np.diag(ref)), atol=1e-12)
