"""Ordinary user mistakes: each raises an error that names the call, the argument
and the fix, or gives the right answer (checked against dense float64 references
built without eqfisher, tests/helpers.py)."""

import functools as ft
import re
from collections.abc import Callable

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import eqfisher
import eqfisher as ef

from .helpers import dense_empirical_fisher, dense_ggn


F64 = jnp.float64
N, D_IN, CLASSES = 6, 3, 4


@ft.cache
def _problem():
    model = eqx.nn.MLP(
        D_IN, CLASSES, 5, 1, activation=jnp.tanh, dtype=F64, key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (N, D_IN), F64)
    y = jnp.array([0, 1, 2, 3, 0, 1])
    return model, (x, y)


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def _params(model):
    return eqx.filter(model, eqx.is_inexact_array)


@ft.cache
def _vgc():
    return ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=ef.KFAC())


# --- 1. K-FAC used as a plain optax optimiser ------------------------------------


@pytest.mark.parametrize("make", [ef.optim.kfac, ef.optim.kfac_preconditioner])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_kfac_update_without_any_curvature_raises(make, jit):
    model, batch = _problem()
    _, grads, curv = _vgc()(model, batch)
    kwargs = {"like": curv}
    opt = make(0.1, **kwargs) if make is ef.optim.kfac else make(**kwargs)
    params = _params(model)
    update = eqx.filter_jit(opt.update) if jit else opt.update
    error = eqx.EquinoxRuntimeError if jit else ValueError
    with pytest.raises(error, match=r"no curvature estimate given.*curvature=curv"):
        update(grads, opt.init(params), params)
    # Once a curvature has been received, updates without one are the amortised
    # steps between estimates: they precondition with the cached inverse.
    _, state = update(grads, opt.init(params), params, curvature=curv)
    updates, _ = update(grads, state, params)
    assert any(bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates))


def test_kfac_step_between_estimates_passes_the_check_under_vmap():
    # An ensemble: `vmap` over models and states batches the step count, so
    # `kfac_step`'s `lax.cond` runs both branches, the one without curvature at
    # step 0 too; the check must not fire in the branch not taken.
    _, batch = _problem()
    like = ef.optim.curvature_like(_vgc(), *_problem())
    opt = ef.optim.kfac(0.1, like=like)
    step = ef.optim.kfac_step(
        loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC(), curvature_update_period=2
    )
    keys = jax.random.split(jax.random.key(4), 2)
    models = eqx.filter_vmap(
        lambda k: eqx.nn.MLP(D_IN, CLASSES, 5, 1, activation=jnp.tanh, dtype=F64, key=k)
    )(keys)
    states = eqx.filter_vmap(opt.init)(_params(models))
    assert ef.optim.find_kfac_state(states).count.shape == (2,)
    ensemble = eqx.filter_vmap(step, in_axes=(eqx.if_array(0), eqx.if_array(0), None))
    for _ in range(3):
        models, states, loss = ensemble(models, states, batch)
    kstate = ef.optim.find_kfac_state(states)
    assert kstate.curvature_count.tolist() == [2, 2]
    assert bool(jnp.all(jnp.isfinite(loss)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_kfac_like_of_another_model_names_the_block_that_differs(jit):
    # `like` from the width-5 MLP, curvature from a width-7 one: the first block
    # that differs is named, with its factor shapes in both.
    model, batch = _problem()
    like = ef.optim.curvature_like(_vgc(), model, batch)
    opt = ef.optim.kfac(0.1, like=like)
    wider = eqx.nn.MLP(
        D_IN, CLASSES, 7, 1, activation=jnp.tanh, dtype=F64, key=jax.random.key(0)
    )
    _, _, curv = _vgc()(wider, batch)
    _, grads, _ = _vgc()(model, batch)
    params = _params(model)
    update = eqx.filter_jit(opt.update) if jit else opt.update
    match = (
        r"optim\.kfac\(\.\.\.\)\.update\(\.\.\., curvature=\.\.\.\)`: the curvature "
        r"has other blocks or shapes than the optimiser's `like=`: block `layers\[0\]` "
        rf"\(KroneckerFactored\) has a \({D_IN + 1}, {D_IN + 1}\), g \(5, 5\) in "
        rf"`like` but a \({D_IN + 1}, {D_IN + 1}\), g \(7, 7\) in `curvature=`"
    )
    with pytest.raises(ValueError, match=match):
        update(grads, opt.init(params), params, curvature=curv)


def test_kfac_like_with_other_blocks_names_the_missing_block():
    # `like` of the whole model, curvature of its last layer only (`where=`).
    model, batch = _problem()
    opt = ef.optim.kfac(0.1, like=ef.optim.curvature_like(_vgc(), model, batch))
    last = ef.value_grad_and_curvature(
        loss_fn,
        estimator=ef.GGN(),
        structure=ef.KFAC(),
        where=ef.filters.by_path("layers[1].*"),
    )
    _, _, curv = last(model, batch)
    assert list(curv.blocks) == ["layers[1]"]
    params = _params(model)
    with pytest.raises(
        ValueError, match=r"block `layers\[0\]` of `like` is missing from `curvature=`"
    ):
        opt.update(_vgc()(model, batch)[1], opt.init(params), params, curvature=curv)


# --- 2. schedules with values out of range, under jit ----------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(damping=lambda n: jnp.where(n > 0, -0.1, 1e-3)), "damping"),
        (dict(damping=lambda n: jnp.where(n > 0, jnp.nan, 1e-3)), "damping"),
        (dict(learning_rate=lambda n: jnp.where(n > 0, jnp.nan, 0.1)), "learning_rate"),
    ],
    ids=["negative-damping", "nan-damping", "nan-learning-rate"],
)
def test_schedule_values_out_of_range_raise_under_jit(kwargs, name):
    model, batch = _problem()
    _, grads, curv = _vgc()(model, batch)
    kwargs = {"learning_rate": 0.1} | kwargs
    opt = ef.optim.kfac(kwargs.pop("learning_rate"), like=curv, **kwargs)
    params = _params(model)
    update = eqx.filter_jit(opt.update)
    _, state = update(grads, opt.init(params), params, curvature=curv)  # n = 0: fine
    with pytest.raises(
        eqx.EquinoxRuntimeError,
        match=rf"kfac\(\.\.\., {name}=.*`{name}` must be finite",
    ):
        update(grads, state, params, curvature=curv)
    # At `init` (the damping at step 0), outside jit: a `ValueError`.
    if name == "damping":
        bad = ef.optim.kfac(
            0.1, like=curv, damping=lambda n: jnp.where(n >= 0, -0.1, 1.0)
        )
        with pytest.raises(ValueError, match="`damping` must be finite and > 0"):
            bad.init(params)


# --- 3. batch coupling seen only through derivatives -----------------------------


def _straight_through(z):
    m = jnp.mean(z, axis=0, keepdims=True)
    return z + (m - jax.lax.stop_gradient(m))  # zero in value, not in derivative


def _coupled_loss(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(_straight_through(jax.vmap(model)(x)), y)


def _coupled_reference(model, batch):
    x, y = batch
    return _dense_ce(lambda m, x: _straight_through(jax.vmap(m)(x)), model, x, y)


@pytest.mark.parametrize("structure", [ef.Dense(), ef.Diagonal()], ids=repr)
@pytest.mark.parametrize("kind", ["mlp", "layernorm"])
def test_coupling_through_derivatives_is_detected(structure, kind):
    model, batch = _problem()
    if kind == "layernorm":  # per-example rows from the main pass (shift rows)
        model = eqx.nn.LayerNorm(CLASSES, dtype=F64)
        batch = (jax.random.normal(jax.random.key(3), (N, CLASSES), F64), batch[1])
    ref = _coupled_reference(model, batch)
    with pytest.raises(
        eqx.EquinoxRuntimeError, match=r"examples interact.*InteractingExamples"
    ):
        ef.curvature(
            _coupled_loss, model, batch, estimator=ef.GGN(), structure=structure
        )
    exact = ef.curvature(
        _coupled_loss,
        model,
        batch,
        estimator=ef.GGN(),
        structure=ef.Dense(),
        examples=ef.InteractingExamples(),
    ).as_matrix()
    np.testing.assert_allclose(exact, ref, rtol=1e-10, atol=1e-12)
    # The coupling is not small: the per-example GGN is far from the truth.
    alone = ef.curvature(
        loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Dense()
    )
    assert np.max(np.abs(alone.as_matrix() - ref)) > 0.05 * np.max(np.abs(ref))


def _stopped(z):
    # A stop_gradient of each example's own data (as DiCE's `exp(l - stop_gradient(l))`
    # per example): value z, derivative (1 + z) dz; no coupling.
    return z * jnp.exp(z - jax.lax.stop_gradient(z))


def _per_example_stop(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(_stopped(jax.vmap(model)(x)), y)


@pytest.mark.parametrize(
    "fn, outputs, stops",
    [
        (loss_fn, lambda m, x: jax.vmap(m)(x), False),
        (_per_example_stop, lambda m, x: _stopped(jax.vmap(m)(x)), False),
        (_coupled_loss, None, True),
    ],
)
def test_derivatives_are_compared_where_a_stop_gradient_mixes_examples(
    fn, outputs, stops
):
    # The derivative check (a JVP per example) costs about as much to compile as
    # the rest of the per-example pass: it runs only where values can hide a
    # coupling, a stop_gradient of several examples' data.
    from eqfisher._tracer import split, stage_loss, stops_mixed_gradients

    model, batch = _problem()
    s = split(model, batch)
    found = stops_mixed_gradients(stage_loss(fn, s).program, s, batch, 0, "test")
    assert found == stops
    if outputs is not None:  # no coupling: the per-example curvature is exact
        curv = ef.curvature(fn, model, batch, estimator=ef.GGN(), structure=ef.Dense())
        ref = _dense_ce(outputs, model, *batch)
        np.testing.assert_allclose(curv.as_matrix(), ref, rtol=1e-10, atol=1e-12)


# --- 4. class labels out of range ------------------------------------------------


@pytest.mark.parametrize("label", [-1, CLASSES])
@pytest.mark.parametrize("how", ["eager", "jit", "curvature"])
def test_out_of_range_labels_raise(label, how):
    model, (x, y) = _problem()
    batch = (x, y.at[2].set(label))
    match = rf"softmax_cross_entropy\(logits, labels\).*`labels` must be class ids in \[0, {CLASSES}\)"
    if how == "eager":
        with pytest.raises(ValueError, match=match):
            loss_fn(model, batch)
    elif how == "jit":
        with pytest.raises(eqx.EquinoxRuntimeError, match=match):
            eqx.filter_jit(loss_fn)(model, batch)
    else:
        with pytest.raises(eqx.EquinoxRuntimeError, match=match):
            ef.curvature(
                loss_fn,
                model,
                batch,
                estimator=ef.EmpiricalFisher(),
                structure=ef.Dense(),
            )


def test_padding_labels_are_allowed_where_masked():
    model, (x, y) = _problem()
    padded = (x, y.at[-1].set(-1), jnp.arange(N) < N - 1)  # the last is padding

    def masked(model, batch):
        x, y, mask = batch
        return ef.softmax_cross_entropy(jax.vmap(model)(x), y, mask=mask)

    def per_example(model, example):
        xn, yn = example
        return -jax.nn.log_softmax(model(xn))[yn]

    kept = (x[:-1], y[:-1])
    np.testing.assert_allclose(masked(model, padded), loss_fn(model, kept), rtol=1e-12)
    curv = ef.curvature(
        masked, model, padded, estimator=ef.EmpiricalFisher(), structure=ef.Dense()
    )
    ref = dense_empirical_fisher(per_example, model, kept)
    np.testing.assert_allclose(curv.as_matrix(), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "shape, fix, fixed",
    [
        ((N,), "labels.astype(jnp.int32)", lambda labels: labels.astype(jnp.int32)),
        (
            (N, 1),
            "labels[..., 0].astype(jnp.int32)",
            lambda labels: labels[..., 0].astype(jnp.int32),
        ),
    ],
    ids=["(N,)", "(N, 1)"],
)
def test_float_class_ids_say_integers_are_expected(unchecked, shape, fix, fixed):
    model, (x, y) = _problem()
    labels = y.astype(F64).reshape(shape)
    # What is expected (integer class ids of shape (N,), or probabilities of the
    # logits' shape), what was given, and the fix for these labels.
    match = (
        rf"softmax_cross_entropy\(logits, labels\)`: `labels` must be integer class "
        rf"ids of shape logits.shape\[:-1\] = \({N},\) \(an integer dtype, e\.g\. "
        rf"`labels\.astype\(jnp\.int32\)`\) or probability `labels` \(floats\) of the "
        rf"shape of `logits` \({N}, {CLASSES}\); got float `labels` of shape "
        rf"{re.escape(str(shape))}\..*class ids must be integers.*{re.escape(fix)}"
    )
    with pytest.raises(ValueError, match=match):
        loss_fn(model, (x, labels))
    with pytest.raises(ValueError, match=match):
        ef.curvature(
            loss_fn, model, (x, labels), estimator=ef.GGN(), structure=ef.KFAC()
        )
    # The fix the message gives works.
    np.testing.assert_allclose(
        loss_fn(model, (x, fixed(labels))), loss_fn(model, (x, y)), rtol=1e-15
    )


# --- 5. and 6. Laplace hyperparameters and likelihood ----------------------------


@ft.cache
def _laplace():
    model, batch = _problem()
    return ef.laplace.fit(
        loss_fn, model, batch, likelihood="classification", structure=ef.Diagonal()
    )


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(prior_precision=0.0), "prior_precision"),
        (dict(prior_precision=-1.0), "prior_precision"),
        (dict(prior_precision=float("nan")), "prior_precision"),
        (dict(noise_std=-1.0), "noise_std"),
        (dict(noise_std=0.0), "noise_std"),
        (dict(temperature=0.0), "temperature"),
    ],
)
def test_laplace_hyperparameters_out_of_range_raise(kwargs, name):
    # `prior_precision=0` used to be reported as "`damping` must be positive".
    post = _laplace()
    regression = {"likelihood": "regression", "num_outputs": CLASSES}
    extra = regression if name == "noise_std" else {"likelihood": "classification"}
    match = rf"Laplace\(\.\.\., {name}=\.\.\.\)`: `{name}` must be positive"
    with pytest.raises(ValueError, match=match):
        ef.laplace.Laplace(
            post.curvature, post.model, loss=post.loss, num_data=N, **extra, **kwargs
        )
    # StagedLoss (e.g. tuned under jit): checked at run time.
    value = jnp.asarray(next(iter(kwargs.values())), F64)
    if name == "prior_precision":
        with pytest.raises(eqx.EquinoxRuntimeError, match=f"`{name}` must be positive"):
            eqx.filter_jit(
                lambda p, v: p.replace(prior_precision=v).log_marginal_likelihood()
            )(post, value)


def test_laplace_likelihood_must_fit_the_registered_loss():
    model, batch = _problem()
    with pytest.raises(
        ValueError,
        match=r"likelihood='regression'.*Categorical.*likelihood='classification'",
    ):
        ef.laplace.fit(
            loss_fn, model, batch, likelihood="regression", structure=ef.Diagonal()
        )


@pytest.mark.parametrize("factor", [float(N), 0.5])
def test_laplace_fit_refuses_a_loss_times_a_factor(factor):
    # docs/losses.md suggests `n * loss` for the summed likelihood; `fit` builds
    # N·C + δI itself, and took N²·C + δI from it (relative error 12), silently.
    model, batch = _problem()

    def scaled(model, batch):
        return factor * loss_fn(model, batch)

    for fit in [ef.laplace.fit, eqx.filter_jit(ef.laplace.fit)]:
        error = ValueError if fit is ef.laplace.fit else eqx.EquinoxRuntimeError
        with pytest.raises(error, match="must return the mean registered loss"):
            fit(scaled, model, batch, likelihood="classification", structure=ef.Dense())
    # The mean loss: the precision N·C + δI, C the GGN of the mean loss.
    post = ef.laplace.fit(
        loss_fn, model, batch, likelihood="classification", structure=ef.Dense()
    )
    x, y = batch
    ggn = dense_ggn(
        lambda m: jax.vmap(m)(x),
        lambda out: jnp.mean(
            -jnp.take_along_axis(jax.nn.log_softmax(out), y[:, None], 1)
        ),
        model,
    )
    flat, unravel = jax.flatten_util.ravel_pytree(_params(model))
    v = jax.random.normal(jax.random.key(2), flat.shape, F64)
    got = jax.flatten_util.ravel_pytree(post.precision_mv(unravel(v)))[0]
    np.testing.assert_allclose(got, (N * ggn + np.eye(len(v))) @ v, rtol=1e-10)


def test_top_eigenpairs_names_k():
    # k = 100 on 49 parameters used to be reported as "`iterations` must be >= 100".
    op = ef.ggn_operator(loss_fn, *_problem())
    size = sum(x.size for x in jax.tree.leaves(_params(_problem()[0])))
    with pytest.raises(ValueError, match=rf"k=100\)`: `k` must be at most .* {size}"):
        ef.spectral.top_eigenpairs(op, 100, key=jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"`iterations` must lie in \[k, size\] = \[5, "
    ):
        ef.spectral.top_eigenpairs(op, 5, key=jax.random.key(0), iterations=3)


# --- 7. failures of the one-example re-run of `loss_fn` --------------------------


def _hard_coded(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x.reshape(N, D_IN)), y)


def test_one_example_rerun_failures_say_what_happened():
    model, (x, y) = _problem()
    rerun = (
        r"re-ran `loss_fn` on one example.*examples=eqfisher.InteractingExamples\(\)"
    )
    # `Dense()` re-runs `loss_fn` per example (`Diagonal()` of an MLP takes its
    # vectors from the main pass, below).
    kw = dict(estimator=ef.GGN(), structure=ef.Dense())
    with pytest.raises(ValueError, match=rerun):
        ef.curvature(_hard_coded, model, (x, y), **kw)
    # The wrong example axes, with a square batch (every size agrees): the
    # one-example run feeds the model a feature axis of size 1.
    square = eqx.nn.MLP(N, CLASSES, 5, 1, dtype=F64, key=jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (N, N), F64)
    axis = ef.IndependentExamples(axis=(1, 0))
    with pytest.raises(ValueError, match=rerun) as info:
        ef.curvature(loss_fn, square, (xs, y), examples=axis, **kw)
    assert "`examples=eqfisher.IndependentExamples(axis=...)`" in str(info.value)
    # An empty batch has its own error, for every structure, the loss itself (a
    # mean over no examples: NaN) and the matrix-free operators (which gave a
    # matrix of zeros, and a ZeroDivisionError).
    empty = (x[:0], y[:0])
    for structure in (ef.Diagonal(), ef.KFAC()):
        with pytest.raises(ValueError, match=r"the batch holds no examples"):
            ef.curvature(loss_fn, model, empty, estimator=ef.GGN(), structure=structure)
    for build in (ef.ggn_operator, ef.empirical_fisher_operator):
        with pytest.raises(ValueError, match=r"the batch holds no examples"):
            build(loss_fn, model, empty)
    with pytest.raises(ValueError, match=r"the batch holds no examples"):
        loss_fn(model, empty)
    # So has a model of no outputs (no classes).
    with pytest.raises(ValueError, match=r"each example has no outputs"):
        ef.softmax_cross_entropy(jnp.zeros((N, 0)), y)
    # The way out the messages give works: exact, against the dense reference.
    exact = ef.curvature(
        _hard_coded,
        model,
        (x, y),
        estimator=ef.GGN(),
        structure=ef.Dense(),
        examples=ef.InteractingExamples(),
    ).as_matrix()
    ref = _dense_ce(lambda m, x: jax.vmap(m)(x), model, x, y)
    np.testing.assert_allclose(exact, ref, rtol=1e-10, atol=1e-12)
    # An MLP's dense layers applied once per example, its examples proven
    # independent: no re-run, and the exact diagonal of what `loss_fn` computes.
    diagonal = ef.curvature(
        _hard_coded, model, (x, y), estimator=ef.GGN(), structure=ef.Diagonal()
    ).diagonal()
    got = jax.flatten_util.ravel_pytree(diagonal)[0]
    np.testing.assert_allclose(got, np.diag(ref), rtol=1e-10, atol=1e-12)


def _dense_ce(outputs, model, x, y):
    """The dense GGN of the mean cross-entropy of `outputs(model, x)` against `y`."""

    def loss_of(out):
        onehot = jax.nn.one_hot(y, out.shape[-1], dtype=out.dtype)
        return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(out), axis=-1))

    return dense_ggn(lambda m: outputs(m, x), loss_of, model)


# --- 8. a grouped convolution: the advice works ----------------------------------


class _ConvNet(eqx.Module):
    conv: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __call__(self, x):
        return self.head(jnp.tanh(self.conv(x)).reshape(-1))


def _conv_problem():
    conv = eqx.nn.Conv2d(4, 4, 3, groups=2, dtype=F64, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (3, 4, 5, 5), F64)
    y = jnp.array([0, 1, 2])
    net = _ConvNet(conv, eqx.nn.Linear(36, 3, dtype=F64, key=jax.random.key(2)))
    return conv, net, (x, y)


def _flat_loss(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x).reshape(x.shape[0], -1), y)


def test_grouped_convolution_advice_works():
    conv, net, batch = _conv_problem()
    kw = dict(estimator=ef.GGN())
    # As the whole model, excluding it would leave nothing: the advice is another
    # structure, which works and is exact on the diagonal.
    with pytest.raises(
        ValueError, match=r"every parameter selected.*eqfisher.Diagonal\(\)"
    ):
        ef.curvature(_flat_loss, conv, batch, structure=ef.KFAC(), **kw)
    diag = ef.curvature(_flat_loss, conv, batch, structure=ef.Diagonal(), **kw)
    x, y = batch
    ref = _dense_ce(lambda m, x: jax.vmap(m)(x).reshape(x.shape[0], -1), conv, x, y)
    np.testing.assert_allclose(
        np.diag(diag.as_matrix()), np.diag(ref), rtol=1e-10, atol=1e-14
    )
    # Inside a model: each piece of advice, evaluated as written, gives a working
    # call.
    with pytest.raises(ValueError, match="grouped convolution") as info:
        ef.curvature(_flat_loss, net, batch, structure=ef.KFAC(), **kw)
    message = str(info.value)
    where = re.search(r"`where=(~eqfisher\.filters\.by_path\('[^']*'\))`", message)
    per_layer = re.search(r"`structure=(eqfisher\.PerLayer\(.*\)\))`", message)
    assert where and per_layer, message
    scope = {"eqfisher": eqfisher, "KFAC": ef.KFAC}
    rest = ef.curvature(
        _flat_loss, net, batch, structure=ef.KFAC(), where=eval(where[1], scope), **kw
    )
    assert set(rest.blocks) == {"head"}
    mixed = ef.curvature(
        _flat_loss, net, batch, structure=eval(per_layer[1], scope), **kw
    )
    assert isinstance(mixed.blocks["conv"], ef.blocks.DiagonalBlock)
    assert isinstance(mixed.blocks["head"], ef.blocks.KroneckerFactored)


@pytest.mark.parametrize(
    "structure", [ef.Dense(), ef.BlockDiagonal(), ef.Diagonal(), ef.KFAC(), ef.EKFAC()]
)
@pytest.mark.parametrize("damping", [0.0, -1e-3, float("inf"), float("nan")])
def test_solve_and_logdet_refuse_a_damping_that_is_not_positive(structure, damping):
    # A softmax GGN over 6 examples of 4 classes has rank at most 6 · 3 = 18 of its
    # 44 parameters:
    # C + 0·I is singular, so `solve` and `logdet` need λ > 0 (as documented).
    model, batch = _problem()
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)
    grads = eqx.filter_grad(loss_fn)(model, batch)
    with pytest.raises(ValueError, match="`damping` must be positive"):
        curv.solve(grads, damping)
    with pytest.raises(ValueError, match="`damping` must be positive"):
        curv.logdet(damping)
    with pytest.raises(eqx.EquinoxRuntimeError, match="`damping` must be positive"):
        eqx.filter_jit(lambda c, d: c.solve(grads, d))(curv, jnp.asarray(damping))


def test_labels_out_of_range_are_refused_where_they_are_read():
    # docs/losses.md: the loss, `value_grad_and_curvature` and the empirical
    # Fisher read the labels and refuse a class id outside [0, classes); the GGN
    # does not read them, and is the same for any labels.
    model, (x, y) = _problem()
    bad = y.at[2].set(CLASSES + 1)
    with pytest.raises(ValueError, match=r"class ids in \[0, 4\)"):
        loss_fn(model, (x, bad))
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"class ids in \[0, 4\)"):
        _vgc()(model, (x, bad))
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"class ids in \[0, 4\)"):
        ef.curvature(
            loss_fn,
            model,
            (x, bad),
            estimator=ef.EmpiricalFisher(),
            structure=ef.Dense(),
        ).as_matrix()

    def ggn(labels):
        return ef.curvature(
            loss_fn, model, (x, labels), estimator=ef.GGN(), structure=ef.Dense()
        ).as_matrix()

    np.testing.assert_array_equal(ggn(bad), ggn(y))


def test_a_derivative_through_the_curvature_is_refused():
    # The statistics hold the estimator's vectors constant, so a derivative of a
    # curvature in the parameters would be wrong: refused, naming the way out.
    model, batch = _problem()
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def logdet(params, damping):
        curv = ef.curvature(
            loss_fn,
            eqx.combine(params, static),
            batch,
            estimator=ef.GGN(),
            structure=ef.KFAC(),
        )
        return curv.logdet(damping)

    with pytest.raises(ValueError, match=r"`eqfisher.curvature`: the curvature is not"):
        jax.grad(logdet)(params, 0.1)
    with pytest.raises(ValueError, match=r"filters.stop_gradient\(model, True\)"):
        jax.jvp(ft.partial(logdet, damping=0.1), (params,), (params,))
    # A derivative that does not reach the curvature's arrays is unaffected: in
    # the damping, d logdet / dλ = tr((C + λI)⁻¹); with the model held constant.
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    dense = np.asarray(curv.as_matrix())
    inverse_trace = np.trace(np.linalg.inv(dense + 0.1 * np.eye(len(dense))))
    np.testing.assert_allclose(jax.grad(logdet, 1)(params, 0.1), inverse_trace)
    held = jax.grad(lambda p: logdet(jax.lax.stop_gradient(p), 0.1))(params)
    assert all(not np.any(x) for x in jax.tree_util.tree_leaves(held))


@pytest.mark.parametrize("wrt", ["targets", "mask", "coefficient"])
@pytest.mark.parametrize("structure", [ef.Dense(), ef.Diagonal(), ef.KFAC()], ids=repr)
def test_a_derivative_in_the_losses_data_is_refused(wrt, structure):
    # The estimator's vectors are held constant: a derivative of the curvature in
    # soft targets, mask weights or a loss coefficient came back as 0 (true: 2.6,
    # -0.05, 2.3 on the audit's problems). Refused like one in the parameters.
    model, (x, y) = _problem()
    soft = jax.nn.one_hot(y, CLASSES, dtype=F64)
    data = {"targets": soft, "mask": jnp.ones(N, F64), "coefficient": jnp.array(2.0)}

    def loss(model, batch):
        x, d = batch
        targets = d["targets"] / jnp.sum(d["targets"], axis=-1, keepdims=True)
        logits = jax.vmap(model)(x)
        return d["coefficient"] * ef.softmax_cross_entropy(
            logits, targets, mask=d["mask"]
        )

    def trace(value):
        d = {**data, wrt: value}
        curv = ef.curvature(
            loss, model, (x, d), estimator=ef.EmpiricalFisher(), structure=structure
        )
        return curv.trace()

    with pytest.raises(ValueError, match="the curvature is not differentiable"):
        jax.grad(trace)(data[wrt])


def test_products_are_differentiable_in_a_coefficient_from_the_batch():
    # The coefficients were computed from stop_gradient-ed inputs: d/dc of
    # ggn_operator(...).mv was 0 for a coefficient passed in the batch.
    model, (x, y) = _problem()
    v = jax.tree_util.tree_map(jnp.ones_like, _params(model))

    def loss(model, batch):
        x, y, c = batch
        return c * ef.softmax_cross_entropy(jax.vmap(model)(x), y)

    def quadratic(c, operator):
        out = operator(loss, model, (x, y, c)).mv(v)
        return sum(
            jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(v))
        )

    for operator in (ef.ggn_operator, ef.empirical_fisher_operator):
        at_one = quadratic(jnp.array(1.0), operator)
        # c times the product: the derivative in c is the product at c = 1.
        np.testing.assert_allclose(
            jax.grad(quadratic)(jnp.array(2.0), operator), at_one, rtol=1e-12
        )


@pytest.mark.parametrize("operand", ["targets", "mask"])
def test_targets_or_mask_that_depend_on_the_parameters_are_refused(operand):
    # The curvature takes them as data: with them moving, it would not be the
    # curvature of the value returned (0.75 off on a self-distillation loss).
    model, (x, y) = _problem()

    def moving(model, batch):
        x, y = batch
        out = jax.vmap(model)(x)
        if operand == "targets":
            return ef.squared_error(out, 0.5 * jnp.roll(out, 1, axis=0))
        return ef.softmax_cross_entropy(out, y, mask=jax.nn.sigmoid(out[:, 0]))

    with pytest.raises(ValueError, match=f"registered loss's {operand} depend on"):
        ef.curvature(moving, model, (x, y), estimator=ef.GGN(), structure=ef.Dense())

    def of_outputs(out, labels=y):  # the fix the message names: held constant
        if operand == "targets":
            target = jax.lax.stop_gradient(0.5 * jnp.roll(out, 1, axis=0))
            return ef.squared_error(out, target)
        mask = jax.lax.stop_gradient(jax.nn.sigmoid(out[:, 0]))
        return ef.softmax_cross_entropy(out, labels, mask=mask)

    def held(model, batch):
        return of_outputs(jax.vmap(model)(batch[0]), batch[1])

    curv = ef.curvature(held, model, (x, y), estimator=ef.GGN(), structure=ef.Dense())
    # Jᵀ H J, H the Hessian in the outputs with the targets or mask held.
    reference = dense_ggn(lambda m: jax.vmap(m)(x), of_outputs, model)
    np.testing.assert_allclose(curv.as_matrix(), reference, rtol=1e-10, atol=1e-13)


class _WithActivation(eqx.Module):
    linear: eqx.nn.Linear
    activation: Callable  # a leaf: `eqx.filter` makes it None

    def __call__(self, x):
        return self.activation(self.linear(x))


@pytest.mark.parametrize("call", ["curvature", "kfac_step"])
def test_a_filtered_model_passed_as_the_model_says_to_pass_the_whole_model(call):
    model = _WithActivation(
        eqx.nn.Linear(D_IN, CLASSES, dtype=F64, key=jax.random.key(0)), jnp.tanh
    )
    _, batch = _problem()
    filtered = _params(model)
    with pytest.raises(TypeError, match="NoneType") as info:
        if call == "curvature":
            ef.curvature(
                loss_fn, filtered, batch, estimator=ef.GGN(), structure=ef.Dense()
            )
        else:
            like = ef.optim.curvature_like(_vgc(), model, batch, key=jax.random.key(0))
            opt = ef.optim.kfac(1e-2, like=like)
            step = ef.optim.kfac_step(
                loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC()
            )
            step(filtered, opt.init(filtered), batch, jax.random.key(1))
    assert any("pass the whole model" in n for n in info.value.__notes__)


@pytest.mark.parametrize(
    "labels",
    ["multi-hot", "zero rows", "counts"],
)
def test_probability_labels_that_do_not_sum_to_one_are_refused(labels):
    # The GGN of -Σ t log softmax(z) is (Σt)(diag p - p pᵀ): computed for Σt = 1,
    # it was 0.5 (multi-hot, counts) to 1.5 (zero rows) off, silently.
    model, (x, y) = _problem()
    one_hot = jax.nn.one_hot(y, CLASSES, dtype=F64)
    bad = {
        "multi-hot": one_hot.at[:, 0].set(1.0),
        "zero rows": one_hot.at[:3].set(0.0),
        "counts": 2 * one_hot,
    }[labels]
    message = "probability `labels` must be finite and non-negative and sum to 1"
    with pytest.raises(ValueError, match=message):
        loss_fn(model, (x, bad))
    for estimator in [ef.GGN(), ef.FisherExact(), ef.EmpiricalFisher()]:
        with pytest.raises(eqx.EquinoxRuntimeError, match=message):
            ef.curvature(
                loss_fn, model, (x, bad), estimator=estimator, structure=ef.Dense()
            )
    with pytest.raises(Exception, match=message):
        ef.ggn_operator(loss_fn, model, (x, bad)).as_matrix()

    # Normalised, or with padding rows given weight 0, they are exact.
    def masked(model, batch):
        x, t, mask = batch
        return ef.softmax_cross_entropy(jax.vmap(model)(x), t, mask=mask)

    smooth = 0.9 * one_hot + 0.1 / CLASSES
    keep = (jnp.sum(bad, axis=-1) > 0).astype(F64)
    for t, mask in [(smooth, jnp.ones(N)), (bad * keep[:, None], keep)]:
        t = t / jnp.maximum(jnp.sum(t, axis=-1, keepdims=True), 1)
        curv = ef.curvature(
            masked, model, (x, t, mask), estimator=ef.GGN(), structure=ef.Dense()
        )
        w = mask / jnp.sum(mask)

        def of_outputs(out, t=t, w=w):
            return -jnp.sum(w * jnp.sum(t * jax.nn.log_softmax(out), axis=-1))

        reference = dense_ggn(lambda m: jax.vmap(m)(x), of_outputs, model)
        np.testing.assert_allclose(curv.as_matrix(), reference, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize(
    "row",
    [[jnp.nan, 0.5, 0.5, 0.0], [jnp.inf, -jnp.inf, 1.0, 0.0], [-1.0, 1.0, 1.0, 0.0]],
    ids=["nan", "inf", "negative"],
)
def test_probability_labels_that_are_not_probabilities_are_refused(row):
    # They passed the sum's check: a NaN loss and curvature, or (a negative label)
    # a finite loss that is no likelihood, without an error.
    model, (x, y) = _problem()
    bad = jax.nn.one_hot(y, CLASSES, dtype=F64).at[0].set(jnp.array(row, F64))
    message = "probability `labels` must be finite and non-negative and sum to 1"
    with pytest.raises(ValueError, match=message):
        loss_fn(model, (x, bad))
    with pytest.raises(eqx.EquinoxRuntimeError, match=message):
        ef.curvature(
            loss_fn,
            model,
            (x, bad),
            estimator=ef.EmpiricalFisher(),
            structure=ef.Dense(),
        )


@pytest.mark.parametrize("mask", ["negative", "all zero", "nan"])
def test_masks_that_are_not_weights_are_refused(mask):
    # A negative weight gave a NaN (indefinite) curvature beside a finite value.
    model, (x, y) = _problem()
    bad = {
        "negative": jnp.ones(N).at[0].set(-3.0),
        "all zero": jnp.zeros(N),
        "nan": jnp.ones(N).at[1].set(jnp.nan),
    }[mask]

    def masked(model, batch):
        x, y, mask = batch
        return ef.softmax_cross_entropy(jax.vmap(model)(x), y, mask=mask)

    message = "`mask` must be finite and >= 0 with a positive sum"
    with pytest.raises(ValueError, match=message):
        masked(model, (x, y, bad))
    with pytest.raises(eqx.EquinoxRuntimeError, match=message):
        ef.curvature(
            masked, model, (x, y, bad), estimator=ef.GGN(), structure=ef.KFAC()
        )


def test_a_padded_example_given_to_influence_alone_says_to_leave_it_out():
    # `self_influence` calls `loss_fn` on one example at a time: a padded one has a
    # mask of sum 0 there, and the message only said "Give padding weight 0".
    model, (x, y) = _problem()
    mask = jnp.ones(N).at[-1].set(0.0)

    def masked(model, batch):
        x, y, mask = batch
        return ef.softmax_cross_entropy(jax.vmap(model)(x), y, mask=mask)

    with pytest.raises(eqx.EquinoxRuntimeError, match="leave padded examples out"):
        ef.influence.self_influence(
            masked, model, (x, y, mask), ef.influence.Identity()
        )


@pytest.mark.parametrize("structure", [ef.Dense(), ef.Diagonal(), ef.KFAC()], ids=repr)
def test_integer_vectors_are_refused(structure):
    # A basis vector eᵢ in int32 came back from `mv` as int32 zeros.
    model, batch = _problem()
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)
    basis = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.int32), _params(model))
    with pytest.raises(TypeError, match="must hold floating-point arrays"):
        curv.mv(basis)
    with pytest.raises(TypeError, match="must hold floating-point arrays"):
        curv.solve(basis, 0.1)


def test_kfac_under_where_given_every_gradient_points_to_the_docs_pattern():
    # The message used to advise `optax.masked(kfac, mask)`, which passes the
    # other gradients through as updates: gradient ascent (loss 2.3 -> 4.5).
    model, batch = _problem()
    where = ef.filters.by_path("layers[1].*")
    vgc = ef.value_grad_and_curvature(
        loss_fn, estimator=ef.GGN(), structure=ef.KFAC(), where=where
    )
    like = ef.optim.curvature_like(vgc, model, batch)
    opt = ef.optim.kfac(1e-2, like=like)
    _, grads, curv = vgc(model, batch)
    mask = ef.filters.optax_mask(model, where)
    params = _params(model)
    every = jax.tree.map(jnp.zeros_like, params)  # all parameters' gradients
    with pytest.raises(ValueError, match=r"optim\.kfac\(\.\.\.\)\.update`.*give K-FAC"):
        opt.update(every, opt.init(eqx.filter(params, mask)), params, curvature=curv)
    # The pattern it names: exactly the curvature's gradients.
    updates, _ = opt.update(
        eqx.filter(grads, mask),
        opt.init(eqx.filter(params, mask)),
        eqx.filter(params, mask),
        curvature=curv,
    )
    assert jax.tree.structure(updates) == jax.tree.structure(eqx.filter(grads, mask))


def test_laplace_metrics_and_predictives_refuse_what_they_would_misread(unchecked):
    # Per-class variances for a covariance mixed the examples' variances (0.41
    # off); logits for probabilities gave a number; bad labels gave NaN.
    mean = jnp.array([[2.0, 0.0, -2.0], [1.0, 1.0, 0.0]], F64)
    var = jnp.array([[0.1, 0.1, 0.1], [50.0, 50.0, 50.0]], F64)
    for fn in [ef.laplace.probit, ef.laplace.laplace_bridge]:
        with pytest.raises(ValueError, match=r"jax.vmap\(jnp.diag\)\(var\)"):
            fn(mean, var)
    right = jax.nn.softmax(mean / jnp.sqrt(1 + np.pi / 8 * var), -1)
    got = ef.laplace.probit(mean, jax.vmap(jnp.diag)(var))
    np.testing.assert_allclose(got, right, rtol=1e-14)

    probs, labels = jax.nn.softmax(mean, -1), jnp.array([0, 1])
    metrics = [
        ef.laplace.negative_log_likelihood,
        ef.laplace.brier_score,
        ef.laplace.expected_calibration_error,
    ]
    for metric in metrics:
        metric(probs, labels)  # accepted
        with pytest.raises(ValueError, match="must be class probabilities"):
            metric(mean, labels)
        with pytest.raises(ValueError, match=r"class ids in \[0, 3\)"):
            metric(probs, jnp.array([0, 3]))
        with pytest.raises(ValueError, match=r"shape \(batch, classes\)"):
            metric(probs, labels[:1])
        with pytest.raises(eqx.EquinoxRuntimeError, match="class probabilities"):
            eqx.filter_jit(metric)(mean, labels)
    np.testing.assert_allclose(
        ef.laplace.negative_log_likelihood(probs, labels),
        -np.mean(np.log([probs[0, 0], probs[1, 1]])),
        rtol=1e-14,
    )


def test_laplace_counts_and_inputs_are_checked(unchecked):
    post = _laplace()
    with pytest.raises(ValueError, match="`num_samples` must be a positive int"):
        post.sample(jax.random.key(0), -1)
    with pytest.raises(ValueError, match="steps=.*positive int"):
        ef.laplace.optimize_hyperparameters(post, steps=-1)
    x, _ = _problem()[1]
    # One input without its axis: the message itself names `x` and the fix (it
    # was JAX's matmul error, the advice in a note).
    for predictive in (
        ef.laplace.glm_predictive,
        ef.laplace.predictive_diagnosis,
        lambda post, x: ef.laplace.predictive_samples(post, x, jax.random.key(0), 2),
    ):
        with pytest.raises(ValueError, match=r"one example of `x`.*x\[None\]"):
            predictive(post, x[0])
    with pytest.raises(ValueError, match="must be a vector"):
        ef.laplace.glm_predictive(post, x, apply=lambda m, xi: m(xi)[:, None])
    mean, cov = ef.laplace.glm_predictive(post, x[:1])
    assert mean.shape == (1, CLASSES) and cov.shape == (1, CLASSES, CLASSES)


@pytest.mark.parametrize("key", ["seed", "split", "floats"])
def test_a_key_that_is_not_one_prng_key_is_named(key, unchecked):
    model, batch = _problem()
    bad = {
        "seed": 0,
        "split": jax.random.split(jax.random.key(0), 2),
        "floats": jnp.array([1.0, 2.0]),
    }[key]

    def sampled(key):
        return ef.curvature(
            loss_fn,
            model,
            batch,
            estimator=ef.FisherMC(),
            structure=ef.Dense(),
            key=key,
        )

    with pytest.raises(TypeError, match=r"key=\.\.\.\)`: one PRNG key"):
        sampled(bad)
    legacy = sampled(jax.random.PRNGKey(3))
    typed = sampled(jax.random.wrap_key_data(jax.random.PRNGKey(3)))
    np.testing.assert_array_equal(legacy.as_matrix(), typed.as_matrix())


@pytest.mark.parametrize("c", [float("inf"), float("nan"), -1.0])
def test_scale_and_ema_refuse_a_factor_out_of_range(c):
    model, batch = _problem()
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    with pytest.raises(ValueError, match="`c` must lie in"):
        curv.map_blocks(lambda b: b.scale(c))
    with pytest.raises(eqx.EquinoxRuntimeError, match="`decay` must lie in"):
        eqx.filter_jit(lambda c, d: c.ema(c, d).as_matrix())(curv, jnp.asarray(c))


@pytest.mark.parametrize(
    "make", [ef.ggn_operator, ef.hessian_operator, ef.empirical_fisher_operator]
)
def test_a_matrix_free_product_with_a_vector_of_another_structure_is_refused(make):
    # It was Equinox's "Closure-converted function called with different
    # dynamic/static arguments", with a dump of both trees.
    model, batch = _problem()
    op = make(loss_fn, model, batch)
    flat = jax.flatten_util.ravel_pytree(eqx.filter(model, eqx.is_inexact_array))[0]
    for vector in (flat, model):
        with pytest.raises(ValueError, match=r"MatrixFreeOperator.mv\(vector\)"):
            op.mv(vector)


@pytest.mark.parametrize("damping", [None, "0.1", 0.1 + 0j, True])
def test_a_damping_that_is_not_a_real_number_is_refused(damping, unchecked):
    # `None` gave "float() argument must be a string or a real number"; the string
    # "0.1" was accepted.
    model, batch = _problem()
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    grads = eqx.filter_grad(loss_fn)(model, batch)
    for call in (lambda: curv.solve(grads, damping), lambda: curv.logdet(damping)):
        with pytest.raises(TypeError, match="`damping` must be a real scalar"):
            call()


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "equal shapes"])
def test_a_model_output_of_several_arrays_is_refused(kind, unchecked):
    # A tuple or dict of outputs (`return logits, features`) raised "Cannot
    # concatenate arrays" or "entry not a 2- or 3- tuple"; two of equal shapes
    # were stacked into a (2, N, C) batch and the labels blamed.
    model, (x, y) = _problem()
    logits = jax.vmap(model)(x)
    outputs = {
        "tuple": (logits, x),
        "list": [logits, x],
        "dict": {"logits": logits, "features": x},
        "equal shapes": (logits, logits),
    }[kind]
    for loss, targets in (
        (ef.softmax_cross_entropy, y),
        (ef.squared_error, jnp.zeros_like(logits)),
    ):
        with pytest.raises(TypeError, match=r"outputs \(its first argument\) must"):
            loss(outputs, targets)
    with pytest.raises(TypeError, match=r"targets \(its second argument\) must"):
        ef.softmax_cross_entropy(logits, {"labels": y})
    assert ef.softmax_cross_entropy(logits, list(map(int, y))) == loss_fn(model, (x, y))


def test_a_mask_given_as_a_list_is_taken(unchecked):
    # It raised "Cannot determine dtype of [1.0, ...]" (labels as a list were taken).
    model, (x, y) = _problem()
    logits = jax.vmap(model)(x)
    mask = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    expected = ef.softmax_cross_entropy(logits, y, mask=jnp.asarray(mask))
    assert ef.softmax_cross_entropy(logits, y, mask=mask) == expected


def test_swapped_arguments_are_named():
    # `find_layers(model, loss_fn, batch)` raised "MLP.__call__() takes 2
    # positional arguments but 3 were given"; `curvature(model, loss_fn, ...)` said
    # only that `model` has no parameters; `step(opt_state, model, ...)` named
    # `find_kfac_state`, which the user never called.
    model, batch = _problem()
    with pytest.raises(TypeError) as info:
        ef.find_layers(model, loss_fn, batch)
    assert any("are they swapped?" in note for note in info.value.__notes__)
    with pytest.raises(ValueError, match=r"is it `loss_fn`\? The arguments are"):
        ef.curvature(model, loss_fn, batch, estimator=ef.GGN(), structure=ef.KFAC())
    opt = ef.optim.kfac(1e-2, like=ef.optim.curvature_like(_vgc(), model, batch))
    step = ef.optim.kfac_step(loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC())
    state = opt.init(_params(model))
    with pytest.raises(ValueError, match=r"`model` and `opt_state` swapped\?"):
        step(state, model, batch)


def test_complex_parameters_are_refused_naming_them():
    # A complex leaf gave a complex matrix over the complex leaves (neither
    # Hermitian nor the curvature over real and imaginary parts), tagged
    # positive-semidefinite, whose own `solve` refused the model's gradients.
    lin = eqx.nn.Linear(D_IN, CLASSES, dtype=jnp.complex128, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (N, D_IN), F64).astype(jnp.complex128)

    def real_loss(m, batch):
        x, y = batch
        return ef.softmax_cross_entropy(jnp.real(jax.vmap(m)(x)), y)

    batch = (x, jnp.arange(N) % CLASSES)
    message = r"complex parameters \(at \.weight, \.bias\).*two real leaves"
    for structure in (ef.Dense(), ef.KFAC()):
        with pytest.raises(TypeError, match=message):
            ef.curvature(real_loss, lin, batch, estimator=ef.GGN(), structure=structure)
    for build in (ef.ggn_operator, ef.empirical_fisher_operator, ef.hessian_operator):
        with pytest.raises(TypeError, match=message):
            build(real_loss, lin, batch)
    # Closed over rather than passed, the complex weight is held fixed: accepted.
    shift = eqx.nn.Linear(D_IN, CLASSES, dtype=F64, key=jax.random.key(2))

    def fixed(m, batch):
        x, y = batch
        return ef.softmax_cross_entropy(
            jnp.real(jax.vmap(lin)(x)) + jax.vmap(m)(jnp.real(x)), y
        )

    curv = ef.curvature(fixed, shift, batch, estimator=ef.GGN(), structure=ef.Dense())
    assert curv.as_matrix().dtype == F64


def test_a_loss_registered_inside_lax_map_is_told_to_use_vmap():
    # The message suggested `IndependentExamples(axis=...)`, which cannot help: each
    # registration holds one example's sequence, with no example axis.
    mlp = eqx.nn.MLP(D_IN, CLASSES, 4, 1, dtype=F64, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (N, 3, D_IN), F64)
    y = jnp.arange(N * 3).reshape(N, 3) % CLASSES

    def per_sequence(m, b):
        logits = jax.vmap(jax.vmap(m))(b[0])
        per = jax.lax.map(
            lambda a: ef.softmax_cross_entropy(a[0], a[1]), (logits, b[1])
        )
        return jnp.mean(per)

    with pytest.raises(ValueError, match=r"inside `lax.map`.*under `jax.vmap`"):
        ef.curvature(
            per_sequence, mlp, (x, y), estimator=ef.GGN(), structure=ef.Dense()
        )


def test_a_vector_of_other_leaves_of_the_same_shapes_is_refused():
    # Only the leaves' shapes were compared: another layer's gradient of the same
    # shapes (selected by another `where`), or a list of the leaves, was taken, and
    # layer 1's block applied to layer 2's gradient.
    model = eqx.nn.MLP(D_IN, CLASSES, 4, 2, dtype=F64, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (N, D_IN), F64)
    batch = (x, jnp.arange(N) % CLASSES)
    first, second = ef.filters.by_path("layers[1].*"), ef.filters.by_path("layers[2].*")
    curv = ef.curvature(
        loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC(), where=first
    )
    grads = eqx.filter_grad(loss_fn)(model, batch)
    mine = ef.filters.partition(grads, first)[0]
    other = ef.filters.partition(grads, second)[0]
    with pytest.raises(ValueError, match=r"a leaf at \.layers\[2\]\.weight where"):
        curv.solve(other, 0.1)
    with pytest.raises(ValueError, match=r"a leaf at \[0\] where"):
        curv.mv(jax.tree_util.tree_leaves(mine))
    flat = jax.flatten_util.ravel_pytree(mine)[0]
    np.testing.assert_allclose(
        jax.flatten_util.ravel_pytree(curv.mv(mine))[0],
        curv.as_matrix() @ flat,
        rtol=1e-12,
    )


@pytest.mark.parametrize("mode", ["embedding", "index", "clip", "fill"])
def test_an_embedding_id_outside_the_table_counts_the_row_read(mode):
    # `eqx.nn.Embedding` (and `jnp.take(mode="clip")`) reads row 5 for id 7 of a
    # 6-row table, and its derivative lands there: K-FAC's input factor dropped
    # the id, its block 0 where the exact one is not (one example at one location,
    # where K-FAC is exact). `table[ids]` clamps in value but XLA's scatter, the
    # derivative, skips the id, as `mode="fill"` does: no count, both 0.
    table = jax.random.normal(jax.random.key(0), (6, 4), F64)
    head = eqx.nn.Linear(4, CLASSES, dtype=F64, key=jax.random.key(1))
    read = {
        "index": lambda t, i: t[i],
        "embedding": lambda t, i: jax.vmap(eqx.nn.Embedding(weight=t))(i),
        "clip": lambda t, i: jnp.take(t, i, axis=0, mode="clip"),
        "fill": lambda t, i: jnp.take(t, i, axis=0, mode="fill", fill_value=0.0),
    }[mode]

    def embedding_loss(params, batch):
        t, h = params
        return ef.softmax_cross_entropy(
            jax.vmap(h)(jnp.tanh(read(t, batch[0]))), batch[1]
        )

    batch = (jnp.array([7]), jnp.array([1]))
    kw = dict(estimator=ef.GGN())
    kfac = ef.curvature(embedding_loss, (table, head), batch, structure=ef.KFAC(), **kw)
    exact = ef.curvature(
        embedding_loss, (table, head), batch, structure=ef.BlockDiagonal(), **kw
    )
    np.testing.assert_allclose(
        kfac.blocks["[0]"].as_matrix(), exact.blocks["[0]"].as_matrix(), atol=1e-15
    )
    reached = float(jnp.max(jnp.abs(exact.blocks["[0]"].as_matrix()))) > 0
    assert reached == (mode in ("embedding", "clip"))


class _WithEmptyLayer(eqx.Module):
    empty: eqx.nn.Linear
    head: eqx.nn.Linear

    def __call__(self, x):
        return self.head(jnp.concatenate([x, self.empty(x)]))


@pytest.mark.parametrize("structure", [ef.Diagonal(), ef.BlockDiagonal(), ef.KFAC()])
def test_a_layer_with_no_outputs_is_refused_by_name(structure):
    # `eqx.nn.Linear(3, 0)` raised a bare ZeroDivisionError in a reshape.
    keys = jax.random.split(jax.random.key(0), 3)
    model = _WithEmptyLayer(
        eqx.nn.Linear(3, 0, key=keys[0]), eqx.nn.Linear(3, 2, key=keys[1])
    )
    batch = (jax.random.normal(keys[2], (4, 3)), jnp.arange(4) % 2)

    def loss_fn(m, b):
        return ef.softmax_cross_entropy(jax.vmap(m)(b[0]), b[1])

    def run(**where):
        return ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=structure, **where
        )

    with pytest.raises(ValueError, match=r"Layer empty .* 0 outputs.*`where=`"):
        run()
    head = run(where=ef.filters.by_path("head.*")).as_matrix()
    # The empty layer adds nothing to the head's inputs: the head alone's curvature.
    alone = ef.curvature(
        loss_fn, model.head, batch, estimator=ef.GGN(), structure=structure
    ).as_matrix()
    np.testing.assert_allclose(head, alone, rtol=1e-12, atol=1e-15)
    assert np.abs(alone).max() > 1e-3


def test_float64_arrays_after_x64_is_turned_off_are_refused():
    # Made with x64 on, used with it off: GGN's own shape check blamed
    # `GGN.output_vectors`, a relu model failed inside JAX's custom JVP rule.
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))  # float64 (x64 is on)
    batch = (jax.random.normal(jax.random.key(1), (4, 3)), jnp.arange(4) % 2)

    def loss_fn(m, b):
        return ef.softmax_cross_entropy(jax.vmap(m)(b[0]), b[1])

    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(TypeError, match=r"holds float64 arrays.*jax_enable_x64"):
            ef.curvature(
                loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Dense()
            )
    finally:
        jax.config.update("jax_enable_x64", True)
