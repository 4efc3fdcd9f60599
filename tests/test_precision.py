"""Mixed precision: bfloat16 models give float32 statistics; float64 stays float64."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqfisher as ef


STRUCTURES = [ef.KFAC(), ef.EKFAC(), ef.Diagonal(), ef.BlockDiagonal(), ef.Dense()]


def _setup(dtype):
    model = eqx.nn.MLP(
        4, 3, 8, 1, activation=jnp.tanh, key=jax.random.key(0), dtype=dtype
    )
    x = jax.random.normal(jax.random.key(1), (16, 4)).astype(dtype)
    y = jax.random.randint(jax.random.key(2), (16,), 0, 3)
    return model, (x, y)


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize(
    "dtype, expected",
    [
        (jnp.bfloat16, jnp.float32),
        (jnp.float32, jnp.float32),
        (jnp.float64, jnp.float64),
    ],
)
def test_statistics_dtype(structure, dtype, expected):
    model, batch = _setup(dtype)
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)
    for block in curv.blocks.values():
        for leaf in jax.tree_util.tree_leaves(block):
            assert leaf.dtype == expected
    # Products and the diagonal come back in the parameters' dtype.
    params = eqx.filter(model, eqx.is_inexact_array)
    for out in (curv.solve(params, 1e-2), curv.mv(params), curv.diagonal()):
        for leaf in jax.tree_util.tree_leaves(out):
            assert leaf.dtype == dtype


def test_bfloat16_statistics_are_close_to_float32():
    m16, b16 = _setup(jnp.bfloat16)
    m32 = jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float32) if eqx.is_inexact_array(x) else x, m16
    )
    b32 = (b16[0].astype(jnp.float32), b16[1])
    c16, c32 = (
        ef.curvature(loss_fn, m, b, estimator=ef.GGN(), structure=ef.KFAC()).as_matrix()
        for m, b in ((m16, b16), (m32, b32))
    )
    assert float(jnp.max(jnp.abs(c16 - c32)) / jnp.max(jnp.abs(c32))) < 0.05
    np.testing.assert_array_equal(np.asarray(c16).shape, np.asarray(c32).shape)


def _cast(tree, dtype):
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, tree
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_laplace_of_a_half_precision_model_keeps_float32_hyperparameters(dtype):
    # N, δ, σ and T were kept in the parameters' dtype: in bfloat16, log det Λ
    # (P log N plus the blocks' log-determinants) was 6.7% off that of a float32
    # model holding the same weights.
    model, (x, y) = _setup(dtype)
    wide = _cast(model, jnp.float32)
    kwargs = dict(likelihood="classification", structure=ef.KFAC())
    low = ef.laplace.fit(loss_fn, model, (x, y), **kwargs)
    ref = ef.laplace.fit(loss_fn, wide, (x.astype(jnp.float32), y), **kwargs)
    for value in (low.num_data, low.noise_std, low.temperature, low.loss):
        assert value.dtype == jnp.float32
    assert all(p.dtype == jnp.float32 for p in low.prior_precision.values())
    np.testing.assert_allclose(
        low.log_det_precision(), ref.log_det_precision(), rtol=2e-3
    )
    np.testing.assert_allclose(
        low.log_marginal_likelihood(), ref.log_marginal_likelihood(), rtol=1e-2
    )
    tuned, _ = ef.laplace.optimize_hyperparameters(low, steps=20)
    assert all(jnp.isfinite(p) for p in tuned.prior_precision.values())


def test_float16_losses_and_laplace_count_more_than_65504_examples():
    # A float16 count above 65,504 is inf: the registered loss's mean was NaN,
    # its weights zero, and Laplace refused a `num_data` the user never passed.
    n = 70_000
    x = jax.random.normal(jax.random.key(1), (n, 4))
    y = jax.random.randint(jax.random.key(2), (n,), 0, 3)
    model = eqx.nn.MLP(4, 3, 4, 1, activation=jnp.tanh, key=jax.random.key(0))
    low = _cast(model, jnp.float16)
    wide = _cast(low, jnp.float32)
    value16 = loss_fn(low, (x.astype(jnp.float16), y))
    value32 = loss_fn(wide, (x.astype(jnp.float16).astype(jnp.float32), y))
    assert value16.dtype == jnp.float16
    np.testing.assert_allclose(float(value16), float(value32), rtol=2e-3)
    kwargs = dict(likelihood="classification", structure=ef.KFAC())
    post = ef.laplace.fit(loss_fn, low, (x.astype(jnp.float16), y), **kwargs)
    ref = ef.laplace.fit(
        loss_fn, wide, (x.astype(jnp.float16).astype(jnp.float32), y), **kwargs
    )
    assert float(post.num_data) == n
    np.testing.assert_allclose(
        post.log_marginal_likelihood(), ref.log_marginal_likelihood(), rtol=2e-3
    )


def test_a_float32_layer_in_a_float64_model():
    # `Dense()` stored its one matrix in its first leaf's dtype: float32 here, so
    # the float64 layers' curvature was rounded at 1e-7. And on jax 0.12 the
    # examples-alone check compared the float64 logits at float64's tolerance,
    # though a float32 layer rounds an example alone and the batch apart: `Dense()`
    # refused the model as one whose "examples interact".
    model, batch = _setup(jnp.float64)
    first = model.layers[0]
    model = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[0].bias),
        model,
        (first.weight.astype(jnp.float32), first.bias.astype(jnp.float32)),
    )
    x, y = batch

    def mixed_loss(model, batch):
        x, y = batch
        return ef.softmax_cross_entropy(jax.vmap(model)(x.astype(jnp.float32)), y)

    def last_layer_ggn(weight, bias):
        """The float64 last layer's GGN block (jacfwd and the loss's Hessian)."""
        flat, unravel = jax.flatten_util.ravel_pytree((weight, bias))

        def logits(f):
            w, b = unravel(f)
            m = eqx.tree_at(
                lambda m: (m.layers[-1].weight, m.layers[-1].bias), model, (w, b)
            )
            return jax.vmap(m)(x.astype(jnp.float32))

        out = logits(flat)
        jac = jax.jacfwd(logits)(flat).reshape(out.size, flat.size)

        def loss(o):
            o = o.reshape(out.shape)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(o), y[:, None], 1))

        return np.asarray(jac.T @ jax.hessian(loss)(out.ravel()) @ jac)

    with jax.numpy_dtype_promotion("standard"):
        last = model.layers[-1]
        want = last_layer_ggn(last.weight, last.bias)
        for structure in (ef.Dense(), ef.BlockDiagonal()):
            curv = ef.curvature(
                mixed_loss, model, batch, estimator=ef.GGN(), structure=structure
            )
            # A block's dtype is its widest leaf's: `Dense()`'s is float64.
            widest = {
                name: max(jnp.finfo(x.dtype).bits for x in jax.tree_util.tree_leaves(b))
                for name, b in curv.blocks.items()
            }
            assert widest[list(widest)[-1]] == 64
            got = np.asarray(curv.as_matrix())[-want.shape[0] :, -want.shape[0] :]
            # To the float32 layer's rounding: eqfisher computes each example alone,
            # the reference the batch, and jax 0.12's float32 products round them
            # apart at 1e-8 here (jax 0.10's agree to 1e-16). The stored dtype
            # above is what failed.
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_a_damping_float32_cannot_hold_is_refused(structure):
    # 1e-40 is positive, but 0 in float32: a NaN solve and a -inf logdet; 1e39 is
    # inf there (a +inf logdet, a zero solve). Both passed the positivity check.
    model, batch = _setup(jnp.float32)
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)
    params = eqx.filter(model, eqx.is_inexact_array)
    logdet = eqx.filter_jit(lambda curv, damping: curv.logdet(damping))
    for damping in (1e-40, 1e39):
        with pytest.raises(ValueError, match=r"In float32, the curvature's dtype"):
            curv.solve(params, damping)
        with pytest.raises(ValueError, match=r"`damping` must be positive"):
            curv.logdet(damping)
        with pytest.raises(eqx.EquinoxRuntimeError, match=r"`damping` must be"):
            logdet(curv, jnp.asarray(damping, jnp.float64))
    for damping in (1e-30, 1e30):  # the range's ends that float32 holds
        solved = curv.solve(params, damping)
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(solved))
        assert bool(jnp.isfinite(curv.logdet(damping)))
        assert bool(jnp.isfinite(logdet(curv, jnp.asarray(damping))))


def test_adaptive_kfac_trains_a_bfloat16_model_under_strict_promotion():
    # The step `alpha·Δ + mu·δ₋₁` came out float32 for bfloat16 leaves, so the
    # state's `previous` changed dtype and the second update was refused ("other
    # blocks or shapes than `like=`"); under strict promotion the bfloat16 Gram
    # matrix met the float32 damping, and the loss the float32 squares.
    model, batch = _setup(jnp.bfloat16)
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=ef.KFAC())
    like = ef.optim.curvature_like(vgc, model, batch)
    opt = ef.optim.kfac_adaptive(like=like, adapt_every=1)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    structure = jax.tree_util.tree_structure(state)
    dtypes = [x.dtype for x in jax.tree_util.tree_leaves(state)]
    step = ef.optim.kfac_step(loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC())
    losses = []
    with jax.numpy_dtype_promotion("strict"):
        for _ in range(3):
            model, state, loss = step(model, state, batch)
            losses.append(float(loss))
    assert jax.tree_util.tree_structure(state) == structure
    assert [x.dtype for x in jax.tree_util.tree_leaves(state)] == dtypes
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.parametrize("structure", [ef.KFAC(), ef.Dense(), ef.Diagonal()])
def test_float16_posterior_covariance_of_many_examples(structure):
    """`covariance_mv` solved at δ/N and divided by N in the vector's float16:
    N = 10⁵ gave a GLM covariance of 0 (δ = 1) or NaN (δ = 10⁻²), and `fit` on
    4,096 examples inf. It solves (B + δ/N I)⁻¹ (v / N) in the blocks' float32."""
    m16, (x, y) = _setup(jnp.float16)
    m32 = _cast(m16, jnp.float32)
    covs = []
    for model, inputs in ((m16, x), (m32, x.astype(jnp.float32))):
        curv = ef.curvature(
            loss_fn, model, (inputs, y), estimator=ef.GGN(), structure=structure
        )
        post = ef.laplace.Laplace(
            curv,
            model,
            loss=loss_fn(model, (inputs, y)),
            num_data=100_000,
            likelihood="classification",
            prior_precision=1.0,
        )
        covs.append(ef.laplace.glm_predictive(post, inputs[:2])[1])
    assert covs[0].dtype == jnp.float16
    np.testing.assert_allclose(
        covs[0].astype(jnp.float32), covs[1], rtol=2e-2, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_linearised_predictive_samples_of_a_half_precision_diagonal_posterior(dtype):
    # A `Diagonal()` posterior samples in float32: the linearised predictive gave
    # `jax.jvp` float32 tangents for half-precision primals ("primal and tangent
    # arguments to jax.jvp do not match").
    model, (x, y) = _setup(dtype)
    post = ef.laplace.fit(
        loss_fn, model, (x, y), likelihood="classification", structure=ef.Diagonal()
    )
    samples = ef.laplace.predictive_samples(post, x[:4], jax.random.key(1), 3)
    assert samples.shape == (3, 4, 3)
    assert bool(jnp.all(jnp.isfinite(samples)))


def test_laplace_diagnosis_and_training_of_a_bfloat16_model_under_strict_promotion():
    # Both summed the bfloat16 leaves' squares with the float32 hyperparameters,
    # which strict dtype promotion refuses (the rest of the API ran).
    model, (x, y) = _setup(jnp.bfloat16)
    kwargs = dict(likelihood="classification", structure=ef.KFAC())
    with jax.numpy_dtype_promotion("strict"):
        post = ef.laplace.fit(loss_fn, model, (x, y), **kwargs)
        diagnosis = ef.laplace.predictive_diagnosis(post, x[:4])
        assert all(
            bool(jnp.all(jnp.isfinite(v))) for v in jax.tree_util.tree_leaves(diagnosis)
        )
        trained, tuned, history = ef.laplace.marglik_training(
            loss_fn,
            model,
            (x, y),
            optimizer=optax.sgd(1e-3),
            steps=2,
            hyper_every=1,
            hyper_steps=1,
            **kwargs,
        )
    trained_params = eqx.filter(trained, eqx.is_inexact_array)
    assert all(
        x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(trained_params)
    )
    assert bool(jnp.all(jnp.isfinite(jnp.asarray(history))))
    assert bool(jnp.isfinite(tuned.log_marginal_likelihood()))


def test_injected_hyperparameters_keep_a_mixed_precision_models_dtypes():
    # `optax.inject_hyperparams` holds momentum, weight decay and the learning rate
    # as float32 arrays: optax's momentum made the bfloat16 leaf's trace (and its
    # update, and so the parameter) float32, and the second step was refused.
    # (Standard promotion: the mixed model's own products, and optax's, mix
    # bfloat16 and float32.)
    model, batch = _setup(jnp.float32)
    model = eqx.tree_at(
        lambda m: m.layers[0].weight, model, model.layers[0].weight.astype(jnp.bfloat16)
    )
    with jax.numpy_dtype_promotion("standard"):
        vgc = ef.value_grad_and_curvature(
            loss_fn, estimator=ef.GGN(), structure=ef.KFAC()
        )
        like = ef.optim.curvature_like(vgc, model, batch)
        opt = optax.inject_hyperparams(ef.optim.kfac)(
            learning_rate=1e-2, like=like, momentum=0.9, weight_decay=1e-4
        )
        state = opt.init(eqx.filter(model, eqx.is_inexact_array))
        dtypes = [x.dtype for x in jax.tree_util.tree_leaves(state)]
        leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array))
        params = [x.dtype for x in leaves]
        step = ef.optim.kfac_step(loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC())
        for _ in range(3):
            model, state, loss = step(model, state, batch)
    assert [x.dtype for x in jax.tree_util.tree_leaves(state)] == dtypes
    trained = eqx.filter(model, eqx.is_inexact_array)
    assert [x.dtype for x in jax.tree_util.tree_leaves(trained)] == params
    assert bool(jnp.isfinite(loss))


@pytest.mark.parametrize("structure", [ef.KFAC(), ef.EKFAC()], ids=repr)
def test_float32_inputs_of_a_float64_model(structure):
    """A float64 model given float32 inputs computes its loss in float64, and
    `Dense()` was exact; K-FAC's input factor was averaged in the inputs' float32
    (1.2e-8 off). It is built in the factor's float64: as with float64 inputs."""
    model = eqx.nn.MLP(
        4, 3, 8, 1, activation=jnp.tanh, key=jax.random.key(0), dtype=jnp.float64
    )
    x32 = jax.random.normal(jax.random.key(1), (64, 4), jnp.float32) / 3
    y = jax.random.randint(jax.random.key(2), (64,), 0, 3)
    with jax.numpy_dtype_promotion("standard"):
        a, b = (
            ef.curvature(
                loss_fn, model, (x, y), estimator=ef.GGN(), structure=structure
            ).as_matrix()
            for x in (x32, x32.astype(jnp.float64))
        )
    np.testing.assert_array_equal(a, b)


def test_a_float16_injected_damping_that_rounds_to_zero_names_the_cast():
    """`inject_hyperparams` casts to a float16 model's dtype, where 1e-8 is 0: the
    refusal said only "got Array(0., dtype=float16)"."""
    model, batch = _setup(jnp.float16)
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    params = eqx.filter(model, eqx.is_inexact_array)
    injected = optax.inject_hyperparams(ef.optim.kfac)
    with pytest.raises(ValueError, match="hyperparam_dtype=jnp.float32"):
        injected(learning_rate=1e-2, like=curv, damping=1e-8).init(params)
    wide = optax.inject_hyperparams(ef.optim.kfac, hyperparam_dtype=jnp.float32)
    state = wide(learning_rate=1e-2, like=curv, damping=1e-8).init(params)
    assert state.hyperparams["damping"].dtype == jnp.float32
    assert float(state.hyperparams["damping"]) > 0
