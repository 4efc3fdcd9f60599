"""`eqfisher.spectral` against dense float64 references.

References: the matrix itself for `lineax.MatrixLinearOperator`s and a user's
`FunctionLinearOperator`; `helpers.dense_ggn_cross_entropy`, `dense_hessian` and
`dense_empirical_fisher` (`jax.jacfwd`/`jax.hessian`, no eqfisher) for the exact
products; `as_matrix()` for a K-FAC `Curvature`. Eigenvalues from `numpy.linalg.eigh`.

Randomised estimators are unbiased: each is run over `REPEATS` keys (one `vmap`),
and the mean must lie within `Z` standard errors of the exact value. The standard
error comes from the estimator's variance formula where one is known in closed form
(Hutchinson's, with Rademacher vectors), else from the sample, checked against a
derived upper bound on the variance. Where an estimator is exact (Hutch++/XTrace
on low rank, Lanczos over the whole space) the tolerance is 1e-8 relative.
"""

import functools as ft
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import lineax as lx
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import eqfisher as ef
from eqfisher import spectral as sp

from .helpers import dense_empirical_fisher, dense_ggn_cross_entropy, dense_hessian


F64 = jnp.float64
PSD = (lx.symmetric_tag, lx.positive_semidefinite_tag)
REPEATS = 200
Z = 5.0  # standard errors; P(|N(0,1)| > 5) ≈ 6e-7
EXACT = 1e-8


def psd_matrix(d: int = 40, seed: int = 0) -> np.ndarray:
    """A random PSD matrix with eigenvalues 100·0.8^i (well separated at the top)."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(d, d)))
    return (q * (100 * 0.8 ** np.arange(d))) @ q.T


def low_rank_matrix(d: int = 40, rank: int = 5, seed: int = 1) -> np.ndarray:
    b = np.random.default_rng(seed).normal(size=(d, rank))
    return b @ b.T


def mlp_problem():
    model = eqx.nn.MLP(3, 3, 5, 1, activation=jnp.tanh, dtype=F64, key=jr.key(0))
    kx, ky = jr.split(jr.key(1))
    x = jr.normal(kx, (6, 3), F64)
    y = jr.randint(ky, (6,), 0, 3)
    return model, (x, y)


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def plain_loss(model, x, y):
    out = jax.nn.log_softmax(jax.vmap(model)(x))
    return -jnp.mean(jnp.take_along_axis(out, y[:, None], axis=1))


def user_operator():
    """A user's unsymmetric operator over a dict PyTree (its transpose by lineax)."""
    structure = {
        "a": jax.ShapeDtypeStruct((3, 4), F64),
        "b": jax.ShapeDtypeStruct((5,), F64),
    }
    _, unravel = ravel_pytree(jax.tree.map(lambda s: jnp.zeros(s.shape), structure))
    m = np.random.default_rng(2).normal(size=(17, 17))
    op = lx.FunctionLinearOperator(
        lambda t: unravel(jnp.asarray(m) @ ravel_pytree(t)[0]), structure
    )
    return op, m


# name: () -> (operator, dense reference)
def _matrix(m):
    return lx.MatrixLinearOperator(jnp.asarray(m), PSD), m


def _ggn():
    model, batch = mlp_problem()
    return ef.ggn_operator(loss_fn, model, batch), dense_ggn_cross_entropy(
        model, *batch
    )


def _hessian():
    model, (x, y) = mlp_problem()
    ref = dense_hessian(lambda m: plain_loss(m, x, y), model)
    return ef.hessian_operator(loss_fn, model, (x, y)), ref


def _empirical_fisher():
    model, (x, y) = mlp_problem()
    ref = dense_empirical_fisher(
        lambda m, ex: plain_loss(m, ex[0][None], ex[1][None]), model, (x, y)
    )
    return ef.empirical_fisher_operator(loss_fn, model, (x, y)), ref


def _kfac():
    model, batch = mlp_problem()
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    return curv, np.asarray(curv.as_matrix())


def _last_layer():
    model, batch = mlp_problem()
    curv = ef.curvature(
        loss_fn,
        model,
        batch,
        estimator=ef.GGN(),
        structure=ef.Dense(),
        where=ef.filters.by_path("layers[1].*"),
    )
    return curv, np.asarray(curv.as_matrix())


OPERATORS = {
    "psd": lambda: _matrix(psd_matrix()),
    "low_rank": lambda: _matrix(low_rank_matrix()),
    "ggn": _ggn,
    "hessian": _hessian,
    "empirical_fisher": _empirical_fisher,
    "kfac": _kfac,
    "last_layer": _last_layer,
    "user": user_operator,
}


@ft.cache
def operator(name: str):
    op, ref = OPERATORS[name]()
    return op, np.asarray(ref, dtype=np.float64)


def test_references_match_operators():
    for name in OPERATORS:
        op, ref = operator(name)
        dense = eqx.filter_jit(lambda o: o.as_matrix())(op)
        np.testing.assert_allclose(dense, ref, rtol=1e-10, atol=1e-12)


@eqx.filter_jit
def many(fn, op, keys):
    """`fn(op, key)` for each key, in one `vmap`."""
    return jax.vmap(lambda k: fn(op, k))(keys)


KEYS = jr.split(jr.key(42), REPEATS)
slq = eqx.filter_jit(sp.lanczos_quadrature)


# The densities of a quadrature, each one compilation rather than one per primitive.
@eqx.filter_jit
def jit_density(q, **kwargs):
    return q.density(**kwargs)


@eqx.filter_jit
def jit_log_density(q, **kwargs):
    return q.log_density(**kwargs)


ESTIMATORS = {
    "hutchinson": sp.Hutchinson(matvecs=12),
    "hutchpp": sp.HutchPlusPlus(matvecs=12),
    "xtrace": sp.XTrace(matvecs=12),
}
FROBENIUS_MATVECS = 10


@ft.cache
def samples(name: str) -> dict:
    """Every randomised estimate of operator `name`, for each of `KEYS` (one
    compilation per operator)."""

    def fn(op, key):
        out = {}
        for est, estimator in ESTIMATORS.items():
            out[f"trace {est}"] = sp.trace(op, estimator, key=key)
            d = sp.diagonal(op, estimator, key=key)
            out[f"diagonal {est}"] = ravel_pytree(d)[0]
        out["frobenius"] = sp.squared_frobenius_norm(
            op, matvecs=FROBENIUS_MATVECS, key=key
        )
        return out

    return jax.tree.map(np.asarray, many(fn, operator(name)[0], KEYS))


def hutchinson_trace_variance(a: np.ndarray, m: int) -> float:
    """Var of (1/m) Σ wᵀAw for Rademacher w: 2(‖S‖_F² − Σ Sᵢᵢ²)/m, S = (A + Aᵀ)/2."""
    s = (a + a.T) / 2
    return 2 * (np.sum(s**2) - np.sum(np.diag(s) ** 2)) / m


def mean_off(samples, exact, std_error, what) -> list[str]:
    """A finding when the sample mean is more than Z standard errors from `exact`."""
    err = np.abs(np.mean(samples, axis=0) - exact)
    if np.all(err <= Z * std_error + 1e-12):
        return []
    return [f"{what}: mean off by {np.max(err / std_error):.1f} standard errors"]


# The statistical sweeps cover one operator of each kind (a matrix, a matrix-free
# product, a `Curvature`, a user's unsymmetric operator over a dict): each compiles
# every estimator vmapped over `REPEATS` keys, the slowest tests of the suite. One
# test per operator checks all of its estimates, so that under pytest-xdist the
# compilation of `samples(name)` happens on one worker only (tests of one module are
# dealt to the workers in turn, and each worker would compile its own).
SWEEP = ["psd", "ggn", "kfac", "user"]


def trace_findings(name, est) -> list[str]:
    """What is wrong with `est`'s trace samples on `name`: variance, then mean."""
    _, a = operator(name)
    estimator = ESTIMATORS[est]
    values = samples(name)[f"trace {est}"]
    sample_var = np.var(values, ddof=1)
    what = f"{name}, trace {est}"
    if est == "hutchinson":
        var = hutchinson_trace_variance(a, estimator.matvecs)
        # The sample variance of REPEATS draws is within a factor ~1.5 of the true.
        ok = 0.5 * var - 1e-12 <= sample_var <= 1.5 * var + 1e-12
    else:
        # Upper bounds: Hutch++'s complement term is Hutchinson on PAP with m/3
        # vectors, so Var ≤ 2‖A‖_F²/(m/3) (Gaussian bound, Rademacher is lower);
        # XTrace averages terms each of variance ≤ 2‖A‖_F² (Cauchy-Schwarz).
        n = estimator.matvecs // 3 if est == "hutchpp" else 1
        ok = sample_var <= 2 * np.sum(a**2) / n * 1.5 + 1e-12
        var = sample_var
    found = [] if ok else [f"{what}: sample variance {sample_var:.3g} off its bound"]
    return found + mean_off(values, np.trace(a), np.sqrt(var / REPEATS), what)


def diagonal_findings(name, est) -> list[str]:
    """What is wrong with `est`'s diagonal samples on `name`: variance, then mean."""
    _, a = operator(name)
    estimator = ESTIMATORS[est]
    values = samples(name)[f"diagonal {est}"]
    what = f"{name}, diagonal {est}"
    if est == "hutchinson":
        # wⱼ(Aw)ⱼ = Aⱼⱼ + Σ_{l≠j} Aⱼₗ wⱼ wₗ: variance Σ_{l≠j} Aⱼₗ² per vector.
        var = (np.sum(a**2, axis=1) - np.diag(a) ** 2) / estimator.matvecs
        ok = np.all(np.var(values, axis=0, ddof=1) <= 1.6 * var + 1e-12)
    else:
        var = np.var(values, axis=0, ddof=1)
        # Each vector's complement term has variance ≤ ‖row j of A‖² (a projection
        # shrinks rows); the exact part adds none beyond what the average removes.
        ok = np.all(var <= 2 * np.sum(a**2, axis=1) + 1e-12)
    found = [] if ok else [f"{what}: sample variance above its bound"]
    return found + mean_off(values, np.diag(a), np.sqrt(var / REPEATS) + 1e-12, what)


def frobenius_findings(name) -> list[str]:
    """What is wrong with the squared Frobenius norm samples on `name`."""
    _, a = operator(name)
    values = samples(name)["frobenius"]
    ata = a.T @ a
    var = 2 * (np.sum(ata**2) - np.sum(np.diag(ata) ** 2)) / FROBENIUS_MATVECS
    what = f"{name}, squared Frobenius norm"
    found = [] if np.var(values, ddof=1) <= 1.5 * var else [f"{what}: variance"]
    return found + mean_off(values, np.sum(a**2), np.sqrt(var / REPEATS), what)


@pytest.mark.parametrize("name", SWEEP)
def test_estimators_unbiased(name):
    """Traces and diagonals from every estimator, and the squared Frobenius norm."""
    findings = frobenius_findings(name)
    for est in ESTIMATORS:
        findings += trace_findings(name, est) + diagonal_findings(name, est)
    assert not findings, "\n".join(findings)


def test_the_findings_see_a_biased_mean():
    assert mean_off(np.array([1.0, 1.2, 0.8]), 1.0, 0.1, "fair") == []
    (found,) = mean_off(np.array([2.0, 2.2, 1.8]), 1.0, 0.1, "biased")
    assert found.startswith("biased: mean off by 10.0")


def test_diagonal_is_a_pytree_like_the_operand():
    op, a = operator("last_layer")
    d = sp.diagonal(op, sp.XTrace(matvecs=8), key=jr.key(0))
    assert jax.tree.structure(d) == jax.tree.structure(op.diagonal())
    op, _ = operator("user")
    d = sp.diagonal(op, sp.Hutchinson(matvecs=4), key=jr.key(0))
    assert {k: v.shape for k, v in d.items()} == {"a": (3, 4), "b": (5,)}


# Low rank r: Hutch++ is exact once its sketch (matvecs/3 vectors) spans the range,
# XTrace once each leave-one-out sketch (matvecs/2 − 1 vectors) does.
@pytest.mark.parametrize(
    "name, estimators",
    [
        ("low_rank", [sp.HutchPlusPlus(matvecs=15), sp.XTrace(matvecs=12)]),
        ("ggn", [sp.HutchPlusPlus(matvecs=36), sp.XTrace(matvecs=26)]),  # rank ≤ 12
        ("empirical_fisher", [sp.HutchPlusPlus(matvecs=18), sp.XTrace(matvecs=14)]),
    ],
)
def test_exact_on_low_rank(name, estimators):
    op, a = operator(name)
    scale = np.max(np.abs(a))

    @eqx.filter_jit
    def estimates(op):  # one compilation for every estimator
        return [
            (
                sp.trace(op, estimator, key=jr.key(3)),
                sp.diagonal(op, estimator, key=jr.key(3)),
            )
            for estimator in estimators
        ]

    for t, d in estimates(op):
        np.testing.assert_allclose(t, np.trace(a), rtol=EXACT)
        np.testing.assert_allclose(ravel_pytree(d)[0], np.diag(a), atol=EXACT * scale)


def check_eigenpairs(op, a, values, vectors, expected):
    scale = np.max(np.abs(np.linalg.eigvalsh(a)))
    np.testing.assert_allclose(values, expected, atol=EXACT * scale, rtol=0)
    flat = jax.vmap(lambda v: ravel_pytree(v)[0])(vectors)
    np.testing.assert_allclose(np.linalg.norm(flat, axis=1), 1, rtol=1e-10)
    residual = flat @ a.T - values[:, None] * flat  # A u − λ u
    assert np.max(np.abs(residual)) <= 1e-7 * scale


@pytest.mark.parametrize("name", ["psd", "low_rank", "ggn", "hessian", "kfac"])
@pytest.mark.parametrize("which", ["largest", "smallest"])
def test_top_eigenpairs_whole_space(name, which):
    op, a = operator(name)
    size = a.shape[0]
    eig = np.linalg.eigvalsh(a)
    expected = eig[::-1][:4] if which == "largest" else eig[:4]
    values, vectors = eqx.filter_jit(sp.top_eigenpairs)(
        op, 4, key=jr.key(0), iterations=size, which=which
    )
    check_eigenpairs(op, a, values, vectors, expected)
    # Eigenvectors of distinct eigenvalues are unique up to sign.
    eigvals, eigvecs = np.linalg.eigh(a)
    top = np.argsort(eigvals)[::-1][0] if which == "largest" else 0
    flat0 = ravel_pytree(jax.tree.map(lambda x: x[0], vectors))[0]
    if np.min(np.abs(np.delete(eigvals, top) - eigvals[top])) > 1e-6:
        assert abs(abs(np.dot(flat0, eigvecs[:, top])) - 1) < 1e-8


def test_top_eigenpairs_converge_before_the_whole_space():
    op, a = operator("psd")
    values, vectors = eqx.filter_jit(sp.top_eigenpairs)(
        op, 3, key=jr.key(0), iterations=25
    )
    eig = np.linalg.eigvalsh(a)[::-1]
    check_eigenpairs(op, a, values, vectors, eig[:3])
    assert np.all(values <= eig[:3] + 1e-10)  # Ritz values never overshoot


@pytest.mark.parametrize("name", ["psd", "hessian", "ggn"])
def test_extreme_eigenvalues(name):
    op, a = operator(name)
    eig = np.linalg.eigvalsh(a)
    scale = np.max(np.abs(eig))
    # Plain Lanczos (no reorthogonalisation) loses orthogonality but its extreme
    # Ritz values converge to the ends of the spectrum (the small end of "psd",
    # 100·0.8^39, takes more steps than the size).
    low, high = eqx.filter_jit(sp.extreme_eigenvalues)(
        op, iterations=3 * a.shape[0], key=jr.key(1)
    )
    np.testing.assert_allclose([low, high], [eig[0], eig[-1]], atol=1e-8 * scale)
    # With few products the largest has converged, and both lie inside the spectrum.
    low, high = eqx.filter_jit(sp.extreme_eigenvalues)(op, iterations=20, key=jr.key(1))
    assert eig[0] - 1e-10 * scale <= low and high <= eig[-1] + 1e-10 * scale
    if name == "psd":
        np.testing.assert_allclose(high, eig[-1], rtol=1e-8)


def test_quadrature_nodes_and_weights():
    op, a = operator("psd")
    eig = np.linalg.eigvalsh(a)
    q = slq(op, iterations=a.shape[0], key=jr.key(0), repeats=3)
    # Over the whole space the nodes are the eigenvalues (all distinct here).
    np.testing.assert_allclose(
        np.sort(q.nodes, axis=1), eig[None].repeat(3, 0), atol=1e-10
    )
    np.testing.assert_allclose(np.sum(q.weights, axis=1), 1, rtol=1e-12)
    assert np.all(q.weights >= 0)


@pytest.mark.parametrize("reorthogonalise", [True, False])
@pytest.mark.parametrize("name", ["psd", "hessian", "low_rank"])
def test_quadrature_first_moment_unbiased(name, reorthogonalise):
    op, a = operator(name)
    d = a.shape[0]
    q = slq(
        op,
        iterations=8,
        key=jr.key(5),
        repeats=REPEATS,
        reorthogonalise=reorthogonalise,
    )
    # Σⱼ wⱼθⱼ = uᵀAu for the unit start vector u, uniform on the sphere:
    # E = tr(A)/d, Var = (tr(A)² + 2 tr(A²))/(d(d+2)) − tr(A)²/d².
    moments = np.sum(q.weights * q.nodes, axis=1)
    t, t2 = np.trace(a), np.trace(a @ a)
    var = (t**2 + 2 * t2) / (d * (d + 2)) - t**2 / d**2
    assert not mean_off(moments, t / d, np.sqrt(var / REPEATS), name)
    # The second moment is exact too (degree 2 < 2·iterations): uᵀA²u.
    second = np.sum(q.weights * q.nodes**2, axis=1)
    var2 = (t2**2 + 2 * np.trace(a @ a @ a @ a)) / (d * (d + 2)) - t2**2 / d**2
    assert not mean_off(second, t2 / d, np.sqrt(var2 / REPEATS), name)


def test_breakdown_on_low_rank_is_finite():
    op, a = operator("low_rank")  # rank 5: the Krylov space is invariant after 6
    for reorthogonalise in (True, False):
        q = slq(op, iterations=30, key=jr.key(0), reorthogonalise=reorthogonalise)
        assert np.all(np.isfinite(q.nodes)) and np.all(np.isfinite(q.weights))
        np.testing.assert_allclose(np.sum(q.weights), 1, rtol=1e-12)
    eig = np.linalg.eigvalsh(a)
    q = slq(op, iterations=40, key=jr.key(0))
    np.testing.assert_allclose(np.sort(q.nodes[0]), eig, atol=1e-10 * eig[-1])


def test_density_is_a_normalised_smoothing_of_the_quadrature():
    op, a = operator("psd")
    q = slq(op, iterations=12, key=jr.key(0), repeats=4)
    # A margin wide enough that no bump is cut: the density is a Gaussian mixture
    # with the quadrature's weights, so mass 1 and mean Σ wθ / repeats.
    grid, density = jit_density(q, points=4096, margin=1.0)
    assert grid.shape == density.shape == (4096,)
    assert np.all(density >= 0)
    np.testing.assert_allclose(np.trapezoid(density, grid), 1, rtol=1e-6)
    mean = np.sum(q.weights * q.nodes) / 4
    np.testing.assert_allclose(np.trapezoid(grid * density, grid), mean, rtol=1e-6)
    # The default grid spans the nodes plus a 5% margin.
    grid, _ = jit_density(q)
    low, high = np.min(q.nodes), np.max(q.nodes)
    pad = 0.05 * (high - low)
    np.testing.assert_allclose(np.asarray(grid)[[0, -1]], [low - pad, high + pad])
    grid, _ = jit_density(q, boundaries=(0.0, 200.0), margin=0.0)
    np.testing.assert_allclose(np.asarray(grid)[[0, -1]], [0, 200])


def test_log_density():
    op, a = operator("hessian")  # indefinite: |λ| on the log scale
    q = slq(op, iterations=12, key=jr.key(0), repeats=4)
    eps = 1e-5
    grid, density = jit_log_density(q, points=8192, margin=1.0, kappa=3.0, epsilon=eps)
    assert np.all(np.diff(np.log(grid)) > 0)  # log-spaced
    np.testing.assert_allclose(
        np.diff(np.log(grid)), np.diff(np.log(grid))[0], rtol=1e-8
    )
    # A density per unit λ: mass 1, and the mean of log(|λ| + ε) is the weighted one.
    np.testing.assert_allclose(np.trapezoid(density, grid), 1, rtol=1e-4)
    mean_log = np.sum(q.weights * np.log(np.abs(q.nodes) + eps)) / 4
    np.testing.assert_allclose(
        np.trapezoid(np.log(grid) * density, grid), mean_log, rtol=1e-4, atol=1e-4
    )
    g2, d2 = eqx.filter_jit(sp.spectral_density)(
        op, iterations=12, key=jr.key(0), repeats=4, log=True
    )
    assert g2.shape == d2.shape == (1024,) and np.all(np.isfinite(d2))


def test_jit_vmap_and_batch_size_agree():
    op, a = operator("ggn")
    est = sp.XTrace(matvecs=8)
    keys = jr.split(jr.key(0), 2)
    one = [float(eqx.filter_jit(sp.trace)(op, est, key=k)) for k in keys]
    np.testing.assert_allclose(
        many(lambda o, k: sp.trace(o, est, key=k), op, keys), one, rtol=1e-12
    )
    chunked = eqx.filter_jit(sp.trace)(op, est, key=keys[0], batch_size=3)
    np.testing.assert_allclose(chunked, one[0], rtol=1e-12)
    # vmap over operators: a batch of matrices.
    mats = jnp.stack([psd_matrix(20, s) for s in range(3)])

    @jax.jit  # one compilation rather than one per primitive
    @jax.vmap
    def top(m):
        return sp.top_eigenpairs(lx.MatrixLinearOperator(m, PSD), 1, key=jr.key(0))[0]

    np.testing.assert_allclose(top(mats)[:, 0], 100, rtol=1e-8)


def test_errors(unchecked):
    op, _ = operator("psd")
    with pytest.raises(ValueError, match="multiple of 3"):
        sp.HutchPlusPlus(matvecs=10)
    with pytest.raises(ValueError, match="must be even"):
        sp.XTrace(matvecs=9)
    with pytest.raises(ValueError, match="distribution"):
        sp.Hutchinson(matvecs=4, distribution="gaussian")
    with pytest.raises(ValueError, match="more than the operator's size"):
        sp.trace(op, sp.XTrace(matvecs=82), key=jr.key(0))
    with pytest.raises(TypeError, match="`estimator` must be"):
        sp.trace(op, "hutchinson", key=jr.key(0))
    with pytest.raises(TypeError, match="`operator` must be a lineax operator"):
        sp.trace(np.eye(3), sp.Hutchinson(matvecs=2), key=jr.key(0))
    rect = lx.MatrixLinearOperator(jnp.ones((3, 4)))
    with pytest.raises(ValueError, match="must be square"):
        sp.squared_frobenius_norm(rect, matvecs=2, key=jr.key(0))
    with pytest.raises(ValueError, match="iterations"):
        sp.top_eigenpairs(op, 5, key=jr.key(0), iterations=3)
    with pytest.raises(ValueError, match="which"):
        sp.top_eigenpairs(op, 1, key=jr.key(0), which="biggest")
    with pytest.raises(ValueError, match="batch_size"):
        sp.trace(op, sp.Hutchinson(matvecs=2), key=jr.key(0), batch_size=0)
    with pytest.raises(ValueError, match="kappa"):
        sp.lanczos_quadrature(op, iterations=4, key=jr.key(0)).density(kappa=1.0)
    q = sp.lanczos_quadrature(op, iterations=4, key=jr.key(0))
    for bounds in [(0.5, 0.5), (1.0, -1.0), (0.0, float("inf"))]:
        with pytest.raises(ValueError, match="low < high"):
            q.density(boundaries=bounds)
    with pytest.raises(ValueError, match=r"log_density\(boundaries"):
        q.log_density(boundaries=(2.0, 1.0))
    # An array is a tracer by the time it is checked: its shape is named.
    with pytest.raises(TypeError, match=r"an array of shape \(3, 3\)"):
        sp.trace(jnp.eye(3), sp.Hutchinson(matvecs=2), key=jr.key(0))
    for key in [0, None, jnp.zeros(3)]:
        with pytest.raises(TypeError, match=r"top_eigenpairs\(\.\.\., key=\.\.\.\)"):
            sp.top_eigenpairs(op, 1, key=key)
    # A raw `jax.random.PRNGKey` is a key too.
    sp.extreme_eigenvalues(op, iterations=4, key=jr.PRNGKey(0))


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("scale", [0.0, 1.0, 2.0])
def test_density_of_a_multiple_of_the_identity(scale, log):
    # One node: a grid of no width gave NaN densities (zero) or 1e15 (identity).
    op = lx.MatrixLinearOperator(scale * jnp.eye(20), PSD)
    grid, density = sp.spectral_density(
        op, iterations=5, key=jr.key(0), points=2001, kappa=3.0, margin=2.0, log=log
    )
    assert np.all(np.isfinite(density)) and np.all(np.diff(grid) > 0)
    # All the mass at the one eigenvalue (|λ| + ε on the log scale).
    peak = float(grid[np.argmax(density)])
    np.testing.assert_allclose(peak, scale + (1e-5 if log else 0), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(np.trapezoid(density, grid), 1, rtol=1e-3)


def test_normal_vectors_unbiased():
    op, a = operator("psd")
    est = sp.Hutchinson(matvecs=12, distribution="normal")
    samples = np.asarray(many(lambda o, k: sp.trace(o, est, key=k), op, KEYS))
    var = 2 * np.sum(a**2) / 12  # Gaussian: 2‖A‖_F²/m
    assert not mean_off(samples, np.trace(a), np.sqrt(var / REPEATS), "normal")


def test_docs_example_runs():
    text = (pathlib.Path(__file__).parents[1] / "docs" / "spectral.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    scope: dict = {}
    with jax.numpy_dtype_promotion("standard"):
        exec(compile(code, "docs/spectral.md", "exec"), scope)
    assert (
        np.isfinite(scope["values"][0]) and scope["values"][0] <= scope["high"] + 1e-4
    )
    assert scope["grid"].shape == scope["log_density"].shape == (1024,)


def test_rademacher_vectors_are_independent_fair_signs():
    """The signs come 32 to a random word: every entry ±1, each fair, and entries
    of one word, of neighbouring words and of different vectors uncorrelated."""
    from eqfisher.spectral._flat import random_vectors

    w = np.asarray(random_vectors(jr.key(3), 100, 2000, "rademacher", jnp.float64))
    assert w.shape == (100, 2000)
    assert set(np.unique(w)) == {-1.0, 1.0}
    # 2,000 signs per row: a fair coin's mean has standard deviation 0.022.
    assert np.abs(w.mean(axis=1)).max() < 0.11
    flat = w.reshape(-1)
    for lag in (1, 31, 32, 33, 2000):  # within a word, across words, across vectors
        corr = np.mean(flat[:-lag] * flat[lag:])
        assert abs(corr) < 0.02, (lag, corr)  # standard deviation 0.0022
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        v = random_vectors(jr.key(0), 7, 3, "rademacher", dtype)
        assert v.dtype == dtype and v.shape == (7, 3)


def test_hutchinson_draws_more_vectors_than_the_size():
    """Hutchinson is unbiased for any number of vectors (it was refused above the
    size, as the sketching estimators are); on a diagonal operator its Rademacher
    estimate is exact."""
    d = jnp.arange(1.0, 41.0)
    op = lx.MatrixLinearOperator(jnp.diag(d), PSD)
    got = sp.trace(op, sp.Hutchinson(matvecs=100), key=jr.key(0))
    np.testing.assert_allclose(got, jnp.sum(d), rtol=1e-12)
    diagonal = sp.diagonal(op, sp.Hutchinson(matvecs=100), key=jr.key(1))
    np.testing.assert_allclose(diagonal, d, rtol=1e-12)


def test_eigen_methods_refuse_an_unsymmetric_operator():
    """A random matrix, untagged: Lanczos gave (-49.0, 47.4) as its extreme
    eigenvalues (its spectral radius is 4.5; they are complex). A symmetric
    matrix left untagged is checked and accepted."""
    matrix = jr.normal(jr.key(1), (20, 20))
    op = lx.MatrixLinearOperator(matrix)
    with pytest.raises(Exception, match="`operator` is not symmetric"):
        sp.top_eigenpairs(op, 2, key=jr.key(0))
    with pytest.raises(Exception, match="`operator` is not symmetric"):
        sp.extreme_eigenvalues(op, iterations=10, key=jr.key(0))
    with pytest.raises(Exception, match="`operator` is not symmetric"):
        sp.spectral_density(op, iterations=10, key=jr.key(0))
    symmetric = lx.MatrixLinearOperator(matrix + matrix.T)
    values, _ = sp.top_eigenpairs(symmetric, 2, key=jr.key(0), iterations=20)
    want = np.linalg.eigvalsh(np.asarray(matrix + matrix.T))[::-1][:2]
    np.testing.assert_allclose(values, want, rtol=1e-10)


def test_log_density_refuses_a_negative_boundary():
    """`boundaries=(-1, 10)`, as `density` takes for an indefinite operator, gave
    1024 NaN values on the log scale (of |λ|)."""
    op, _ = operator("psd")
    q = sp.lanczos_quadrature(op, iterations=10, key=jr.key(0))
    with pytest.raises(ValueError, match=r"log scale is of \|λ\|"):
        q.log_density(boundaries=(-1.0, 10.0))
    grid, density = q.log_density(boundaries=(0.0, 10.0))
    assert np.all(np.isfinite(density)) and np.all(np.isfinite(grid))


class _Misshapen(sp.AbstractTraceEstimator):
    """Returns what `what` says: products of a V one row too long, a vector for
    the trace, or too short a diagonal."""

    what: str = eqx.field(static=True)
    matvecs: int = 1
    distribution: str = "rademacher"

    def trace(self, operator, key):
        if self.what == "rows":  # e_2 ... e_{P+1}: the last row was dropped
            v = jnp.eye(operator.size + 1, dtype=operator.dtype)[:, 1:]
            return jnp.trace(operator.matmat(v))
        return jnp.diagonal(
            operator.matmat(jnp.eye(operator.size, dtype=operator.dtype))
        )

    def diagonal(self, operator, key):
        return jnp.zeros(operator.size - 1, operator.dtype)


def test_an_estimator_of_other_shapes_is_refused():
    # `matmat` of a V with P + 1 rows returned the superdiagonal's sum as a trace
    # (no error); a `trace` returning a vector was passed on as the trace.
    op, _ = _matrix(psd_matrix(6))
    with pytest.raises(ValueError, match=r"must be a matrix of the operator's size"):
        sp.trace(op, _Misshapen("rows"), key=jr.key(0))
    with pytest.raises(ValueError, match=r"`_Misshapen.trace\(operator, key\)` must"):
        sp.trace(op, _Misshapen("vector"), key=jr.key(0))
    with pytest.raises(ValueError, match=r"must return a flat vector of the operator"):
        sp.diagonal(op, _Misshapen("vector"), key=jr.key(0))


def test_half_precision_is_refused_where_a_factorisation_is_needed():
    # jax has no bfloat16 QR or eigh: the sketching estimators and Lanczos failed
    # with "Unsupported dtype bfloat16" (jax 0.10) or "qr does not accept dtype".
    op = lx.MatrixLinearOperator(jnp.asarray(psd_matrix(6), jnp.bfloat16), PSD)
    t = sp.trace(op, sp.Hutchinson(matvecs=4), key=jr.key(0))
    assert t.dtype == jnp.bfloat16 and bool(jnp.isfinite(t))
    with pytest.raises(TypeError, match=r"`XTrace\(matvecs=4\)` factorises"):
        sp.trace(op, sp.XTrace(matvecs=4), key=jr.key(0))
    with pytest.raises(TypeError, match=r"top_eigenpairs` factorises .* bfloat16"):
        sp.top_eigenpairs(op, 1, key=jr.key(0))
