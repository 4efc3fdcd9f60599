"""Data parallelism through jax.sharding: the batch is sharded over a Mesh of 8 CPU
devices (set in conftest.py), the parameters replicated, and XLA does the reductions.
Results must equal the single-device ones (relative difference <= 1e-5, float32)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqfisher as ef

from .helpers import compiled_during


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


@pytest.fixture(scope="module")
def setup():
    assert len(jax.devices()) == 8, "conftest.py sets jax_num_cpu_devices to 8"
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    # float32, as the module says (conftest.py turns float64 on by default).
    model = eqx.nn.MLP(
        8, 4, 16, 2, activation=jnp.tanh, dtype=jnp.float32, key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (64, 8), jnp.float32)
    y = jax.random.randint(jax.random.key(2), (64,), 0, 4)
    data = NamedSharding(mesh, P("batch"))
    sharded = (
        eqx.filter_shard(model, NamedSharding(mesh, P())),
        (jax.device_put(x, data), jax.device_put(y, data)),
    )
    return (model, (x, y)), sharded


def assert_close(a, b):
    a, b = eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array)
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        scale = float(jnp.max(jnp.abs(u))) + 1e-30
        assert float(jnp.max(jnp.abs(u - v))) / scale <= 1e-5


def test_inputs_are_really_sharded(setup):
    _, (_, (x, _)) = setup
    assert len(x.sharding.device_set) == 8
    assert x.addressable_shards[0].data.shape == (8, 8)


@pytest.mark.parametrize(
    "structure", [ef.KFAC(), ef.EKFAC(), ef.Diagonal(), ef.BlockDiagonal(), ef.Dense()]
)
def test_curvature_matches_one_device(setup, structure):
    (model, batch), (s_model, s_batch) = setup

    @eqx.filter_jit
    def build(m, b):
        c = ef.curvature(loss_fn, m, b, estimator=ef.GGN(), structure=structure)
        return c.as_matrix()

    assert_close(build(model, batch), build(s_model, s_batch))


def test_value_grad_and_curvature_matches_one_device(setup):
    (model, batch), (s_model, s_batch) = setup
    vgc = eqx.filter_jit(
        ef.value_grad_and_curvature(
            loss_fn, estimator=ef.FisherMC(), structure=ef.KFAC()
        )
    )
    key = jax.random.key(3)
    assert_close(vgc(model, batch, key=key), vgc(s_model, s_batch, key=key))


def test_kfac_optimiser_matches_one_device(setup):
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=ef.KFAC())
    like = ef.optim.curvature_like(vgc, *setup[0])
    opt = ef.optim.kfac(0.05, like=like, damping=1e-2, inverse_every=2)

    @eqx.filter_jit
    def step(model, state, batch):
        _, grads, curv = vgc(model, batch)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = opt.update(grads, state, params, curvature=curv)
        return eqx.apply_updates(model, updates), state

    finals = []
    for model, batch in setup:
        state = opt.init(eqx.filter(model, eqx.is_inexact_array))
        for _ in range(4):
            model, state = step(model, state, batch)
        finals.append(model)
    assert_close(finals[0], finals[1])


@pytest.mark.parametrize(
    "make",
    [
        lambda like: ef.optim.kfac(0.05, like=like),
        lambda like: ef.optim.kfac_preconditioner(like=like),
        lambda like: ef.optim.kfac_adaptive(like=like),
    ],
    ids=["kfac", "kfac_preconditioner", "kfac_adaptive"],
)
def test_init_replicates_the_state_over_the_parameters_mesh(setup, make):
    # K-FAC's zeros and optax's counters are made on the default device; on
    # replicated parameters a jitted step then compiled again at its second call.
    (model, batch), (s_model, s_batch) = setup
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=ef.KFAC())
    params = eqx.filter(s_model, eqx.is_inexact_array)
    state = make(ef.optim.curvature_like(vgc, model, batch)).init(params)
    replicated = NamedSharding(params.layers[0].weight.sharding.mesh, P())
    for x in jax.tree_util.tree_leaves(state):
        assert x.sharding.is_equivalent_to(replicated, x.ndim)
    # Parameters on one device: the state stays on the default device.
    one = make(ef.optim.curvature_like(vgc, model, batch)).init(
        eqx.filter(model, eqx.is_inexact_array)
    )
    assert {len(x.sharding.device_set) for x in jax.tree_util.tree_leaves(one)} == {1}


def test_init_puts_the_state_on_the_parameters_other_device(setup):
    # Parameters on one device other than the default: the state was made on the
    # default device, and the step compiled again at its second call.
    (model, batch), _ = setup
    device = jax.devices()[1]
    arrays, static = eqx.partition(model, eqx.is_array)
    model = eqx.combine(jax.device_put(arrays, device), static)
    batch = jax.device_put(batch, device)
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=ef.KFAC())
    opt = ef.optim.kfac(0.05, like=ef.optim.curvature_like(vgc, model, batch))
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    for x in jax.tree_util.tree_leaves(state):
        assert x.sharding.device_set == {device}
    step = ef.optim.kfac_step(loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC())
    model, state, _ = step(model, state, batch)
    assert compiled_during(lambda: step(model, state, batch)) == []


def test_kfac_step_on_replicated_parameters_compiles_once(setup):
    (model, batch), (s_model, s_batch) = setup
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=ef.KFAC())
    opt = ef.optim.kfac(0.05, like=ef.optim.curvature_like(vgc, model, batch))
    state = opt.init(eqx.filter(s_model, eqx.is_inexact_array))
    step = ef.optim.kfac_step(loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC())
    s_model, state, _ = step(s_model, state, s_batch)
    # The second call found its state where the first one left it.
    assert compiled_during(lambda: step(s_model, state, s_batch)) == []


def test_label_checks_do_not_gather_the_batch(setup):
    # The label-range check is Equinox's `error_if`, a `cond` that XLA places on
    # one device: with the labels themselves passed through it, every call
    # gathered the sharded labels there and scattered them back (XLA's "Involuntary
    # full rematerialization" warning). The check now rides on a scalar.
    _, (s_model, s_batch) = setup
    params, static = eqx.partition(s_model, eqx.is_array)

    def value_and_grad(p, b):
        return eqx.filter_value_and_grad(loss_fn)(eqx.combine(p, static), b)

    text = jax.jit(value_and_grad).lower(params, s_batch).compile().as_text()
    results = re.findall(r"= \(([^)]*)\) conditional\(", text)
    assert results, "no `cond` left: the check is gone"
    assert all(re.fullmatch(r"[a-z0-9]+\[\]", r.strip()) for r in results), results


@pytest.mark.parametrize("estimator", [ef.GGN(), ef.FisherExact()])
@pytest.mark.parametrize("structure", [ef.KFAC(), ef.EKFAC()])
def test_output_factors_do_not_gather_the_batch(setup, estimator, structure):
    # G summed the (classes, examples, width) output vectors as one
    # (classes * examples, width) matrix: merging a replicated axis before the
    # sharded one made XLA gather every example's vectors onto every device.
    _, (s_model, s_batch) = setup
    params, static = eqx.partition(s_model, eqx.is_array)

    def build(p, b):
        return ef.curvature(
            loss_fn, eqx.combine(p, static), b, estimator=estimator, structure=structure
        )

    text = jax.jit(build).lower(params, s_batch).compile().as_text()
    gathered = re.findall(r"= (\S+) all-gather\(", text)
    assert not [g for g in gathered if ",64," in g or "[64," in g], gathered


class _ConvNet(eqx.Module):
    """A convolution written NCHW / OIHW (Equinox's), or NHWC / HWIO (Flax's)."""

    kernel: jax.Array
    head: eqx.nn.Linear
    channels_last: bool = eqx.field(static=True)

    def __call__(self, x):  # (2, 7, 7), or (7, 7, 2) channels-last
        spec = (
            ("NHWC", "HWIO", "NHWC") if self.channels_last else ("NCHW", "OIHW", "NCHW")
        )
        h = jax.lax.conv_general_dilated(
            x[None], self.kernel, (2, 2), "VALID", dimension_numbers=spec
        )[0]
        return self.head(jnp.tanh(h).reshape(-1))


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
@pytest.mark.parametrize("structure", [ef.Diagonal(), ef.BlockDiagonal(), ef.EKFAC()])
def test_convolution_per_example_pass_matches_one_device(channels_last, structure):
    # XLA's SPMD partitioner computed a convolution's per-example weight cotangent
    # (a grouped convolution) wrongly for some layouts of a sharded batch: relative
    # error 1 on the kernel's blocks, no error raised. The per-example pass now runs
    # convolutions NCHW / OIHW.
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    shape = (3, 3, 2, 3) if channels_last else (3, 2, 3, 3)
    model = _ConvNet(
        jax.random.normal(k1, shape, jnp.float64) / 3,
        eqx.nn.Linear(27, 4, dtype=jnp.float64, key=k2),
        channels_last,
    )
    x = jax.random.normal(k3, (16, 7, 7, 2) if channels_last else (16, 2, 7, 7))
    y = jnp.arange(16) % 4
    data = NamedSharding(mesh, P("batch"))
    sharded = (jax.device_put(x, data), jax.device_put(y, data))

    def build(b):
        return ef.curvature(loss_fn, model, b, estimator=ef.GGN(), structure=structure)

    one, many = build((x, y)), build(sharded)
    np.testing.assert_allclose(many.as_matrix(), one.as_matrix(), rtol=0, atol=1e-13)
    assert float(jnp.abs(one.diagonal().kernel).max()) > 1e-3


@pytest.mark.parametrize("structure", [ef.KFAC(), ef.Dense()])
def test_curvature_inside_shard_map_averages_to_one_device(setup, structure):
    # With `check_vma=True` (the default) every entry point raised JAX's
    # "unexpected JAX type ... for argument to VJP function"; made to run there, a
    # `Dense()` GGN came out 7 times off (JAX sums the derivatives in replicated
    # parameters over the devices). Refused, with `check_vma=False` the fix.
    (model, batch), (s_model, s_batch) = setup
    mesh = s_batch[0].sharding.mesh
    params, static = eqx.partition(s_model, eqx.is_array)
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=structure)

    def per_device(p, b):
        value, grads, curv = vgc(eqx.combine(p, static), b)
        return jax.lax.pmean(eqx.filter((value, grads, curv), eqx.is_array), "batch")

    def run(**check):
        spec = dict(mesh=mesh, in_specs=(P(), P("batch")), out_specs=P())
        return jax.jit(jax.shard_map(per_device, **spec, **check))(params, s_batch)

    with pytest.raises(ValueError, match=r"Pass `check_vma=False` to `jax.shard_map`"):
        run()
    expected = eqx.filter(vgc(model, batch), eqx.is_array)
    assert_close(run(check_vma=False), expected)

    def operator(p, b):
        return ef.ggn_operator(loss_fn, eqx.combine(p, static), b).mv(p)

    spec = dict(mesh=mesh, in_specs=(P(), P("batch")), out_specs=P())
    for check in ({}, {"check_vma": False}):  # (lineax's message with False)
        with pytest.raises(ValueError, match=r"operators do not run there"):
            jax.jit(jax.shard_map(operator, **spec, **check))(params, s_batch)


def test_collectives_in_loss_fn_are_refused(setup):
    # `lax.pmean` of the loss inside `shard_map` (check_vma=False) raised a bare
    # AssertionError from the tracer.
    _, (s_model, s_batch) = setup
    mesh = s_batch[0].sharding.mesh
    params, static = eqx.partition(s_model, eqx.is_array)

    def averaged(model, batch):
        return jax.lax.pmean(loss_fn(model, batch), "batch")

    def per_device(p, b):
        curv = ef.curvature(
            averaged, eqx.combine(p, static), b, estimator=ef.GGN(), structure=ef.KFAC()
        )
        return eqx.filter(curv, eqx.is_array)

    spec = dict(mesh=mesh, in_specs=(P(), P("batch")), out_specs=P(), check_vma=False)
    with pytest.raises(
        ValueError, match=r"collectives over the devices of `jax.shard_map` \(psum"
    ):
        jax.jit(jax.shard_map(per_device, **spec))(params, s_batch)


def explicit_mesh():
    return jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))


def test_explicit_axes_losses_run_and_curvature_refuses(setup):
    # `jax.make_mesh`'s default axes are `Explicit`: the categorical loss raised
    # JAX's ShardingTypeError (a replicated mask met sharded labels), and the
    # curvature's contractions over the examples raised inside JAX.
    (model, (x, y)), _ = setup
    data = NamedSharding(explicit_mesh(), P("batch"))
    batch = (jax.device_put(x, data), jax.device_put(y, data))
    value = eqx.filter_jit(loss_fn)(model, batch)
    masked = eqx.filter_jit(
        lambda m, b: ef.softmax_cross_entropy(
            jax.vmap(m)(b[0]), b[1], mask=jnp.ones(64)
        )
    )(model, batch)
    np.testing.assert_allclose(value, loss_fn(model, (x, y)), rtol=1e-6)
    np.testing.assert_allclose(masked, value, rtol=1e-6)
    with pytest.raises(ValueError, match=r"type `Explicit` \('batch'\).*AxisType.Auto"):
        ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())


def test_shard_map_on_an_explicit_mesh_averages_to_one_device(setup):
    # jax 0.12 raised "Unexpected XLA sharding override" from the tracer's eager
    # coefficient check under the `Manual` mesh made from `Explicit` axes.
    (model, batch), _ = setup
    mesh = explicit_mesh()
    params, static = eqx.partition(model, eqx.is_array)

    def per_device(p, b):
        curv = ef.curvature(
            loss_fn, eqx.combine(p, static), b, estimator=ef.GGN(), structure=ef.KFAC()
        )
        return jax.lax.pmean(eqx.filter(curv, eqx.is_array), "batch")

    spec = dict(mesh=mesh, in_specs=(P(), P("batch")), out_specs=P(), check_vma=False)
    data = NamedSharding(mesh, P("batch"))
    s_batch = tuple(jax.device_put(a, data) for a in batch)
    got = jax.jit(jax.shard_map(per_device, **spec))(params, s_batch)
    expected = ef.curvature(
        loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
    )
    assert_close(got, eqx.filter(expected, eqx.is_array))
