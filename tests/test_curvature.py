"""`eqfisher.curvature` and `value_grad_and_curvature` against dense float64
references built without eqfisher (`tests/helpers.py`).

Everything heavy runs under `eqx.filter_jit` (one compilation per case), which also
checks that curvature works under `jit`.
"""

import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import lineax as lx
import numpy as np
import pytest

import eqfisher as ef
from eqfisher.internal import JOIN_ROWS_PER_COLUMN, AbstractLayerKind, layer_inputs

from . import kfac_reference
from .helpers import (
    block_slices,
    dense_empirical_fisher,
    dense_ggn,
    dense_ggn_cross_entropy,
    ravelled,
    tree_allclose,
)


F64 = jnp.float64
N = 6  # examples per batch
IN, HIDDEN, OUT = 3, 5, 4
DAMPING = 0.3
TOL = {"rtol": 1e-10, "atol": 1e-12}


# --- Losses: eqfisher's registered loss and a plain-JAX per-example reference ----


@dataclasses.dataclass(frozen=True)
class Loss:
    register: Callable[[Any, Any], Any]  # eqfisher's loss on (outputs, targets)
    per_example: Callable[[Any, Any], Any]  # plain JAX, one example
    targets: Callable[[Any, tuple[int, ...]], Any]  # (key, outputs shape)


def _ce(z, y):
    return -jax.nn.log_softmax(z)[y]


def _sigmoid(z, t):
    return jnp.sum(jax.nn.softplus(z) - t * z)


def _squared(z, t):
    return 0.5 * jnp.sum((z - t) ** 2)


LOSSES = {
    "softmax_ce": Loss(
        ef.softmax_cross_entropy,
        _ce,
        lambda k, shape: jr.randint(k, shape[:-1], 0, shape[-1]),
    ),
    "sigmoid_ce": Loss(
        ef.sigmoid_cross_entropy,
        _sigmoid,
        lambda k, shape: jr.bernoulli(k, 0.5, shape).astype(F64),
    ),
    "squared_error": Loss(
        ef.squared_error, _squared, lambda k, shape: jr.normal(k, shape, F64)
    ),
}


def _make_loss_fn(name: str):
    register = LOSSES[name].register

    def loss_fn(model, batch):
        x, y = batch
        return register(jax.vmap(model)(x), y)

    return loss_fn


# Module-level functions, so that each has one identity (jit caches stay warm).
LOSS_FNS = {name: _make_loss_fn(name) for name in LOSSES}


def mlp(seed: int = 0):
    return eqx.nn.MLP(
        IN, OUT, HIDDEN, 1, activation=jnp.tanh, dtype=F64, key=jr.key(seed)
    )


def batch_for(loss: str, n: int = N, seed: int = 1, in_shape=(IN,), out=OUT):
    kx, ky = jr.split(jr.key(seed))
    return jr.normal(kx, (n, *in_shape), F64), LOSSES[loss].targets(ky, (n, out))


def mean_loss(loss: str, outputs, targets):
    return jnp.mean(jax.vmap(LOSSES[loss].per_example)(outputs, targets))


def per_example_loss(loss: str):
    """`(model, (x, y)) -> loss of one example`, in plain JAX."""
    return lambda m, ex: LOSSES[loss].per_example(m(ex[0]), ex[1])


# The dense references of `helpers.py`, compiled: eager JAX compiles every
# operation separately, which is slow. `test_compiled_references_match_helpers`
# checks them against the helpers.


@eqx.filter_jit
def jacobian(model, x):
    """d outputs / d ravelled parameters, shape (N, outputs, parameters)."""
    flat, rebuild = ravelled(model)
    return jax.jacfwd(lambda f: jax.vmap(rebuild(f))(x))(flat)


@eqx.filter_jit
def ggn_of(model, batch, loss: str):
    """The dense GGN Jᵀ H J of the mean loss."""
    x, y = batch
    out = jax.vmap(model)(x)
    jac = jacobian(model, x).reshape(out.size, -1)
    hess = jax.hessian(lambda o: mean_loss(loss, o.reshape(out.shape), y))(out.ravel())
    return jac.T @ hess @ jac


@eqx.filter_jit
def empirical_fisher_of(model, batch, loss: str):
    """(1/N) Σₙ ∇ℓₙ ∇ℓₙᵀ with per-example gradients from `jax.grad`."""
    flat, rebuild = ravelled(model)
    one = per_example_loss(loss)
    grads = jax.vmap(jax.grad(lambda f, ex: one(rebuild(f), ex)), (None, 0))(
        flat, batch
    )
    return grads.T @ grads / grads.shape[0]


@ft.cache
def reference(loss: str, kind: str) -> np.ndarray:
    """The dense GGN (`kind="ggn"`) or empirical Fisher (`"ef"`) of the MLP."""
    of = ggn_of if kind == "ggn" else empirical_fisher_of
    return np.asarray(of(mlp(), batch_for(loss), loss))


def small_mlp():
    """A tiny MLP for the eager (uncompiled) checks."""
    return eqx.nn.MLP(2, 2, 2, 1, activation=jnp.tanh, dtype=F64, key=jr.key(5))


def small_batch():
    return batch_for("sigmoid_ce", 3, 4, (2,), 2)


def test_compiled_references_match_helpers():
    loss = "sigmoid_ce"
    model, batch = small_mlp(), small_batch()
    x, y = batch
    ggn = dense_ggn(lambda m: jax.vmap(m)(x), lambda o: mean_loss(loss, o, y), model)
    assert np.abs(ggn).max() > 1e-3
    assert_close(ggn_of(model, batch, loss), ggn)
    ef_ = dense_empirical_fisher(per_example_loss(loss), model, batch)
    assert_close(empirical_fisher_of(model, batch, loss), ef_)


def layer_mask(model, groups: list[list[int]]) -> np.ndarray:
    """1 on the diagonal blocks spanned by each group of parameter leaves."""
    slices = block_slices(model)
    size = slices[-1].stop
    mask = np.zeros((size, size))
    for group in groups:
        idx = np.concatenate([np.arange(size)[slices[i]] for i in group])
        mask[np.ix_(idx, idx)] = 1
    return mask


MLP_LAYERS = [[0, 1], [2, 3]]  # (weight, bias) of layers[0], layers[1]


def unravel_like(model, flat):
    params = eqx.filter(model, eqx.is_inexact_array)
    return jax.flatten_util.ravel_pytree(params)[1](jnp.asarray(flat))


def random_like(model, seed: int):
    flat, _ = ravelled(model)
    return unravel_like(model, jr.normal(jr.key(seed), flat.shape, F64))


@eqx.filter_jit
def _curvature(loss_fn, model, batch, estimator, structure, key=None, where=None):
    return ef.curvature(
        loss_fn,
        model,
        batch,
        estimator=estimator,
        structure=structure,
        key=key,
        where=where,
    )


def curv_for(loss, estimator, structure, *, n=N, seed=1, key=None, where=None):
    """The MLP's curvature (jitted; cached when `key` is None)."""
    if key is None:
        return _cached_curv(loss, estimator, structure, n, seed, where)
    model, batch = mlp(), batch_for(loss, n, seed)
    return _curvature(LOSS_FNS[loss], model, batch, estimator, structure, key, where)


@ft.cache
def _cached_curv(loss, estimator, structure, n, seed, where):
    model, batch = mlp(), batch_for(loss, n, seed)
    return _curvature(LOSS_FNS[loss], model, batch, estimator, structure, None, where)


def assert_close(actual, expected, **tol):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), **(TOL | tol))


# --- Dense / BlockDiagonal / Diagonal equal the dense references ---------------

ESTIMATORS = {
    "ggn": (ef.GGN(), "ggn"),
    "fisher_exact": (ef.FisherExact(), "ggn"),
    "empirical_fisher": (ef.EmpiricalFisher(), "ef"),
}
EXACT_STRUCTURES = {
    "dense": ef.Dense(),
    "block_diagonal": ef.BlockDiagonal(),
    "diagonal": ef.Diagonal(),
}
ALL_STRUCTURES = EXACT_STRUCTURES | {"kfac": ef.KFAC(), "ekfac": ef.EKFAC()}


@ft.cache
def exact_results(loss: str):
    """`(matrix, diagonal, trace)` for every estimator and exact structure, from one
    compilation."""

    @eqx.filter_jit
    def run(model, batch):
        out = {}
        for est_name, (est, _) in ESTIMATORS.items():
            for st_name, st in EXACT_STRUCTURES.items():
                curv = ef.curvature(
                    LOSS_FNS[loss], model, batch, estimator=est, structure=st
                )
                out[est_name, st_name] = (
                    curv.as_matrix(),
                    curv.diagonal(),
                    curv.trace(),
                )
        return out

    return run(mlp(), batch_for(loss))


@pytest.mark.parametrize("structure", list(EXACT_STRUCTURES))
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
@pytest.mark.parametrize("loss", list(LOSSES))
def test_exact_structures_match_dense_reference(loss, estimator, structure):
    matrix, diagonal, trace = exact_results(loss)[estimator, structure]
    ref = reference(loss, ESTIMATORS[estimator][1])
    assert np.abs(ref).max() > 1e-3  # a meaningful comparison
    if structure == "dense":
        expected = ref
    elif structure == "block_diagonal":
        expected = ref * layer_mask(mlp(), MLP_LAYERS)
    else:
        expected = np.diag(np.diag(ref))
    assert_close(matrix, expected)
    assert tree_allclose(diagonal, unravel_like(mlp(), np.diag(ref)))
    assert_close(trace, np.trace(ref))


def test_block_names_and_types():
    curv = curv_for("softmax_ce", ef.GGN(), ef.KFAC())
    assert list(curv.blocks) == ["layers[0]", "layers[1]"]
    assert all(isinstance(b, ef.blocks.KroneckerFactored) for b in curv.blocks.values())
    dense = curv_for("softmax_ce", ef.GGN(), ef.Dense())
    assert list(dense.blocks) == ["all"]
    assert isinstance(dense.blocks["all"], ef.blocks.Full)
    diag = curv_for("softmax_ce", ef.GGN(), ef.Diagonal())
    assert all(isinstance(b, ef.blocks.DiagonalBlock) for b in diag.blocks.values())
    ekfac = curv_for("softmax_ce", ef.GGN(), ef.EKFAC())
    assert all(
        isinstance(b, ef.blocks.EigenKroneckerFactored) for b in ekfac.blocks.values()
    )


def test_eager_matches_jit():
    # Outside `jit` too (a small model: eager JAX compiles every operation).
    model, batch = small_mlp(), small_batch()
    loss_fn, struct = LOSS_FNS["sigmoid_ce"], ef.KFAC()
    eager = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=struct)
    jitted = _curvature(loss_fn, model, batch, ef.GGN(), struct)
    assert np.abs(np.asarray(jitted.as_matrix())).max() > 1e-3
    assert_close(eager.as_matrix(), jitted.as_matrix())


# --- K-FAC ----------------------------------------------------------------------


class CNN(eqx.Module):
    """Conv2d + tanh + Linear on 1×5×5 inputs. The 5×5 kernel leaves a single output
    location: a convolution shares its weight over locations, so its K-FAC block is
    exact for one example only when there is one location (several locations are
    checked against curvlinops in `test_reference.py`)."""

    conv: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.conv = eqx.nn.Conv2d(1, 2, 5, dtype=F64, key=k1)
        self.head = eqx.nn.Linear(2, 3, dtype=F64, key=k2)

    def __call__(self, x):
        return self.head(jnp.tanh(self.conv(x)).reshape(-1))


# name: (model, input shape, outputs)
ONE_EXAMPLE_MODELS = {
    "mlp": (lambda k: mlp(), (IN,), OUT),
    "cnn": (CNN, (1, 5, 5), 3),
}
ONE_EXAMPLE_CASES = [("mlp", loss) for loss in LOSSES] + [("cnn", "softmax_ce")]


@pytest.mark.parametrize("name, loss", ONE_EXAMPLE_CASES)
def test_kfac_is_exact_for_one_example(name, loss):
    make, in_shape, out = ONE_EXAMPLE_MODELS[name]
    model = make(jr.key(0))
    batch = batch_for(loss, 1, 3, in_shape, out)
    ggn = np.asarray(ggn_of(model, batch, loss))
    kfac = _curvature(LOSS_FNS[loss], model, batch, ef.GGN(), ef.KFAC()).as_matrix()
    # Weight and bias of each layer form one block: the GGN's layer blocks, exactly.
    expected = ggn * layer_mask(model, [[0, 1], [2, 3]])
    assert np.abs(expected).max() > 1e-3
    assert_close(kfac, expected)


@eqx.filter_jit
def hand_factors(model, batch, loss: str, kind: str):
    """K-FAC factors of the MLP, by hand: A = mean ããᵀ, G = (1/N) Σₙ Jₙᵀ Hₙ Jₙ with
    Jₙ the Jacobian of the outputs w.r.t. the layer's pre-activation and Hₙ the
    loss Hessian (GGN) or rₙ rₙᵀ, rₙ the output gradient (empirical Fisher)."""
    x, y = batch
    (w0, b0), (w1, b1) = [(layer.weight, layer.bias) for layer in model.layers]
    z0 = jax.vmap(lambda xi: w0 @ xi + b0)(x)
    h = jnp.tanh(z0)
    out = jax.vmap(lambda hi: w1 @ hi + b1)(h)
    per_example = LOSSES[loss].per_example
    if kind == "ggn":
        hess = jax.vmap(jax.hessian(per_example))(out, y)
    else:
        r = jax.vmap(jax.grad(per_example))(out, y)
        hess = jnp.einsum("ni,nj->nij", r, r)
    jac0 = jnp.einsum("oh,nh->noh", w1, 1 - h**2)  # d out / d z0
    ones = jnp.ones((N, 1), F64)
    a0 = jnp.concatenate([x, ones], axis=1)
    a1 = jnp.concatenate([h, ones], axis=1)
    return {
        "layers[0]": (
            a0.T @ a0 / N,
            jnp.einsum("noh,nop,npk->hk", jac0, hess, jac0) / N,
        ),
        "layers[1]": (a1.T @ a1 / N, jnp.mean(hess, axis=0)),
    }


@pytest.mark.parametrize(
    "loss, estimator",
    [(loss, "ggn") for loss in LOSSES] + [("softmax_ce", "empirical_fisher")],
)
def test_kfac_factors_by_hand(loss, estimator):
    est, kind = ESTIMATORS[estimator]
    curv = curv_for(loss, est, ef.KFAC())
    factors = hand_factors(mlp(), batch_for(loss), loss, kind)
    for name, (a, g) in factors.items():
        block = curv.blocks[name]
        assert_close(block.a, a)
        assert_close(block.g, g)
        assert_close(block.as_matrix(), np.kron(g, a)[_vec_order(name)])


@pytest.mark.parametrize("n", [3, 40], ids=["few-rows", "many-rows"])
def test_input_factor_with_bias_from_few_rows_and_from_many(n):
    """A = mean ã ãᵀ, ã = [a; 1], is formed one way from few rows (the rows
    joined with a column of ones: 3 rows of 3 and of 6 inputs) and another from
    many (Σ a aᵀ joined with its bias row and column: 40 rows): both equal the
    dense float64 reference, and so do G and the block."""
    model = eqx.nn.MLP(3, 4, 6, 1, activation=jnp.tanh, dtype=F64, key=jr.key(21))
    kx, ky = jr.split(jr.key(22))
    x, y = jr.normal(kx, (n, 3), F64), jr.randint(ky, (n,), 0, 4)
    few = [n <= JOIN_ROWS_PER_COLUMN * (d + 1) for d in (3, 6)]
    assert few == [n == 3] * 2
    curv = ef.curvature(
        lambda m, b: ef.softmax_cross_entropy(jax.vmap(m)(b[0]), b[1]),
        model,
        (x, y),
        estimator=ef.GGN(),
        structure=ef.KFAC(),
    )
    for k in (0, 1):
        a, g = kfac_reference.kfac_factors(model, x, y, k)
        block = curv.blocks[f"layers[{k}]"]
        np.testing.assert_allclose(block.a, a, **TOL)
        np.testing.assert_allclose(block.g, g, **TOL)
        np.testing.assert_allclose(
            block.as_matrix(), kfac_reference.kronecker_dense(a, g), **TOL
        )


class _KindWithoutStatistics(AbstractLayerKind):
    name = "dense"
    takes_bias = True
    tieable = True
    elementwise = False


def test_a_layer_kind_without_input_statistics_is_refused_by_name():
    """A layer kind with no registered input statistics is a `TypeError` that
    names the kind and the registration that fixes it."""
    with pytest.raises(
        TypeError,
        match=r"`layer_inputs\(kind\)`.*`_KindWithoutStatistics`.*"
        r"layer_inputs\.register\(_KindWithoutStatistics\)",
    ):
        layer_inputs(_KindWithoutStatistics())


def _vec_order(name: str):
    """`np.ix_` reordering a vec([W | b]) (row-major) matrix into ravel(W), b order."""
    d_out, d_in = (HIDDEN, IN) if name == "layers[0]" else (OUT, HIDDEN)
    cols = d_in + 1
    order = [k * cols + j for k in range(d_out) for j in range(d_in)]
    order += [k * cols + d_in for k in range(d_out)]
    return np.ix_(order, order)


@pytest.mark.parametrize("loss", list(LOSSES))
def test_ekfac_scales_are_the_diagonal_in_the_kfac_eigenbasis(loss):
    ekfac = curv_for(loss, ef.GGN(), ef.EKFAC())
    kfac = curv_for(loss, ef.GGN(), ef.KFAC())
    ggn = reference(loss, "ggn")
    slices = block_slices(mlp())
    for name, leaves in zip(["layers[0]", "layers[1]"], MLP_LAYERS, strict=True):
        block = ekfac.blocks[name]
        q_a, q_g = np.asarray(block.q_a), np.asarray(block.q_g)
        # The eigenbases are K-FAC's.
        a, g = np.asarray(kfac.blocks[name].a), np.asarray(kfac.blocks[name].g)
        for q, m in [(q_a, a), (q_g, g)]:
            assert_close(q.T @ q, np.eye(len(q)))
            rotated = q.T @ m @ q
            assert_close(rotated, np.diag(np.diag(rotated)))
        # The scales: diag(Qᵀ B Q), B the GGN's layer block in vec([W | b]) order.
        idx = np.concatenate([np.arange(ggn.shape[0])[slices[i]] for i in leaves])
        b_ravel = ggn[np.ix_(idx, idx)]
        b_vec = np.zeros_like(b_ravel)
        b_vec[_vec_order(name)] = b_ravel
        q = np.kron(q_g, q_a)
        expected = np.diag(q.T @ b_vec @ q).reshape(block.scales.shape)
        assert_close(block.scales, expected)
        # EKFAC's diagonal in its basis is exact, so its trace is the GGN block's.
        assert_close(block.trace(), np.trace(b_ravel))


# --- Solve, logdet, trace, for every structure ----------------------------------


@eqx.filter_jit
def _operations(curv, v, damping):
    damped = jax.tree_util.tree_map(lambda a, b: a + damping * b, curv.mv(v), v)
    return (
        curv.as_matrix(),
        curv.mv(v),
        curv.solve(damped, damping),
        curv.logdet(damping),
        curv.trace(),
    )


@pytest.mark.parametrize("structure", list(ALL_STRUCTURES))
def test_solve_logdet_trace(structure):
    curv = curv_for("softmax_ce", ef.GGN(), ALL_STRUCTURES[structure])
    v = random_like(mlp(), 5)
    matrix, mv, solved, logdet, trace = _operations(curv, v, DAMPING)
    matrix = np.asarray(matrix)
    flat_v, _ = jax.flatten_util.ravel_pytree(v)
    assert_close(jax.flatten_util.ravel_pytree(mv)[0], matrix @ np.asarray(flat_v))
    assert tree_allclose(solved, v)
    sign, expected = np.linalg.slogdet(matrix + DAMPING * np.eye(len(matrix)))
    assert sign == 1
    assert_close(logdet, expected)
    assert_close(trace, np.trace(matrix))
    assert_close(matrix, matrix.T)
    assert np.linalg.eigvalsh(matrix).min() > -1e-12


@pytest.mark.parametrize("structure", ["dense", "kfac"])
def test_lineax_cg_matches_solve(structure):
    curv = curv_for("softmax_ce", ef.GGN(), ALL_STRUCTURES[structure])
    g = random_like(mlp(), 7)

    @eqx.filter_jit
    def both(curv, g):
        identity = lx.IdentityLinearOperator(curv.in_structure())
        op = lx.TaggedLinearOperator(
            curv + DAMPING * identity, lx.positive_semidefinite_tag
        )
        cg = lx.linear_solve(op, g, lx.CG(rtol=1e-12, atol=1e-12, max_steps=500))
        return cg.value, curv.solve(g, DAMPING)

    cg, direct = both(curv, g)
    assert tree_allclose(cg, direct, rtol=1e-8, atol=1e-10)
    assert lx.is_symmetric(curv) and lx.is_positive_semidefinite(curv)


@pytest.mark.parametrize("structure", ["diagonal", "dense", "kfac"])
def test_lineax_tags_a_curvature_diagonal_where_every_block_is(structure):
    curv = curv_for("softmax_ce", ef.GGN(), ALL_STRUCTURES[structure])
    diagonal = structure == "diagonal"
    assert lx.is_diagonal(curv) == diagonal
    matrix = np.asarray(curv.as_matrix())
    assert np.array_equal(matrix, np.diag(np.diag(matrix))) == diagonal
    if diagonal:  # lineax's diagonal solver takes it (refused before)
        g = random_like(mlp(), 7)
        by_lineax = lx.linear_solve(curv, g, lx.Diagonal()).value
        expected = jax.tree.map(lambda v, d: v / d, g, curv.diagonal())
        assert tree_allclose(by_lineax, expected)


# --- `where` ----------------------------------------------------------------------


@pytest.mark.parametrize("structure", ["dense", "kfac"])
def test_where_restricts_to_selected_leaves(structure):
    where = ef.filters.by_path("layers[1].*")
    curv = curv_for("softmax_ce", ef.GGN(), ALL_STRUCTURES[structure], where=where)
    full = curv_for("softmax_ce", ef.GGN(), ALL_STRUCTURES[structure])
    slices = block_slices(mlp())
    idx = np.concatenate([np.arange(slices[-1].stop)[slices[i]] for i in (2, 3)])
    expected = np.asarray(full.as_matrix())[np.ix_(idx, idx)]
    assert_close(curv.as_matrix(), expected)
    if structure == "dense":
        assert_close(expected, reference("softmax_ce", "ggn")[np.ix_(idx, idx)])
    structure_tree = curv.in_structure()
    assert structure_tree.layers[0].weight is None
    assert structure_tree.layers[0].bias is None
    assert structure_tree.layers[1].weight.shape == (OUT, HIDDEN)
    assert structure_tree.layers[1].bias.shape == (OUT,)
    v = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[0].bias),
        random_like(mlp(), 2),
        (None, None),
    )
    out = curv.mv(v)
    assert out.layers[0].weight is None
    flat_v = np.concatenate([np.ravel(v.layers[1].weight), np.ravel(v.layers[1].bias)])
    flat_out = np.concatenate(
        [np.ravel(out.layers[1].weight), np.ravel(out.layers[1].bias)]
    )
    assert_close(flat_out, expected @ flat_v)


# --- Monte-Carlo Fisher ----------------------------------------------------------


def test_fisher_mc_converges_to_exact_fisher():
    samples = 2000
    loss = "softmax_ce"
    model, (x, _) = mlp(), batch_for(loss)
    mc = curv_for(loss, ef.FisherMC(samples=samples), ef.Dense(), key=jr.key(42))
    fisher = reference(loss, "ggn")
    # One sample's matrix is X = (1/N) Σₙ Jₙᵀ rₙ rₙᵀ Jₙ, rₙ = p − e_c with c ~ p;
    # E‖X − F‖² = Σₙ (1/N²) E_c ‖Jₙᵀ (r rᵀ − Hₙ) Jₙ‖², by enumerating the classes.
    variance = 0.0
    jacs = np.asarray(jacobian(model, x))
    probs = np.asarray(jax.nn.softmax(jax.vmap(model)(x)))
    for jac, p in zip(jacs, probs, strict=True):
        hess = np.diag(p) - np.outer(p, p)
        for c in range(OUT):
            r = p - np.eye(OUT)[c]
            dev = jac.T @ (np.outer(r, r) - hess) @ jac
            variance += p[c] * np.sum(dev**2) / N**2
    expected_error = np.sqrt(variance / samples)
    error = np.linalg.norm(np.asarray(mc.as_matrix()) - fisher)
    assert error < 4 * expected_error
    assert error / np.linalg.norm(fisher) < 0.1
    # Not exact either: the estimate does carry Monte-Carlo noise.
    assert error > 1e-3 * expected_error


def test_kfac_g_of_a_layer_whose_outputs_mix_positions():
    # A `Linear` applied at T positions, then a causal cumulative sum (as in a
    # recurrence): GGN()'s output vectors cover every position at once, so G holds
    # the products between positions (Σₜ (T − t)² / T = 7.5 per output), while
    # FisherMC samples each position independently (Σₜ (T − t) / T = 2.5).
    # docs/estimators.md, "How they relate".
    lin = eqx.nn.Linear(3, 2, use_bias=False, key=jr.key(0))
    n, t = 4, 4
    x, y = jr.normal(jr.key(1), (n, t, 3)), jr.normal(jr.key(2), (n, t, 2))

    def loss_fn(model, batch):
        x, y = batch
        return ef.squared_error(jnp.cumsum(jax.vmap(jax.vmap(model))(x), axis=1), y)

    def g(estimator, key=None):
        curv = ef.curvature(
            loss_fn, lin, (x, y), estimator=estimator, structure=ef.KFAC(), key=key
        )
        (block,) = curv.blocks.values()
        return np.asarray(block.g)

    np.testing.assert_allclose(g(ef.GGN()), 7.5 * np.eye(2), rtol=1e-12)
    mc = g(ef.FisherMC(samples=4000), jr.key(3))
    np.testing.assert_allclose(mc, 2.5 * np.eye(2), atol=0.15)


def test_kfac_input_factor_counts_masked_examples():
    # docs/losses.md, "Masks": G is weighted by the mask, A averages every example.
    lin = eqx.nn.Linear(3, 2, key=jr.key(0))
    x = jnp.array([[1.0, 2.0, -1.0], [0.5, 0.0, 3.0]])
    t, mask = jnp.zeros((2, 2)), jnp.array([1.0, 0.0])

    def loss_fn(model, batch):
        x, t, mask = batch
        return ef.squared_error(jax.vmap(model)(x), t, mask=mask)

    def block(batch):
        curv = ef.curvature(
            loss_fn, lin, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        (b,) = curv.blocks.values()
        return b

    padded, alone = block((x, t, mask)), block((x[:1], t[:1], mask[:1]))
    rows = np.concatenate([np.asarray(x), np.ones((2, 1))], axis=1)
    np.testing.assert_allclose(padded.a, rows.T @ rows / 2, rtol=1e-12)
    np.testing.assert_allclose(padded.g, alone.g, rtol=1e-12)


def test_fisher_mc_depends_on_the_key():
    mats = [
        np.asarray(
            curv_for("softmax_ce", ef.FisherMC(), ef.KFAC(), key=jr.key(k)).as_matrix()
        )
        for k in (0, 1, 2, 0)
    ]
    for i in range(3):
        for j in range(i):
            assert np.abs(mats[i] - mats[j]).max() > 1e-6
    np.testing.assert_array_equal(mats[0], mats[3])


# --- Errors ------------------------------------------------------------------------


def test_fisher_mc_without_key_raises():
    model, batch = mlp(), batch_for("softmax_ce")
    with pytest.raises(ValueError, match="needs `key=`"):
        ef.curvature(
            LOSS_FNS["softmax_ce"],
            model,
            batch,
            estimator=ef.FisherMC(),
            structure=ef.KFAC(),
        )
    fn = ef.value_grad_and_curvature(
        LOSS_FNS["softmax_ce"], estimator=ef.FisherMC(), structure=ef.KFAC()
    )
    with pytest.raises(ValueError, match="needs `key=`"):
        fn(model, batch)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"estimator": ef.KFAC(), "structure": ef.KFAC()}, "estimator"),
        ({"estimator": "ggn", "structure": ef.KFAC()}, "estimator"),
        ({"estimator": ef.GGN(), "structure": ef.GGN()}, "structure"),
        ({"estimator": ef.GGN(), "structure": "kfac"}, "structure"),
    ],
)
def test_wrong_estimator_or_structure_type_raises(kwargs, match):
    model, batch = mlp(), batch_for("softmax_ce")
    with pytest.raises(TypeError, match=match):
        ef.curvature(LOSS_FNS["softmax_ce"], model, batch, **kwargs)


def test_fisher_mc_rejects_bad_samples():
    with pytest.raises(ValueError, match="samples"):
        ef.FisherMC(samples=0)


# --- EMA ---------------------------------------------------------------------------


@pytest.mark.parametrize("structure", list(ALL_STRUCTURES))
def test_ema(structure):
    decay = 0.7
    old = curv_for("squared_error", ef.GGN(), ALL_STRUCTURES[structure], seed=1)
    new = curv_for("squared_error", ef.GGN(), ALL_STRUCTURES[structure], seed=2)
    avg = old.ema(new, decay)
    assert list(avg.blocks) == list(old.blocks)
    m_old, m_new = np.asarray(old.as_matrix()), np.asarray(new.as_matrix())
    assert np.abs(m_old - m_new).max() > 1e-3
    if structure in EXACT_STRUCTURES:
        assert_close(avg.as_matrix(), decay * m_old + (1 - decay) * m_new)
    for name, block in avg.blocks.items():
        b_old, b_new = old.blocks[name], new.blocks[name]
        if structure == "kfac":
            assert_close(block.a, decay * b_old.a + (1 - decay) * b_new.a)
            assert_close(block.g, decay * b_old.g + (1 - decay) * b_new.g)
        elif structure == "ekfac":
            expected = decay * b_old.scales + (1 - decay) * b_new.scales
            assert_close(block.scales, expected)
            assert_close(block.q_a, b_new.q_a)
            assert_close(block.q_g, b_new.q_g)


def test_ema_of_different_structures_raises():
    dense = curv_for("squared_error", ef.GGN(), ef.Dense())
    diag = curv_for("squared_error", ef.GGN(), ef.Diagonal())
    kfac = curv_for("squared_error", ef.GGN(), ef.KFAC())
    with pytest.raises(ValueError, match="other"):
        dense.ema(diag, 0.5)
    with pytest.raises(TypeError, match="KroneckerFactored"):
        kfac.ema(diag, 0.5)


# --- value_grad_and_curvature -------------------------------------------------------


def _aux_loss(model, batch):
    x, y = batch
    out = jax.vmap(model)(x)
    return ef.softmax_cross_entropy(out, y), {"mean_logit": jnp.mean(out)}


def _surrogate_loss(model, batch):
    loss = LOSS_FNS["softmax_ce"](model, batch)
    return loss, 2 * loss


@pytest.mark.parametrize("loss", list(LOSSES))
def test_value_grad_and_curvature(loss):
    model, batch = mlp(), batch_for(loss)
    loss_fn = LOSS_FNS[loss]
    fn = eqx.filter_jit(
        ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=ef.KFAC())
    )
    value, grads, curv = fn(model, batch)
    x, y = batch
    assert_close(value, mean_loss(loss, jax.vmap(model)(x), y))
    assert tree_allclose(grads, eqx.filter_grad(loss_fn)(model, batch))
    expected = curv_for(loss, ef.GGN(), ef.KFAC())
    assert_close(curv.as_matrix(), expected.as_matrix())


def test_value_grad_and_curvature_has_aux():
    model, batch = mlp(), batch_for("softmax_ce")
    fn = eqx.filter_jit(
        ef.value_grad_and_curvature(
            _aux_loss, estimator=ef.GGN(), structure=ef.KFAC(), has_aux=True
        )
    )
    (value, aux), grads, curv = fn(model, batch)
    expected_value, expected_aux = _aux_loss(model, batch)
    assert_close(value, expected_value)
    assert set(aux) == {"mean_logit"}
    assert_close(aux["mean_logit"], expected_aux["mean_logit"])
    expected_grads = eqx.filter_grad(lambda m, b: _aux_loss(m, b)[0])(model, batch)
    assert tree_allclose(grads, expected_grads)
    expected = curv_for("softmax_ce", ef.GGN(), ef.KFAC())
    assert_close(curv.as_matrix(), expected.as_matrix())


def test_value_grad_and_curvature_surrogate():
    model, batch = mlp(), batch_for("softmax_ce")
    fn = eqx.filter_jit(
        ef.value_grad_and_curvature(
            _surrogate_loss, estimator=ef.GGN(), structure=ef.KFAC(), surrogate=True
        )
    )
    value, grads, curv = fn(model, batch)
    loss_fn = LOSS_FNS["softmax_ce"]
    assert_close(value, loss_fn(model, batch))
    doubled = jax.tree_util.tree_map(
        lambda g: 2 * g, eqx.filter_grad(loss_fn)(model, batch)
    )
    assert tree_allclose(grads, doubled)
    expected = curv_for("softmax_ce", ef.GGN(), ef.KFAC())
    assert_close(curv.as_matrix(), expected.as_matrix())


def test_value_grad_and_curvature_fisher_mc_uses_the_key():
    model, batch = mlp(), batch_for("softmax_ce")
    est = ef.FisherMC()
    fn = eqx.filter_jit(
        ef.value_grad_and_curvature(
            LOSS_FNS["softmax_ce"], estimator=est, structure=ef.KFAC()
        )
    )
    key = jr.key(11)
    _, _, curv = fn(model, batch, key=key)
    expected = curv_for("softmax_ce", est, ef.KFAC(), key=key)
    assert_close(curv.as_matrix(), expected.as_matrix())
    _, _, other = fn(model, batch, key=jr.key(12))
    assert np.abs(np.asarray(other.as_matrix() - curv.as_matrix())).max() > 1e-6


def test_value_grad_and_curvature_rejects_aux_and_surrogate():
    with pytest.raises(ValueError, match="has_aux"):
        ef.value_grad_and_curvature(
            _aux_loss,
            estimator=ef.GGN(),
            structure=ef.KFAC(),
            has_aux=True,
            surrogate=True,
        )


# --- A parameter in no layer ---------------------------------------------------------


class Temperature(eqx.Module):
    linear: eqx.nn.Linear
    temperature: jax.Array

    def __init__(self, key):
        self.linear = eqx.nn.Linear(IN, OUT, dtype=F64, key=key)
        self.temperature = jnp.array(1.5, F64)

    def __call__(self, x):
        return self.linear(x) * self.temperature


def test_unmatched_scalar_gets_exact_diagonal_block():
    model = Temperature(jr.key(0))
    batch = batch_for("softmax_ce")
    curv = _curvature(LOSS_FNS["softmax_ce"], model, batch, ef.GGN(), ef.KFAC())
    block = curv.blocks["temperature"]
    assert isinstance(block, ef.blocks.DiagonalBlock)
    assert isinstance(curv.blocks["linear"], ef.blocks.KroneckerFactored)
    ggn = np.asarray(ggn_of(model, batch, "softmax_ce"))
    t = block_slices(model)[2].start
    assert ggn[t, t] > 1e-3
    matrix = np.asarray(curv.as_matrix())
    assert_close(matrix[t, t], ggn[t, t])
    row = np.delete(matrix[t], t)
    assert_close(row, 0)
    assert_close(curv.diagonal().temperature, ggn[t, t])


class _WithEmpty(eqx.Module):
    linear: eqx.nn.Linear
    extra: jax.Array  # a parameter of size 0 (an optional part switched off)

    def __call__(self, x):
        return self.linear(x) + jnp.sum(self.extra)


@pytest.mark.parametrize(
    "structure",
    [ef.Dense(), ef.BlockDiagonal(), ef.Diagonal(), ef.KFAC(), ef.EKFAC()],
    ids=repr,
)
def test_a_parameter_of_size_zero_has_an_empty_block(structure):
    """The per-example pass reshaped with `-1`, which a size-0 leaf cannot infer:
    `ZeroDivisionError` from inside JAX for every structure."""
    model = _WithEmpty(
        eqx.nn.Linear(4, 3, dtype=jnp.float64, key=jr.key(1)), jnp.zeros((0,))
    )
    x, y = jr.normal(jr.key(2), (6, 4)), jnp.arange(6) % 3

    def loss(model, batch):
        x, y = batch
        return ef.softmax_cross_entropy(jax.vmap(model)(x), y)

    curv = ef.curvature(loss, model, (x, y), estimator=ef.GGN(), structure=structure)
    if isinstance(structure, ef.Dense):  # one block over both leaves
        layer = curv.as_matrix()
    else:
        assert curv.blocks["extra"].as_matrix().shape == (0, 0)
        layer = curv.blocks["linear"].as_matrix()
    if isinstance(structure, ef.KFAC | ef.EKFAC):  # as without the empty leaf
        alone = ef.curvature(
            loss, model.linear, (x, y), estimator=ef.GGN(), structure=structure
        )
        np.testing.assert_allclose(layer, alone.as_matrix(), rtol=1e-14, atol=1e-16)
    else:  # 15 × 15, the linear layer's, built without eqfisher
        reference = dense_ggn_cross_entropy(model, x, y)
        if isinstance(structure, ef.Diagonal):
            reference = np.diag(np.diag(reference))
        np.testing.assert_allclose(layer, reference, rtol=1e-12, atol=1e-15)
    grads = eqx.filter_grad(loss)(model, (x, y))
    assert curv.solve(grads, 1e-3).extra.shape == (0,)
