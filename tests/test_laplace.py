"""`eqfisher.laplace` against dense float64 references built without eqfisher.

The posterior precision is N·C/(σ²T) + diag(δ); its reference uses the dense GGN of
the mean loss from `jax.jacfwd`/`jax.hessian` (tests/helpers.py) for `Dense()`, and
the structure's own matrix (`Curvature.as_matrix()`) for the approximations, whose
accuracy as curvatures is tested elsewhere: here what is checked is the posterior
built on them.
"""

import functools as ft
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import eqfisher as ef
import eqfisher.laplace as la

from .helpers import compiled_during, dense_ggn, dense_ggn_cross_entropy


N, D_IN, D_OUT = 12, 3, 4


def make_data(regression: bool):
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (N, D_IN), jnp.float64)
    if regression:
        return x, jax.random.normal(ky, (N, D_OUT), jnp.float64)
    return x, jax.random.randint(ky, (N,), 0, D_OUT)


def make_model():
    return eqx.nn.MLP(
        D_IN, D_OUT, 5, 2, activation=jnp.tanh, dtype=jnp.float64, key=jax.random.key(0)
    )


def ce_loss(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def mse_loss(model, batch):
    x, y = batch
    return ef.squared_error(jax.vmap(model)(x), y)


LAST = ef.filters.by_path("layers[2].*")
STRUCTURES = {
    "dense": ef.Dense(),
    "blockdiag": ef.BlockDiagonal(),
    "diagonal": ef.Diagonal(),
    "kfac": ef.KFAC(),
    "ekfac": ef.EKFAC(),
}


def selected_mask(model, where):
    """A boolean vector over `ravel_pytree(params)`: the selected coordinates."""
    params = eqx.filter(model, eqx.is_inexact_array)
    if where is None:
        flags = jax.tree_util.tree_map(lambda p: True, params)
    else:
        flags = ef.filters.optax_mask(model, where)
    return ravel_pytree(
        jax.tree_util.tree_map(lambda p, f: jnp.full(p.shape, f), params, flags)
    )[0].astype(bool)


def reference_curvature(lap, model, batch, regression, structure_name, sel):
    """C over the selected coordinates: the dense GGN for `Dense`, else the
    structure's matrix."""
    if structure_name != "dense":
        return np.asarray(lap.curvature.as_matrix())
    if regression:
        x, y = batch
        g = dense_ggn(
            lambda m: jax.vmap(m)(x),
            lambda o: 0.5 * jnp.sum((o - y) ** 2) / N,
            model,
        )
    else:
        g = dense_ggn_cross_entropy(model, *batch)
    return g[np.ix_(sel, sel)]


def prior_vector(lap):
    """diag(δ) over the selected coordinates, in `ravel_pytree` order."""
    values = jax.tree_util.tree_map(
        lambda s: None if s is None else jnp.zeros(s.shape, s.dtype),
        lap.curvature.structure,
    )
    leaves, treedef = jax.tree_util.tree_flatten(values)
    slices = lap.curvature.leaf_slices or [
        ((),) * len(i) for _, i in lap.curvature.leaf_indices
    ]
    for (name, idx), sl in zip(lap.curvature.leaf_indices, slices):
        for i, k in zip(idx, sl):
            leaves[i] = leaves[i].at[k].set(lap.prior_precision[name])
    return ravel_pytree(jax.tree_util.tree_unflatten(treedef, leaves))[0]


def cast(tree, dtype):
    return jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree
    )


# The fit and its reference matrix are computed once per case and shared by the tests
# (and the per-block variants) that use it; every object here is immutable.
@ft.cache
def fitted(structure_name, where, regression, dtype=jnp.float64):
    """`(lap, model, batch, loss_fn, sel, c)` with the scalar prior precision 0.3."""
    model = cast(make_model(), dtype)
    batch = cast(make_data(regression), dtype)
    loss_fn = mse_loss if regression else ce_loss
    kwargs = dict(noise_std=0.7, temperature=0.9) if regression else {}
    lap = la.fit(
        loss_fn,
        model,
        batch,
        likelihood="regression" if regression else "classification",
        structure=STRUCTURES[structure_name],
        where=where,
        prior_precision=0.3,
        **kwargs,
    )
    sel = selected_mask(model, where)
    c = reference_curvature(lap, model, batch, regression, structure_name, sel)
    c.flags.writeable = False
    return lap, model, batch, loss_fn, sel, c


def build(structure_name, where, regression, per_block=False, dtype=jnp.float64):
    lap, model, batch, loss_fn, sel, c = fitted(
        structure_name, where, regression, dtype
    )
    if per_block:
        names = sorted(lap.curvature.blocks)
        lap = lap.replace(
            prior_precision={n: 0.2 + 0.5 * i for i, n in enumerate(names)}
        )
    sigma2t = 0.7**2 * 0.9 if regression else 1.0
    precision = N / sigma2t * c + np.diag(np.asarray(prior_vector(lap)))
    return lap, model, batch, loss_fn, sel, precision


def dense_matrix(fn, lap):
    """The matrix of a linear map on `lap.mean`-shaped PyTrees, ravel order."""
    return np.asarray(_dense_matrix(fn, lap.mean))


# The library's methods run eagerly in the tests below unless jitted: one
# compilation per call rather than one per primitive, which is most of their time.
@eqx.filter_jit
def _dense_matrix(fn, mean):
    flat, unravel = ravel_pytree(mean)
    cols = jax.vmap(lambda e: ravel_pytree(fn(unravel(e)))[0])(
        jnp.eye(flat.size, dtype=flat.dtype)
    )
    return cols.T


@eqx.filter_jit
def log_marginal_likelihood(lap):
    return lap.log_marginal_likelihood()


glm_predictive = eqx.filter_jit(la.glm_predictive)


CASES = [
    (s, w, r)
    for s in STRUCTURES
    for w in (None, LAST)
    for r in (False, True)
    if not (s == "blockdiag" and r)  # kept short: blockdiag ≈ dense per layer
]


def case_id(case):
    s, w, r = case
    return f"{s}-{'all' if w is None else 'last'}-{'reg' if r else 'cls'}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("per_block", [False, True])
def test_covariance_and_marginal_likelihood(case, per_block):
    structure_name, where, regression = case
    lap, model, batch, loss_fn, sel, precision = build(*case, per_block=per_block)
    cov = np.linalg.inv(precision)
    np.testing.assert_allclose(
        dense_matrix(lap.covariance_mv, lap), cov, rtol=1e-9, atol=1e-12
    )
    np.testing.assert_allclose(
        dense_matrix(lap.precision_mv, lap), precision, rtol=1e-9, atol=1e-10
    )
    # The marginal likelihood, evaluated densely (laplace-torch's formula).
    theta = np.asarray(ravel_pytree(eqx.filter(model, eqx.is_inexact_array))[0])[sel]
    prior = np.asarray(prior_vector(lap))
    mean_loss = float(loss_fn(model, batch))
    if regression:
        sigma, t = 0.7, 0.9
        loglik = -N * mean_loss / (sigma**2 * t) - N * D_OUT * math.log(
            sigma * math.sqrt(2 * math.pi)
        )
    else:
        loglik = -N * mean_loss
    expected = loglik - 0.5 * (
        np.linalg.slogdet(precision)[1]
        - np.sum(np.log(prior))
        + np.sum(prior * theta**2)
    )
    assert float(log_marginal_likelihood(lap)) == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("structure_name", ["dense", "kfac", "diagonal"])
def test_marginal_likelihood_gradient(structure_name):
    """d/d(log δ_b, log σ) of the log marginal likelihood against the dense formula
    differentiated by JAX (the dense formula uses no eqfisher code but C)."""
    lap, model, batch, loss_fn, sel, _ = build(structure_name, None, True, True)
    names = sorted(lap.curvature.blocks)
    c = fitted(structure_name, None, True)[5]  # the reference `build` used
    theta = ravel_pytree(eqx.filter(model, eqx.is_inexact_array))[0][sel]
    mean_loss = loss_fn(model, batch)

    def via_library(logs):
        prior = {n: jnp.exp(v) for n, v in logs["prior"].items()}
        out = lap.replace(prior_precision=prior, noise_std=jnp.exp(logs["noise"]))
        return out.log_marginal_likelihood()

    def dense(logs):
        out = lap.replace(
            prior_precision={n: jnp.exp(v) for n, v in logs["prior"].items()}
        )
        prior = jnp.asarray(prior_vector(out))
        sigma = jnp.exp(logs["noise"])
        precision = N / (sigma**2 * 0.9) * c + jnp.diag(prior)
        loglik = -N * mean_loss / (sigma**2 * 0.9) - N * D_OUT * jnp.log(
            sigma * math.sqrt(2 * math.pi)
        )
        return loglik - 0.5 * (
            jnp.linalg.slogdet(precision)[1]
            - jnp.sum(jnp.log(prior))
            + jnp.sum(prior * theta**2)
        )

    logs = {
        "prior": {n: jnp.log(lap.prior_precision[n]) for n in names},
        "noise": jnp.log(lap.noise_std),
    }
    got = jax.jit(jax.grad(via_library))(logs)
    want = jax.jit(jax.grad(dense))(logs)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert float(a) == pytest.approx(float(b), rel=1e-8, abs=1e-10)
    # And one central finite difference on the library itself.
    h = 1e-5
    n0 = names[0]
    bump = lambda e: {**logs, "prior": {**logs["prior"], n0: logs["prior"][n0] + e}}
    value = jax.jit(via_library)
    fd = (value(bump(h)) - value(bump(-h))) / (2 * h)
    assert float(got["prior"][n0]) == pytest.approx(float(fd), rel=1e-6)


def flat_outputs(model, x, sel):
    """`outputs(theta_selected)` for the whole batch, (batch, D), via ravel_pytree."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, unravel = ravel_pytree(params)

    def fn(theta):
        full = flat.at[np.flatnonzero(sel)].set(theta)
        return jax.vmap(eqx.combine(unravel(full), static))(x)

    return fn, flat[sel]


@pytest.mark.parametrize(
    "case", [c for c in CASES if not c[2]] + [("kfac", None, True)], ids=case_id
)
def test_glm_predictive_against_jacfwd(case):
    lap, model, batch, _, sel, precision = build(*case)
    x = batch[0][:5]
    fn, theta = flat_outputs(model, x, sel)
    jac = jax.jit(jax.jacfwd(fn))(theta)  # (batch, D, P)
    cov = np.einsum("bkp,pq,blq->bkl", jac, np.linalg.inv(precision), jac)
    mean, got = glm_predictive(lap, x, chunk_size=2, output_chunk_size=3)
    np.testing.assert_allclose(mean, fn(theta), rtol=1e-12)
    np.testing.assert_allclose(got, cov, rtol=1e-9, atol=1e-12)
    # Probit and bridge, from the formulas written out here.
    var = np.diagonal(cov, axis1=1, axis2=2)
    mu = np.asarray(mean)
    p = np.exp(mu / np.sqrt(1 + np.pi / 8 * var))
    np.testing.assert_allclose(la.probit(mean, got), p / p.sum(-1, keepdims=True))
    k = mu.shape[1]
    s = cov.sum(-1)
    tot = cov.sum((1, 2))
    mu_c = mu - s * mu.sum(-1, keepdims=True) / tot[:, None]
    var_c = var - s * s / tot[:, None]
    alpha = 1 - 2 / k + np.exp(mu_c) / k**2 * np.exp(-mu_c).sum(-1, keepdims=True)
    alpha = alpha / var_c
    np.testing.assert_allclose(
        la.laplace_bridge(mean, got), alpha / alpha.sum(-1, keepdims=True), rtol=1e-9
    )


@eqx.filter_jit
def flat_samples(lap, key, num_samples):
    samples = lap.sample(key, num_samples)
    return jax.vmap(lambda t: ravel_pytree(t)[0])(samples)


@pytest.mark.parametrize("structure_name", list(STRUCTURES))
def test_samples_have_the_posterior_covariance(structure_name):
    """Sample covariance within 5 standard errors (Var Ŝ_ij = (Σ_ii Σ_jj + Σ_ij²)/S)."""
    lap, model, batch, _, sel, precision = build(structure_name, LAST, False, True)
    cov = np.linalg.inv(precision)
    s = 20000
    flat = np.asarray(flat_samples(lap, jax.random.key(3), s))
    theta = np.asarray(ravel_pytree(lap.mean)[0])
    centred = flat - theta
    np.testing.assert_array_less(np.abs(centred.mean(0)), 5 * np.sqrt(np.diag(cov) / s))
    empirical = centred.T @ centred / s
    se = np.sqrt((np.outer(np.diag(cov), np.diag(cov)) + cov**2) / s)
    np.testing.assert_array_less(np.abs(empirical - cov), 5 * se)


def test_linearised_samples_match_glm_covariance():
    lap, model, batch, _, sel, _ = build("kfac", None, False)
    x = batch[0][:3]
    mean, cov = glm_predictive(lap, x)
    s = 20000
    out = np.asarray(
        eqx.filter_jit(la.predictive_samples)(lap, x, jax.random.key(4), s)
    )
    centred = out - np.asarray(mean)
    # Linearised outputs are exactly Gaussian: mean and covariance within 5 s.e.
    var = np.diagonal(cov, axis1=1, axis2=2)
    np.testing.assert_array_less(np.abs(centred.mean(0)), 5 * np.sqrt(var / s))
    emp = np.einsum("sbk,sbl->bkl", centred, centred) / s
    se = np.sqrt((var[:, :, None] * var[:, None, :] + np.asarray(cov) ** 2) / s)
    np.testing.assert_array_less(np.abs(emp - cov), 5 * se)
    net = la.predictive_samples(lap, x, jax.random.key(4), 4, linearised=False)
    assert net.shape == (4, 3, D_OUT) and np.all(np.isfinite(net))
    probs = la.softmax_average(jnp.asarray(out))
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-12)


def test_calibration_metrics():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(200, 5)) * 3
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    labels = rng.integers(0, 5, 200)
    nll = -np.mean(np.log(probs[np.arange(200), labels]))
    brier = np.mean(np.sum((probs - np.eye(5)[labels]) ** 2, -1))
    conf, pred = probs.max(-1), probs.argmax(-1)
    ece = 0.0
    for b in range(10):
        lo, hi = b / 10, (b + 1) / 10
        inside = (conf > lo) & (conf <= hi)
        if inside.any():
            gap = abs((pred[inside] == labels[inside]).mean() - conf[inside].mean())
            ece += inside.mean() * gap
    p, y = jnp.asarray(probs), jnp.asarray(labels)
    assert float(la.negative_log_likelihood(p, y)) == pytest.approx(nll, rel=1e-12)
    assert float(la.brier_score(p, y)) == pytest.approx(brier, rel=1e-12)
    assert float(la.expected_calibration_error(p, y)) == pytest.approx(ece, rel=1e-12)


def test_optimize_hyperparameters_compiles_once_for_every_learning_rate():
    # A Python float learning rate was a constant of the compiled loop: each new
    # value compiled it again (0.4-1.2 s), as in a sweep over learning rates.
    lap, *_ = build("kfac", None, True)
    tuned = {}
    for rate in (0.05, 0.02, 0.01):
        run = ft.partial(la.optimize_hyperparameters, lap, steps=5, learning_rate=rate)
        compiles = compiled_during(run)
        assert not compiles or rate == 0.05, compiles
        tuned[rate] = run()[1]
    assert not jnp.allclose(tuned[0.05], tuned[0.01])  # the rate is not ignored
    for bad in (0.0, -0.1, math.inf, True):
        with pytest.raises(ValueError, match=r"learning_rate=\.\.\.\)`: a positive"):
            la.optimize_hyperparameters(lap, steps=5, learning_rate=bad)


def test_optimize_hyperparameters_finds_the_maximum():
    """Adam on (log δ, log σ) ends at a stationary point of the dense formula that is
    above every point of a grid around it."""
    lap, *_ = build("kfac", None, True)
    tuned, history = la.optimize_hyperparameters(
        lap, steps=400, learning_rate=0.05, noise=True
    )
    assert float(tuned.log_marginal_likelihood()) >= float(history[0])
    names = list(tuned.prior_precision)
    logs = {n: jnp.log(v) for n, v in tuned.prior_precision.items()}

    @jax.jit
    def value(logs, log_sigma):
        prior = {n: jnp.exp(v) for n, v in logs.items()}
        out = tuned.replace(prior_precision=prior, noise_std=jnp.exp(log_sigma))
        return out.log_marginal_likelihood()

    grads = jax.jit(jax.grad(value, argnums=(0, 1)))(logs, jnp.log(tuned.noise_std))
    for g in jax.tree_util.tree_leaves(grads):
        assert abs(float(g)) < 1e-3
    best = float(tuned.log_marginal_likelihood())
    for d in (-0.3, 0.3):
        bumped = {n: v + d for n, v in logs.items()}
        assert float(value(bumped, jnp.log(tuned.noise_std))) < best
    assert names


@pytest.mark.parametrize("structure_name", ["dense", "kfac", "ekfac", "diagonal"])
def test_float32_at_large_n(structure_name):
    """N = 1e5 in float32 with δ = 1e-2: Λ = N·C + δ·I has a condition number near
    1e8, beyond float32, so forward errors of solves are large in Λ's near-null
    directions; what holds is a small backward error: Λ̃·(Λ⁻¹v computed) = v up to
    1e-5·‖Λ̃‖‖y‖ with Λ̃ from the float32 curvature, in float64. The log marginal
    likelihood agrees with float64 to 1e-4 and the predictive is finite."""
    results = []
    for dtype in (jnp.float64, jnp.float32):
        lap, model, batch, _, sel, _ = build(structure_name, None, False, dtype=dtype)
        lap = eqx.tree_at(lambda p: p.num_data, lap, jnp.asarray(1e5, dtype))
        lap = lap.replace(prior_precision=1e-2)
        results.append(log_marginal_likelihood(lap))
    lml64, lml32 = results
    assert lml32.dtype == jnp.float32 and bool(jnp.isfinite(lml32))
    assert float(lml32) == pytest.approx(float(lml64), rel=1e-4)
    mean, cov = glm_predictive(lap, batch[0][:4])
    assert cov.dtype == jnp.float32 and np.all(np.isfinite(cov))
    probs = la.probit(mean, cov)
    assert np.all(np.isfinite(probs))
    flat, unravel = ravel_pytree(lap.mean)
    v = jax.random.normal(jax.random.key(5), flat.shape, jnp.float32)
    y = eqx.filter_jit(lambda lap, v: ravel_pytree(lap.covariance_mv(unravel(v)))[0])(
        lap, v
    )
    y = np.asarray(y, np.float64)
    c32 = np.asarray(lap.curvature.as_matrix(), np.float64)
    precision = 1e5 * c32 + 1e-2 * np.eye(c32.shape[0])
    residual = precision @ y - np.asarray(v, np.float64)
    bound = 1e-5 * np.linalg.norm(precision, 2) * np.linalg.norm(y)
    assert np.linalg.norm(residual) < bound


def test_errors(unchecked):
    lap, model, batch, *_ = build("kfac", None, False)
    with pytest.raises(ValueError, match="one scalar per curvature block"):
        lap.replace(prior_precision={"nope": 1.0})
    # A prior per parameter, laplace-torch's, as a PyTree like the parameters:
    # Python's "float() argument must be ... not 'MLP'" before.
    per_parameter = jax.tree_util.tree_map(jnp.ones_like, lap.mean)
    with pytest.raises(ValueError, match="got MLP for .*precision per parameter"):
        lap.replace(prior_precision=per_parameter)
    with pytest.raises(ValueError, match="regression"):
        lap.replace(noise_std=2.0)
    with pytest.raises(ValueError, match="regression"):
        la.optimize_hyperparameters(lap, noise=True)
    with pytest.raises(ValueError, match="likelihood"):
        la.Laplace(lap.curvature, model, loss=0.0, num_data=1, likelihood="cls")
    with pytest.raises(ValueError, match="classification"):
        la.Laplace(
            lap.curvature,
            model,
            loss=0.0,
            num_data=1,
            likelihood="classification",
            noise_std=2.0,
        )


def test_more_mistakes_are_refused(unchecked):
    # Each of these passed silently (or failed deep inside) before.
    import optax

    lap, model, batch, *_ = build("kfac", None, False)
    for n in (0, -5):  # NaN marginal likelihood; an unrelated damping error
        with pytest.raises(ValueError, match="`num_data` must be positive"):
            la.Laplace(
                lap.curvature, model, loss=0.0, num_data=n, likelihood="classification"
            )
    probs, labels = jax.nn.softmax(jnp.ones((3, 4))), jnp.arange(3)
    with pytest.raises(ValueError, match=r"bins=\.\.\.\)`: a positive int"):
        la.expected_calibration_error(probs, labels, bins=0)  # was 0.0
    common = dict(
        likelihood="classification", structure=ef.KFAC(), optimizer=optax.sgd(0.1)
    )
    with pytest.raises(ValueError, match=r"hyper_every=\.\.\.\)`: an int >= 1"):
        la.marglik_training(ce_loss, model, batch, steps=2, hyper_every=0, **common)
    with pytest.raises(ValueError, match="noise=True.*regression"):
        la.marglik_training(ce_loss, model, batch, steps=2, noise=True, **common)


def test_softmax_predictives_refuse_one_output():
    # A softmax over one logit is 1: a binary sigmoid classifier got
    # probabilities of 1 from probit and softmax_average, NaN from the bridge.
    mean, cov = jnp.array([[0.3], [-1.0]]), jnp.full((2, 1, 1), 0.5)
    for f in (la.probit, la.laplace_bridge):
        with pytest.raises(ValueError, match="softmax over one output is 1"):
            f(mean, cov)
    with pytest.raises(ValueError, match="softmax over one output is 1"):
        la.softmax_average(mean[None])


def test_laplace_bridge_refuses_a_degenerate_covariance():
    # A zero covariance gave NaN (laplace-torch: all ones); the probabilities of
    # no uncertainty are softmax(mean), which probit gives.
    mean = jnp.array([[2.0, 0.0, -2.0]])
    with pytest.raises(ValueError, match="variance along the sum of the logits"):
        la.laplace_bridge(mean, jnp.zeros((1, 3, 3)))
    with pytest.raises(eqx.EquinoxRuntimeError, match="variance along the sum"):
        eqx.filter_jit(la.laplace_bridge)(mean, jnp.zeros((1, 3, 3)))
    np.testing.assert_allclose(
        la.probit(mean, jnp.zeros((1, 3, 3))), jax.nn.softmax(mean), rtol=1e-12
    )


def test_marglik_training():
    """Online marglik training: the MAP objective falls, the posterior returned is
    the one at the returned model, and its hyperparameters are a stationary point of
    its log marginal likelihood."""
    import optax

    model = make_model()
    batch = make_data(True)
    trained, post, history = la.marglik_training(
        mse_loss,
        model,
        batch,
        likelihood="regression",
        structure=ef.KFAC(),
        optimizer=optax.adam(1e-2),
        steps=60,
        hyper_every=20,
        hyper_steps=300,
        hyper_learning_rate=0.05,
        noise=True,
    )
    assert len(history) == 3 and all(math.isfinite(h) for h in history)
    assert float(mse_loss(trained, batch)) < float(mse_loss(model, batch))
    fresh = ef.curvature(
        mse_loss, trained, batch, estimator=ef.GGN(), structure=ef.KFAC()
    )
    np.testing.assert_allclose(post.curvature.as_matrix(), fresh.as_matrix())

    def value(logs, log_sigma):
        prior = {n: jnp.exp(v) for n, v in logs.items()}
        out = post.replace(prior_precision=prior, noise_std=jnp.exp(log_sigma))
        return out.log_marginal_likelihood()

    logs = {n: jnp.log(v) for n, v in post.prior_precision.items()}
    grads = jax.jit(jax.grad(value, argnums=(0, 1)))(logs, jnp.log(post.noise_std))
    for g in jax.tree_util.tree_leaves(grads):
        assert abs(float(g)) < 1e-2


def test_marglik_training_descends_the_log_joint_with_the_tuned_noise():
    """With `noise=True` the parameters descend the negative log joint,
    L + σ²T/(2N)·δ‖θ‖² (laplace-torch's `MSE + δ‖θ‖²σ²T/N`), not L + δ‖θ‖²/(2N):
    on linear regression, after the first hyperparameter update, they reach the
    ridge solution with penalty δσ² (0.31 away from it before). Phase one (σ = 1,
    δ = 1) ends at ridge(1); the hyperparameters tuned there hold in phase two."""
    import optax

    n, steps = 10, 1500
    keys = jax.random.split(jax.random.key(7), 3)
    model = eqx.nn.Linear(3, 1, key=keys[0], dtype=jnp.float64)
    x = jax.random.normal(keys[1], (n, 3))
    noise = 0.2 * jax.random.normal(keys[2], (n,))
    t = (x @ jnp.array([1.0, -2.0, 0.5]) + 0.3 + noise)[:, None]
    xa = np.concatenate([x, np.ones((n, 1))], axis=1)

    def ridge(penalty):  # argmin ½‖Xθ − t‖² + ½ penalty ‖θ‖²
        return np.linalg.solve(xa.T @ xa + penalty * np.eye(4), xa.T @ t[:, 0])

    def loss(m, b):
        return ef.squared_error(jax.vmap(m)(b[0]), b[1])

    def at(theta):
        return eqx.tree_at(
            lambda m: (m.weight, m.bias), model, (theta[None, :3], theta[3:])
        )

    fit = ft.partial(la.fit, loss, batch=(x, t), likelihood="regression")
    trained, _, _ = la.marglik_training(
        loss,
        model,
        (x, t),
        likelihood="regression",
        structure=ef.Dense(),
        optimizer=optax.sgd(0.1),
        steps=2 * steps,
        hyper_every=steps,
        hyper_steps=300,
        burn_in=steps,
        noise=True,
    )
    first = fit(model=at(ridge(1.0)), structure=ef.Dense())
    first, _ = la.optimize_hyperparameters(first, steps=300, noise=True)
    delta, sigma = float(first.prior_precision["all"]), float(first.noise_std)
    assert abs(sigma - 1) > 0.5  # the noise was tuned away from 1
    theta = np.concatenate([np.ravel(trained.weight), np.ravel(trained.bias)])
    np.testing.assert_allclose(theta, ridge(delta * sigma**2), rtol=1e-9)


@pytest.mark.parametrize(
    "case",
    [("dense", None, False), ("dense", LAST, True), ("kfac", None, False)],
    ids=case_id,
)
@pytest.mark.parametrize("per_block", [False, True])
def test_predictive_diagnosis_against_jacfwd(case, per_block):
    """The diagnosis' variances are the diagonals of J Λ⁻¹ Jᵀ and J diag(δ)⁻¹ Jᵀ
    from `jax.jacfwd` and the dense precision; its ratios follow from them."""
    lap, model, batch, _, sel, precision = build(*case, per_block=per_block)
    x = batch[0][:5]
    fn, theta = flat_outputs(model, x, sel)
    jac = np.asarray(jax.jit(jax.jacfwd(fn))(theta))  # (batch, D, P)
    variance = np.einsum("bkp,pq,bkq->bk", jac, np.linalg.inv(precision), jac)
    prior = np.einsum("bkp,p,bkp->bk", jac, 1 / np.asarray(prior_vector(lap)), jac)
    got = eqx.filter_jit(la.predictive_diagnosis)(lap, x, chunk_size=2)
    np.testing.assert_allclose(got.mean, fn(theta), rtol=1e-12)
    np.testing.assert_allclose(got.variance, variance, rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(got.prior_variance, prior, rtol=1e-12)
    assert np.all(variance <= prior)
    mean = np.asarray(fn(theta))
    regression = case[2]
    scale = np.full(5, 0.7) if regression else mean.std(-1)
    np.testing.assert_allclose(got.output_scale, scale, rtol=1e-12)
    ratio = np.sqrt(variance.mean(-1)) / scale
    np.testing.assert_allclose(got.std_ratio, ratio, rtol=1e-9)
    d = mean.shape[1]
    project = np.eye(d) - (0 if regression else 1 / d)  # off the common logit shift
    cov = np.einsum("bkp,pq,blq->bkl", jac, np.linalg.inv(precision), jac)
    cov_prior = np.einsum("bkp,p,blp->bkl", jac, 1 / np.asarray(prior_vector(lap)), jac)
    share = np.trace(project @ cov @ project, axis1=1, axis2=2) / np.trace(
        project @ cov_prior @ project, axis1=1, axis2=2
    )
    np.testing.assert_allclose(got.prior_share, share, rtol=1e-9)
    factor = 1 / np.sqrt(1 + np.pi / 8 * variance)
    np.testing.assert_allclose(got.probit_factor, factor, rtol=1e-9)


def test_predictive_diagnosis_multilabel_sigmoid():
    """Independent sigmoids (several labels per example) are not shift-invariant:
    `fit` records it, and the diagnosis neither centres the logits nor scales by
    their spread across outputs; it matches `jax.jacfwd` and the dense GGN."""
    model = make_model()
    x, _ = make_data(False)
    labels = jax.random.bernoulli(jax.random.key(3), 0.5, (N, D_OUT))

    def loss_fn(model, batch):
        x, t = batch
        return ef.sigmoid_cross_entropy(jax.vmap(model)(x), t)

    lap = la.fit(
        loss_fn,
        model,
        (x, labels),
        likelihood="classification",
        structure=ef.Dense(),
        prior_precision=0.3,
    )
    assert lap.shift_invariant is False
    assert fitted("dense", None, False)[0].shift_invariant is True
    assert fitted("dense", None, True)[0].shift_invariant is False

    def bernoulli(out):
        t = labels.astype(out.dtype)
        return jnp.mean(jnp.sum(jax.nn.softplus(out) - t * out, axis=-1))

    c = dense_ggn(lambda m: jax.vmap(m)(x), bernoulli, model)
    precision = N * c + 0.3 * np.eye(len(c))
    x5 = x[:5]
    fn, theta = flat_outputs(model, x5, selected_mask(model, None))
    jac = np.asarray(jax.jit(jax.jacfwd(fn))(theta))
    cov = np.einsum("bkp,pq,blq->bkl", jac, np.linalg.inv(precision), jac)
    cov_prior = np.einsum("bkp,blp->bkl", jac, jac) / 0.3
    got = eqx.filter_jit(la.predictive_diagnosis)(lap, x5)
    assert got.shift_invariant is False
    share = np.trace(cov, axis1=1, axis2=2) / np.trace(cov_prior, axis1=1, axis2=2)
    np.testing.assert_allclose(got.prior_share, share, rtol=1e-9)
    mean = np.asarray(fn(theta))
    np.testing.assert_allclose(
        got.output_scale, np.sqrt(np.mean(mean**2, -1)), rtol=1e-12
    )
    # A hand-built posterior that does not say (`None`) keeps the old reading:
    # several classification outputs are softmax logits.
    unknown = la.Laplace(
        lap.curvature,
        model,
        loss=lap.loss,
        num_data=N,
        likelihood="classification",
        prior_precision=0.3,
    )
    assert unknown.shift_invariant is None
    assert eqx.filter_jit(la.predictive_diagnosis)(unknown, x5).shift_invariant


def test_predictive_diagnosis_summary():
    """The summary warns where the predictive swamps the logits, and says whether the
    prior or the data set its variance; it does not for a narrow posterior."""
    lap, _, batch, *_ = fitted("dense", LAST, False)
    x = batch[0]
    diagnose = eqx.filter_jit(la.predictive_diagnosis)
    broad = diagnose(lap.replace(prior_precision=1e-3), x)
    text = broad.summary()
    assert np.median(broad.std_ratio) > 1 and np.median(broad.prior_share) < 0.5
    assert "far less confident" in text and "data set most" in text
    assert "probit scales the logits by" in text
    narrow = diagnose(lap.replace(prior_precision=1e4), x)
    assert np.median(narrow.std_ratio) < 1 and np.median(narrow.prior_share) > 0.5
    assert "far less confident" not in narrow.summary()
    # Prior-dominated and broad: the directions the data leave free.
    free = eqx.tree_at(lambda d: d.prior_share, broad, jnp.full(len(x), 0.9))
    assert "prior sets most" in free.summary()


def test_predictives_called_eagerly_compile_once():
    # Each `lax.map` inside was compiled again at every call (new closures):
    # 1.3-3.4 s a call for 50 points of a 5k-parameter MLP.

    lap, _, batch, *_ = fitted("kfac", None, False)
    x = batch[0][:4]
    calls = [
        lambda: la.glm_predictive(lap, x),
        lambda: la.predictive_samples(lap, x, jax.random.key(0), 3),
        lambda: la.predictive_diagnosis(lap, x),
    ]
    for call in calls:
        jax.block_until_ready(jax.tree_util.tree_leaves(call()))
    assert compiled_during(lambda: [call() for call in calls]) == []


def test_fit_refuses_a_mask_of_sum_zero_as_curvature_does():
    # Run eagerly, `fit`'s reading of the registered loss failed inside JAX's
    # callback: an internal `JaxRuntimeError` wrapping the mask's message.
    model = make_model()
    x = jax.random.normal(jax.random.key(1), (6, D_IN), jnp.float64)

    def masked(m, batch):
        x, y, mask = batch
        return ef.softmax_cross_entropy(jax.vmap(m)(x), y, mask=mask)

    batch = (x, jnp.arange(6) % D_OUT, jnp.zeros(6))
    with pytest.raises(eqx.EquinoxRuntimeError, match="with a positive sum"):
        ef.laplace.fit(
            masked, model, batch, likelihood="classification", structure=ef.Diagonal()
        )


def test_fit_names_itself_when_its_curvature_refuses():
    # A `where=` that selects nothing was refused as `eqfisher.curvature`'s, a call
    # the user never made.
    model = make_model()
    x = jax.random.normal(jax.random.key(1), (6, D_IN), jnp.float64)

    def loss(m, batch):
        return ef.softmax_cross_entropy(jax.vmap(m)(batch[0]), batch[1])

    with pytest.raises(ValueError, match="no parameter selected") as info:
        ef.laplace.fit(
            loss,
            model,
            (x, jnp.arange(6) % D_OUT),
            likelihood="classification",
            structure=ef.Diagonal(),
            where=ef.filters.by_path("adapter*"),
        )
    assert any("eqfisher.laplace.fit" in note for note in info.value.__notes__)


class _BatchNormNet(eqx.Module):
    l1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    l2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(3, 6, key=k1, dtype=jnp.float64)
        self.bn = eqx.nn.BatchNorm(
            6, axis_name="batch", mode="batch", dtype=jnp.float64
        )
        self.l2 = eqx.nn.Linear(6, 3, key=k2, dtype=jnp.float64)

    def __call__(self, x, state):
        h, state = self.bn(self.l1(x), state, inference=False)
        return self.l2(jnp.tanh(h)), state


def test_fit_takes_examples_for_a_model_whose_examples_interact():
    """The refusal for BatchNorm in training mode said to pass
    `examples=InteractingExamples()`, which `fit` did not take. It does: the
    posterior is the one built from `curvature(..., examples=...)`, and its
    curvature the dense GGN through the batch statistics."""
    model, state = eqx.nn.make_with_state(_BatchNormNet)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 3), jnp.float64)
    y = jax.random.randint(jax.random.key(2), (16,), 0, 3)

    def outputs(m, x):
        # A fresh copy of the state at each call (Equinox refuses a reused one).
        fresh = jax.tree.unflatten(*reversed(jax.tree.flatten(state)))
        run = jax.vmap(lambda xi: m(xi, fresh), axis_name="batch", out_axes=(0, None))
        return run(x)[0]

    def loss_fn(m, b):
        return ef.softmax_cross_entropy(outputs(m, b[0]), b[1])

    kwargs = dict(likelihood="classification", structure=ef.Dense())
    with pytest.raises(eqx.EquinoxRuntimeError, match="InteractingExamples"):
        la.fit(loss_fn, model, (x, y), **kwargs)
    post = la.fit(loss_fn, model, (x, y), examples=ef.InteractingExamples(), **kwargs)

    def cross_entropy(out):
        return -jnp.mean(
            jnp.take_along_axis(jax.nn.log_softmax(out), y[:, None], axis=1)
        )

    ref = dense_ggn(lambda m: outputs(m, x), cross_entropy, model)
    np.testing.assert_allclose(post.curvature.as_matrix(), ref, rtol=1e-9, atol=1e-12)
    assert float(post.num_data) == 16
