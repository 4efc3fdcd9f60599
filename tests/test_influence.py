"""`eqfisher.influence` against explicit gᵀ (H + λI)⁻¹ g with dense float64 inverses.

Per-example gradients of the reference come from `jax.vmap(jax.grad(...))` on the
ravelled parameters; H is the dense GGN from tests/helpers.py (`Dense()` and
conjugate gradients on `ggn_operator`) or the structure's own matrix
(`Curvature.as_matrix()`) for the approximations.
"""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import eqfisher as ef
import eqfisher.influence as inf

from .helpers import dense_ggn_cross_entropy, ravelled


N, Q, D_IN, D_OUT, DAMPING = 11, 3, 3, 4, 0.05
LAST = ef.filters.by_path("layers[2].*")


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def setup():
    model = eqx.nn.MLP(
        D_IN, D_OUT, 5, 2, activation=jnp.tanh, dtype=jnp.float64, key=jax.random.key(0)
    )
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (N + Q, D_IN), jnp.float64)
    y = jax.random.randint(ky, (N + Q,), 0, D_OUT)
    return model, (x[:N], y[:N]), (x[N:], y[N:])


def reference_gradients(model, batch, sel):
    flat, rebuild = ravelled(model)
    per = lambda f, x, y: loss_fn(rebuild(f), (x[None], y[None]))
    return np.asarray(jax.jit(jax.vmap(jax.grad(per), (None, 0, 0)))(flat, *batch))[
        :, sel
    ]


# Every test uses the same model and batches: their dense GGN and per-example
# gradients (over every parameter) are computed once and restricted by `sel`.
@ft.cache
def references():
    """`(ggn, g_train, g_query)` over all parameters, read-only."""
    model, train, query = setup()
    sel = selection(model, None)
    out = (
        dense_ggn_cross_entropy(model, *train),
        reference_gradients(model, train, sel),
        reference_gradients(model, query, sel),
    )
    for a in out:
        a.flags.writeable = False
    return out


def selection(model, where):
    params = eqx.filter(model, eqx.is_inexact_array)
    flags = (
        jax.tree_util.tree_map(lambda p: True, params)
        if where is None
        else ef.filters.optax_mask(model, where)
    )
    full = jax.tree_util.tree_map(lambda p, f: jnp.full(p.shape, f), params, flags)
    return np.asarray(ravel_pytree(full)[0]).astype(bool)


STRUCTURES = {
    "dense": ef.Dense(),
    "diagonal": ef.Diagonal(),
    "kfac": ef.KFAC(),
    "ekfac": ef.EKFAC(),
}
CASES = [(name, w) for name in [*STRUCTURES, "identity", "cg"] for w in (None, LAST)]
CASES = [c for c in CASES if not (c[0] == "cg" and c[1] is not None)]


def inverse_and_matrix(name, model, train, where, sel):
    if name == "identity":
        return inf.Identity(), np.eye(int(sel.sum()))
    ggn = references()[0][np.ix_(sel, sel)]
    damped = lambda c: np.linalg.inv(c + DAMPING * np.eye(c.shape[0]))
    if name == "cg":
        op = ef.ggn_operator(loss_fn, model, train)
        return inf.ConjugateGradient(op, DAMPING, rtol=1e-12, atol=1e-12), damped(ggn)
    curv = ef.curvature(
        loss_fn,
        model,
        train,
        estimator=ef.GGN(),
        structure=STRUCTURES[name],
        where=where,
    )
    c = ggn if name == "dense" else np.asarray(curv.as_matrix())
    return inf.CurvatureInverse(curv, DAMPING), damped(c)


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0]}-{'all' if c[1] is None else 'last'}"
)
def test_scores_against_dense_inverse(case):
    name, where = case
    model, train, query = setup()
    sel = selection(model, where)
    inverse, h_inv = inverse_and_matrix(name, model, train, where, sel)
    _, g_train, g_query = references()
    g_train, g_query = g_train[:, sel], g_query[:, sel]
    expected = g_query @ h_inv @ g_train.T
    got = inf.influence_scores(loss_fn, model, train, query, inverse, where=where)
    tol = 1e-8 if name == "cg" else 1e-10
    np.testing.assert_allclose(
        got, expected, rtol=tol, atol=tol * np.abs(expected).max()
    )
    # Chunks that do not divide N or Q give the same scores.
    chunked = inf.influence_scores(
        loss_fn,
        model,
        train,
        query,
        inverse,
        where=where,
        chunk_size=4,
        query_chunk_size=2,
    )
    np.testing.assert_allclose(chunked, got, rtol=1e-10, atol=1e-12)
    own = inf.self_influence(loss_fn, model, train, inverse, where=where, chunk_size=4)
    np.testing.assert_allclose(
        own, np.einsum("ni,ij,nj->n", g_train, h_inv, g_train), rtol=tol
    )


def test_conjugate_gradient_in_float32():
    """float32 CG on the exact GGN at a small damping: the scaled system keeps
    lineax's breakdown test quiet; scores within 1e-3 of the float64 ones."""
    model, train, query = setup()
    cast = lambda t: jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a, t
    )
    model32, train32, query32 = cast(model), cast(train), cast(query)
    op = ef.ggn_operator(loss_fn, model32, train32)
    inverse = inf.ConjugateGradient(op, 1e-3, rtol=1e-5, atol=1e-5)
    got = inf.influence_scores(loss_fn, model32, train32, query32, inverse)
    assert got.dtype == jnp.float32
    ggn, g_t, g_q = references()
    expected = g_q @ np.linalg.solve(ggn + 1e-3 * np.eye(ggn.shape[0]), g_t.T)
    np.testing.assert_allclose(got, expected, atol=1e-3 * np.abs(expected).max())


def test_conjugate_gradient_differentiates_in_the_damping_and_the_query():
    # Its tolerance scales with the right-hand side and the damping: their
    # tangents reached lineax's solver, which refused ("Unexpected tangent").
    model, train, query = setup()
    op = ef.ggn_operator(loss_fn, model, train)
    ggn, g_t, g_q = references()
    eye = np.eye(ggn.shape[0])

    def summed(damping):
        inverse = inf.ConjugateGradient(op, damping, rtol=1e-12, atol=1e-12)
        return jnp.sum(inf.influence_scores(loss_fn, model, train, query, inverse))

    # d/dλ of Σ g_q (C + λI)⁻¹ g_tᵀ is -Σ g_q (C + λI)⁻² g_tᵀ.
    solved = np.linalg.solve(ggn + DAMPING * eye, g_t.T)
    expected = -np.sum(g_q @ np.linalg.solve(ggn + DAMPING * eye, solved))
    np.testing.assert_allclose(jax.grad(summed)(DAMPING), expected, rtol=1e-8)
    inverse = inf.ConjugateGradient(op, DAMPING, rtol=1e-12, atol=1e-12)
    by_query = jax.grad(
        lambda x: jnp.sum(
            inf.influence_scores(loss_fn, model, train, (x, query[1]), inverse)
        )
    )(query[0])
    exact = inf.CurvatureInverse(
        ef.curvature(loss_fn, model, train, estimator=ef.GGN(), structure=ef.Dense()),
        DAMPING,
    )
    expected_by_query = jax.grad(
        lambda x: jnp.sum(
            inf.influence_scores(loss_fn, model, train, (x, query[1]), exact)
        )
    )(query[0])
    np.testing.assert_allclose(by_query, expected_by_query, rtol=1e-8, atol=1e-12)


def test_conjugate_gradient_that_does_not_converge_is_refused():
    # With `throw=False` the last iterate came back as if solved: 3 steps gave
    # scores 8% off, silently.
    model, train, query = setup()
    op = ef.ggn_operator(loss_fn, model, train)
    inverse = inf.ConjugateGradient(op, 1e-3, max_steps=3)
    # Raised inside `lax.map`'s compiled body, JAX wrapped Equinox's error in its
    # `JaxRuntimeError` with Equinox's advice to use `eqx.filter_jit`, and logged
    # it: the functions now raise Equinox's error with the message alone.
    message = (
        "`eqfisher.influence.ConjugateGradient`: CG did not converge to "
        "`rtol`/`atol` within `max_steps`; raise `max_steps` or `damping`, or "
        "loosen `rtol`/`atol`."
    )
    with pytest.raises(eqx.EquinoxRuntimeError) as info:
        inf.influence_scores(loss_fn, model, train, query, inverse)
    assert str(info.value) == message
    with pytest.raises(eqx.EquinoxRuntimeError) as info:
        inf.self_influence(loss_fn, model, train, inverse)
    assert str(info.value) == message


@pytest.mark.parametrize("rank", [1, 2, 5])
def test_low_rank_query_gradients(rank):
    """Rank-r queries: each preconditioned query gradient's weight matrices truncated
    to their top r singular triplets (NumPy SVD of the dense-inverse reference)."""
    model, train, query = setup()
    sel = selection(model, None)
    inverse, h_inv = inverse_and_matrix("kfac", model, train, None, sel)
    _, g_train, g_query = references()
    solved = g_query @ h_inv
    _, unravel = ravel_pytree(eqx.filter(model, eqx.is_inexact_array))

    def truncate(flat):
        leaves = jax.tree_util.tree_leaves(unravel(jnp.asarray(flat)))
        out = []
        for x in map(np.asarray, leaves):
            if x.ndim == 2:
                u, s, vt = np.linalg.svd(x, full_matrices=False)
                x = (u[:, :rank] * s[:rank]) @ vt[:rank]
            out.append(x.ravel())
        return np.concatenate(out)

    expected = np.stack([truncate(f) for f in solved]) @ g_train.T
    got = inf.influence_scores(
        loss_fn, model, train, query, inverse, query_rank=rank, chunk_size=4
    )
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    if rank == 5:  # full rank for every weight here (5 hidden units)
        exact = inf.influence_scores(loss_fn, model, train, query, inverse)
        np.testing.assert_allclose(got, exact, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("which", ["influence_scores", "self_influence"])
def test_a_where_selecting_nothing_is_refused_in_the_callers_words(which):
    model, train, query = setup()
    inverse = inf.Identity()
    nothing = ef.filters.by_path("no_such_layer.*")
    args = (train, query) if which == "influence_scores" else (train,)
    with pytest.raises(ValueError, match="selects no parameter") as info:
        getattr(inf, which)(loss_fn, model, *args, inverse, where=nothing)
    assert f"eqfisher.influence.{which}(..., where=...)" in info.value.__notes__[0]


@pytest.mark.parametrize("which", ["influence_scores", "self_influence"])
@pytest.mark.parametrize("built_with", ["last", "all"])
def test_an_inverse_over_other_parameters_than_where_names_where(which, built_with):
    # A last-layer curvature scored without `where=` (or an all-layer one with
    # it) failed inside `Curvature.solve`, naming neither the caller nor `where=`.
    model, train, query = setup()
    last = ef.filters.by_path("layers[2].*")
    curv = ef.curvature(
        loss_fn,
        model,
        train,
        estimator=ef.GGN(),
        structure=ef.KFAC(),
        where=last if built_with == "last" else None,
    )
    args = (train, query) if which == "influence_scores" else (train,)
    inverses = [inf.CurvatureInverse(curv, 1e-3)]
    if built_with == "all":  # the exact GGN's operator covers every parameter too
        inverses.append(
            inf.ConjugateGradient(ef.ggn_operator(loss_fn, model, train), 1e-3)
        )
    wrong, right = (None, last) if built_with == "last" else (last, None)
    for inverse in inverses:
        with pytest.raises(ValueError, match=rf"{which}\(.*takes the gradients of"):
            getattr(inf, which)(loss_fn, model, *args, inverse, where=wrong)
        got = getattr(inf, which)(loss_fn, model, *args, inverse, where=right)
        assert got.shape == ((Q, N) if which == "influence_scores" else (N,))


@pytest.mark.parametrize("which", ["influence_scores", "self_influence"])
def test_an_inverse_over_another_layer_of_the_same_shapes_is_refused(which):
    """Two hidden layers of one shape: a curvature of `layers[1]` scored with
    `where=layers[2]` was accepted (the shapes agree), the scores 146% off."""
    model = eqx.nn.MLP(
        D_IN, D_OUT, 5, 3, activation=jnp.tanh, dtype=jnp.float64, key=jax.random.key(0)
    )
    _, train, query = setup()
    first, second = ef.filters.by_path("layers[1].*"), ef.filters.by_path("layers[2].*")
    curv = ef.curvature(
        loss_fn, model, train, estimator=ef.GGN(), structure=ef.Dense(), where=first
    )
    inverse = inf.CurvatureInverse(curv, 0.1)
    args = (train, query) if which == "influence_scores" else (train,)
    match = r"takes the gradients of \['.layers\[1\].weight'.*selects \['.layers\[2\]"
    with pytest.raises(ValueError, match=match):
        getattr(inf, which)(loss_fn, model, *args, inverse, where=second)
    getattr(inf, which)(loss_fn, model, *args, inverse, where=first)


@pytest.mark.parametrize("damping", [0.0, -0.1, float("nan")])
def test_a_damping_that_is_not_positive_is_refused(damping):
    # CG at damping 0 on a singular GGN returned scores of exactly zero.
    model, train, _ = setup()
    curv = ef.curvature(loss_fn, model, train, estimator=ef.GGN(), structure=ef.KFAC())
    op = ef.ggn_operator(loss_fn, model, train)
    for make, name in [
        (lambda: inf.ConjugateGradient(op, damping), "ConjugateGradient"),
        (lambda: inf.CurvatureInverse(curv, damping), "CurvatureInverse"),
    ]:
        with pytest.raises(ValueError, match=rf"{name}\(\.\.\., damping\)"):
            make()
    # A traced damping is checked when the inverse is used.
    solve = eqx.filter_jit(lambda d, g: inf.ConjugateGradient(op, d).solve(g))
    grads = eqx.filter(eqx.filter_grad(loss_fn)(model, train), eqx.is_inexact_array)
    with pytest.raises(eqx.EquinoxRuntimeError, match="`damping` must be positive"):
        jax.block_until_ready(solve(jnp.asarray(damping), grads))


def test_conjugate_gradient_on_a_diagonal_float32_curvature_under_x64():
    # lineax summed the `Diagonal()` curvature's diagonal with the identity's
    # float64 one, and CG refused the float32 vector ("structures do not match").
    model, train, _ = setup()
    cast = lambda t: jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a, t
    )
    model32, train32 = cast(model), cast(train)
    curv = ef.curvature(
        loss_fn, model32, train32, estimator=ef.GGN(), structure=ef.Diagonal()
    )
    by_cg = inf.self_influence(
        loss_fn, model32, train32, inf.ConjugateGradient(curv, 0.1, rtol=1e-7)
    )
    exact = inf.self_influence(
        loss_fn, model32, train32, inf.CurvatureInverse(curv, 0.1)
    )
    assert by_cg.dtype == jnp.float32
    np.testing.assert_allclose(by_cg, exact, rtol=1e-4)


def test_arguments_of_the_wrong_kind_are_named(unchecked):
    model, train, query = setup()
    op = ef.ggn_operator(loss_fn, model, train)
    with pytest.raises(TypeError, match="use `ConjugateGradient"):
        inf.CurvatureInverse(op, 0.1)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="wrap a dense matrix"):
        inf.ConjugateGradient(jnp.eye(3), 0.1)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"self_influence\(\.\.\., inverse\)"):
        inf.self_influence(loss_fn, model, train, None)  # pyright: ignore[reportArgumentType]
    one = jax.tree_util.tree_map(lambda a: a[0], query)  # no example axis
    with pytest.raises(ValueError, match="every leaf of `query`"):
        inf.influence_scores(loss_fn, model, train, one, inf.Identity())
    uneven = (train[0], train[1][:5])
    with pytest.raises(ValueError, match="every leaf of `train`"):
        inf.self_influence(loss_fn, model, uneven, inf.Identity())
    for name, value in [("chunk_size", 0), ("query_chunk_size", -1), ("query_rank", 0)]:
        with pytest.raises(
            ValueError, match=rf"{name}=\.\.\.\)` must be an integer >= 1"
        ):
            inf.influence_scores(
                loss_fn, model, train, query, inf.Identity(), **{name: value}
            )


def test_scores_compile_once_for_repeated_calls():
    # Each call compiled its `lax.map`s again (0.5-1 s a call).
    from .helpers import compiled_during

    model, train, query = setup()
    inverse = ef.influence.Identity()
    calls = {
        "scores": lambda: ef.influence.influence_scores(
            loss_fn, model, train, query, inverse
        ),
        "self": lambda: ef.influence.self_influence(loss_fn, model, train, inverse),
    }
    for call in calls.values():
        call()
        assert compiled_during(call) == []


class _Transposed(inf.AbstractInverse):
    def solve(self, vector):
        return jax.tree.map(lambda v: v.T, vector)


class _Flat(inf.AbstractInverse):
    def solve(self, vector):
        return ravel_pytree(vector)[0]


@pytest.mark.parametrize("inverse", [_Transposed(), _Flat()])
def test_an_inverse_whose_solve_changes_the_shapes_is_refused(inverse):
    # A `solve` transposing a weight's gradient gave scores of another shape
    # (3 × 10 numbers, no error); a flat vector gave JAX's "dot_general requires
    # contracting dimensions".
    model, train, query = setup()
    name = type(inverse).__name__
    with pytest.raises(ValueError, match=rf"`{name}.solve\(vector\)` must return"):
        inf.influence_scores(loss_fn, model, train, query, inverse)
    with pytest.raises(ValueError, match=rf"`{name}.solve\(vector\)` must return"):
        inf.self_influence(loss_fn, model, train, inverse)


def test_conjugate_gradient_refuses_half_and_mixed_precision():
    # In bfloat16 CG never met its tolerances ("did not converge" at any rtol);
    # with mixed dtypes it raised lineax's "Closure-converted function called with
    # different dynamic arguments".
    model, train, query = setup()
    for cast in (
        lambda m: jax.tree.map(
            lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, m
        ),
        lambda m: eqx.tree_at(
            lambda m: m.layers[0].weight, m, m.layers[0].weight.astype(jnp.float32)
        ),
    ):
        low = cast(model)
        with jax.numpy_dtype_promotion("standard"):
            cg = inf.ConjugateGradient(ef.ggn_operator(loss_fn, low, train), DAMPING)
            with pytest.raises(TypeError, match=r"CG needs parameters of one dtype"):
                inf.self_influence(loss_fn, low, train, cg)
