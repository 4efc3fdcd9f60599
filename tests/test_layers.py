"""Layer detection on the model zoo: exact layers, unmatched leaves, reports, errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqfisher as ef
from eqfisher.internal import split, stage_loss

from .helpers import block_slices, dense_ggn
from .zoo import BY_NAME, F64, ZOO, ZooEntry


@pytest.mark.parametrize("entry", ZOO, ids=[e.name for e in ZOO])
def test_zoo_detection(entry: ZooEntry):
    model, batch = entry.build()
    report = ef.find_layers(entry.loss_fn, model, batch)
    assert tuple(report.layers) == tuple(
        ef.LayerInfo(name, kind, paths) for name, kind, paths in entry.layers
    )
    assert report.unmatched == tuple(path for path, _ in entry.unmatched)
    assert len(report.reasons) == len(entry.unmatched)
    for reason, (_, expected) in zip(report.reasons, entry.unmatched, strict=False):
        assert expected in reason


@pytest.mark.parametrize("entry", ZOO, ids=[e.name for e in ZOO])
def test_zoo_report_table(entry: ZooEntry):
    model, batch = entry.build()
    table = str(ef.find_layers(entry.loss_fn, model, batch))
    lines = table.splitlines()
    assert lines[0].split() == ["layer", "kind", "parameters"]
    assert set(lines[1]) == {"-"}
    assert len(lines) == 2 + len(entry.layers) + len(entry.unmatched)
    for line, (name, kind, paths) in zip(lines[2:], entry.layers, strict=False):
        assert line.split()[:2] == [name, kind]
        assert line.endswith(", ".join(paths))
    for line, (path, _) in zip(
        lines[2 + len(entry.layers) :], entry.unmatched, strict=False
    ):
        assert line.startswith("(unmatched)")
        assert path in line


@pytest.mark.parametrize("entry", ZOO, ids=[e.name for e in ZOO])
def test_zoo_strict(entry: ZooEntry):
    model, batch = entry.build()
    if not entry.unmatched:
        report = ef.find_layers(entry.loss_fn, model, batch, strict=True)
        assert report.unmatched == ()
        return
    with pytest.raises(ValueError, match="strict=True") as info:
        ef.find_layers(entry.loss_fn, model, batch, strict=True)
    for path, reason in entry.unmatched:
        assert path in str(info.value)
        assert reason in str(info.value)


def test_tied_reason_mentions_shared():
    entry = BY_NAME["tied"]
    model, batch = entry.build()
    report = ef.find_layers(entry.loss_fn, model, batch)
    assert report.unmatched[0] == ".embed.weight"
    assert "shared" in report.reasons[0]


class _RowByRow(eqx.Module):
    """An embedding table read one token at a time: two embedding lookups."""

    emb: eqx.nn.Embedding
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.emb = eqx.nn.Embedding(10, 4, key=k1)
        self.out = eqx.nn.Linear(8, 3, key=k2)

    def __call__(self, toks):
        w = self.emb.weight
        return self.out(jnp.concatenate([w[toks[0]], w[toks[1]]]))


def test_embedding_read_row_by_row_names_the_one_lookup_fix():
    model = _RowByRow(jr.key(0))
    toks = jr.randint(jr.key(1), (16, 2), 0, 10)

    def loss_fn(model, batch):
        return ef.softmax_cross_entropy(jax.vmap(model)(batch[0]), batch[1])

    report = ef.find_layers(loss_fn, model, (toks, jnp.arange(16) % 3))
    assert report.unmatched == (".emb.weight",)
    assert "2 separate embedding applications" in report.reasons[0]
    assert "weight[tokens]" in report.reasons[0]


def test_no_registered_loss():
    model, (x, y) = BY_NAME["mlp"].build()

    def plain_loss(model, batch):
        x, y = batch
        logits = jax.vmap(model)(x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    with pytest.raises(ValueError, match="`loss_fn`") as info:
        ef.find_layers(plain_loss, model, (x, y))
    message = str(info.value)
    assert "plain_loss" in message
    for name in (
        "eqfisher.softmax_cross_entropy",
        "eqfisher.sigmoid_cross_entropy",
        "eqfisher.squared_error",
        "eqfisher.register_loss",
    ):
        assert name in message


def test_loss_fn_not_callable():
    # Under the runtime type checker the annotation rejects it first; both errors
    # name `loss_fn`.
    with pytest.raises(TypeError, match="loss_fn"):
        ef.layer_vjp(3)


def test_parameter_not_reaching_the_loss():
    class Extra(eqx.Module):
        linear: eqx.nn.Linear
        unused: jax.Array

        def __call__(self, x):
            return self.linear(x)

    model = Extra(eqx.nn.Linear(3, 2, dtype=F64, key=jr.key(0)), jnp.ones(4, F64))
    x, y = jnp.ones((2, 3), F64), jnp.zeros((2, 2), F64)

    def loss_fn(model, batch):
        x, y = batch
        return ef.squared_error(jax.vmap(model)(x), y)

    report = ef.find_layers(loss_fn, model, (x, y))
    assert report.layers == (
        ef.LayerInfo("linear", "dense", (".linear.weight", ".linear.bias")),
    )
    assert report.unmatched == (".unused",)
    assert report.reasons == ("does not affect any registered loss",)


def test_parameter_reaching_the_loss_only_through_stop_gradient():
    # A buffer read through `stop_gradient` has zero curvature: it is reported as
    # such, not as "no layer pattern". A layer whose weight is also read through
    # `stop_gradient` (a norm statistic) is still a dense layer: the read has no
    # derivative, so its blocks are exact.
    class Buffered(eqx.Module):
        linear: eqx.nn.Linear
        head: eqx.nn.Linear
        shift: jax.Array

        def __call__(self, x):
            scale = 1 + jax.lax.stop_gradient(jnp.sum(self.linear.weight**2))
            h = self.linear(x + jax.lax.stop_gradient(self.shift))
            return self.head(jnp.tanh(h / scale))

    model = Buffered(
        eqx.nn.Linear(3, 4, dtype=F64, key=jr.key(0)),
        eqx.nn.Linear(4, 2, dtype=F64, key=jr.key(1)),
        jnp.ones(3, F64),
    )
    x, y = jr.normal(jr.key(2), (5, 3), F64), jr.normal(jr.key(3), (5, 2), F64)

    def loss_fn(model, batch):
        x, y = batch
        return ef.squared_error(jax.vmap(model)(x), y)

    report = ef.find_layers(loss_fn, model, (x, y))
    assert [layer.name for layer in report.layers] == ["linear", "head"]
    assert report.unmatched == (".shift",)
    assert "only through `stop_gradient`" in report.reasons[0]
    curv = ef.curvature(
        loss_fn, model, (x, y), estimator=ef.GGN(), structure=ef.BlockDiagonal()
    )
    dense = dense_ggn(
        lambda m: jax.vmap(m)(x), lambda out: ef.squared_error(out, y), model
    )
    leaves = block_slices(model)  # linear's weight, bias; head's; shift
    blocks = np.zeros_like(dense)
    for first, last in [(0, 1), (2, 3)]:
        part = slice(leaves[first].start, leaves[last].stop)
        blocks[part, part] = dense[part, part]
    np.testing.assert_allclose(curv.as_matrix(), blocks, atol=1e-13)
    assert np.abs(dense[-3:]).max() == 0


def test_weight_used_outside_its_layer():
    # The weight is also used in a penalty on the model outputs: not a dense layer.
    class Penalised(eqx.Module):
        linear: eqx.nn.Linear

        def __call__(self, x):
            return self.linear(x) + jnp.sum(self.linear.weight**2)

    model = Penalised(eqx.nn.Linear(3, 2, dtype=F64, key=jr.key(0)))
    x, y = jnp.ones((2, 3), F64), jnp.zeros((2, 2), F64)

    def loss_fn(model, batch):
        x, y = batch
        return ef.squared_error(jax.vmap(model)(x), y)

    report = ef.find_layers(loss_fn, model, (x, y))
    assert report.layers == ()
    assert report.unmatched == (".linear.weight", ".linear.bias")
    assert "also used outside its dense layer" in report.reasons[0]
    assert "`.linear.weight`, which is unmatched" in report.reasons[1]


def test_jitted_layer_called_twice_is_shared():
    # One jitted function applied to two different layers inlines twice, giving two
    # layers; the same layer called twice is one tied layer used twice.
    class Twice(eqx.Module):
        a: eqx.nn.Linear
        b: eqx.nn.Linear

        def __call__(self, x):
            apply = eqx.filter_jit(lambda layer, x: jnp.tanh(layer(x)))
            return self.b(apply(self.a, apply(self.a, x))) + apply(self.b, x)

    k1, k2 = jr.split(jr.key(0))
    model = Twice(
        eqx.nn.Linear(3, 3, dtype=F64, key=k1), eqx.nn.Linear(3, 3, dtype=F64, key=k2)
    )
    x, y = jnp.ones((2, 3), F64), jnp.zeros((2, 3), F64)

    def loss_fn(model, batch):
        x, y = batch
        return ef.squared_error(jax.vmap(model)(x), y)

    report = ef.find_layers(loss_fn, model, (x, y))
    assert report.layers == (
        ef.LayerInfo("a", "dense", (".a.weight", ".a.bias"), uses=2),
        ef.LayerInfo("b", "dense", (".b.weight", ".b.bias"), uses=2),
    )
    assert report.unmatched == ()


def test_grouped_conv_is_detected_and_refused_by_kfac():
    # Grouped convolutions are detected; their curvature is block-diagonal over the
    # groups, which K-FAC does not support yet: it says so instead of guessing.
    class Grouped(eqx.Module):
        conv: eqx.nn.Conv1d

        def __call__(self, x):
            return self.conv(x).reshape(-1)

    model = Grouped(eqx.nn.Conv1d(4, 2, 3, groups=2, dtype=F64, key=jr.key(0)))
    x, y = jnp.ones((2, 4, 5), F64), jnp.zeros((2, 6), F64)

    def loss_fn(model, batch):
        x, y = batch
        return ef.squared_error(jax.vmap(model)(x), y)

    report = ef.find_layers(loss_fn, model, (x, y))
    assert report.layers == (
        ef.LayerInfo("conv", "conv", (".conv.weight", ".conv.bias")),
    )
    assert report.unmatched == ()
    with pytest.raises(ValueError, match="grouped convolution"):
        ef.curvature(loss_fn, model, (x, y), estimator=ef.GGN(), structure=ef.KFAC())
    diag = ef.curvature(
        loss_fn, model, (x, y), estimator=ef.GGN(), structure=ef.Diagonal()
    )
    dense = ef.curvature(
        loss_fn, model, (x, y), estimator=ef.GGN(), structure=ef.Dense()
    )
    np.testing.assert_allclose(
        jnp.diag(diag.as_matrix()), jnp.diag(dense.as_matrix()), atol=1e-12
    )


def test_records_of_mlp():
    entry = BY_NAME["mlp"]
    model, batch = entry.build()
    records = stage_loss(entry.loss_fn, split(model, batch)).layers
    dims = [(r.d_in, r.d_out) for r in records]
    assert dims == [(4, 8), (8, 8), (8, 3)]
    assert [r.param_indices for r in records] == [(0, 1), (2, 3), (4, 5)]
    # vmapped eqx.nn.Linear is dot_general(W, x) then transpose: the weight is the
    # left operand and the output gets its features last after the transpose.
    assert all(r.core.name == "dot_general" for r in records)
    assert all(r.weight_perm == (0, 1) for r in records)


def test_records_of_transformer():
    entry = BY_NAME["transformer"]
    model, batch = entry.build()
    records = stage_loss(entry.loss_fn, split(model, batch)).layers
    kinds = {r.name: (r.kind.name, r.d_in, r.d_out) for r in records}
    assert kinds == {
        "embed": ("embedding", 11, 8),
        "attn.query_proj": ("dense", 8, 8),
        "attn.key_proj": ("dense", 8, 8),
        "attn.value_proj": ("dense", 8, 8),
        "attn.output_proj": ("dense", 8, 8),
        "norm": ("scale_and_shift", 8, 8),
        "head": ("dense", 8, 11),
    }


class _GRU(eqx.Module):
    cell: eqx.nn.GRUCell
    out: eqx.nn.Linear

    def __call__(self, seq):
        def step(h, x):
            return self.cell(x, h), None

        h, _ = jax.lax.scan(step, jnp.zeros(self.cell.hidden_size), seq)
        return self.out(h)


def test_layers_of_one_module_at_every_step_are_numbered_in_order():
    # A GRU cell's three layers, used at each of five unrolled steps, were named
    # `cell`, `cell#2`, `cell#7`: the later steps' uses took numbers too.
    model = _GRU(
        eqx.nn.GRUCell(3, 5, key=jr.key(0)), eqx.nn.Linear(5, 4, key=jr.key(1))
    )
    seq, y = jr.normal(jr.key(2), (6, 5, 3)), jnp.arange(6) % 4

    def loss_fn(m, b):
        return ef.softmax_cross_entropy(jax.vmap(m)(b[0]), b[1])

    report = ef.find_layers(loss_fn, model, (seq, y))
    assert [layer.name for layer in report.layers] == [
        "cell",
        "cell#2",
        "cell#3",
        "out",
    ]
    curv = ef.curvature(
        loss_fn, model, (seq, y), estimator=ef.GGN(), structure=ef.KFAC()
    )
    assert list(curv.blocks) == ["cell", "cell#2", "cell#3", "out"]


def test_a_derivative_of_the_model_outside_the_curvature_keeps_k_fac():
    # A Jacobian of the model that carries no curvature (a metric in `aux`, or a
    # penalty under `ef.stop_hessian`) is a bias-free application of each weight:
    # it untied every layer of a biased MLP, whose K-FAC became exact diagonals.
    model = eqx.nn.MLP(3, 2, 5, 1, activation=jnp.tanh, key=jax.random.key(0))
    batch = (jax.random.normal(jax.random.key(1), (4, 3)), jnp.arange(4) % 2)

    def plain(m, b):
        return ef.softmax_cross_entropy(jax.vmap(m)(b[0]), b[1])

    def jacobian_norm(m, x):
        tangents = jax.vmap(lambda q: jax.jvp(m, (q,), (jnp.ones(3),))[1])(x)
        return jnp.mean(tangents**2)

    def with_aux(m, b):
        return plain(m, b), jacobian_norm(m, b[0])

    def penalised(m, b):
        return plain(m, b) + ef.stop_hessian(lambda n: 0.1 * jacobian_norm(n, b[0]))(m)

    def kfac(loss_fn, **aux):
        vgc = ef.value_grad_and_curvature(
            loss_fn, estimator=ef.GGN(), structure=ef.KFAC(), **aux
        )
        return vgc(model, batch)[2]

    expected = kfac(plain)
    for got in (kfac(with_aux, has_aux=True), kfac(penalised)):
        assert {type(b) for b in got.blocks.values()} == {ef.blocks.KroneckerFactored}
        np.testing.assert_allclose(got.as_matrix(), expected.as_matrix(), rtol=1e-12)


def test_a_registered_jacobian_penalty_is_named_as_the_untying_use():
    # The penalty's tangent `W @ dx` applies each weight again without its bias;
    # the reason said to tie the biases, which the model cannot.
    model = eqx.nn.MLP(3, 2, 5, 1, activation=jnp.tanh, key=jax.random.key(0))
    batch = (jax.random.normal(jax.random.key(1), (4, 3)), jnp.arange(4) % 2)

    def loss_fn(m, b):
        tangents = jax.vmap(lambda q: jax.jvp(m, (q,), (jnp.ones(3),))[1])(b[0])
        fit = ef.softmax_cross_entropy(jax.vmap(m)(b[0]), b[1])
        return fit + 0.1 * ef.squared_error(tangents, jnp.zeros_like(tangents))

    report = str(ef.find_layers(loss_fn, model, batch))
    assert "tied between 3 dense layers" in report
    assert "a derivative of the model (a `jax.jvp`" in report
