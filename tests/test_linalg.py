"""eqfisher's factorisations one matrix at a time (jaxlib 0.10's batched LAPACK kernels
can deadlock the CPU thread pool: `eqfisher._compat.LAPACK_SPLITS_BATCHES`).

On every jaxlib: the looped functions equal `jax.numpy`'s (values, batches given as
leading axes or by `vmap`, forward and reverse derivatives), and with the loop turned
on, the compiled K-FAC inverses of a stacked layer and a vmapped XTrace call LAPACK on
single matrices only. `test_no_hang.py` runs the programs that hung."""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import lineax as lx
import numpy as np
import pytest

import eqfisher as ef
import eqfisher.spectral as sp
from eqfisher import _compat, _linalg

from .helpers import compiled_during


def _psd(shape, seed=0):
    x = jr.normal(jr.key(seed), (*shape, shape[-1] + 2))
    eye = jnp.broadcast_to(jnp.eye(shape[-1]), (*shape, shape[-1]))
    return x @ jnp.swapaxes(x, -1, -2) / shape[-1] + eye


OPS = {
    "cholesky": (_linalg._cholesky, lambda: (_psd((3, 2, 5)),)),
    "eigh": (_linalg._eigh, lambda: (_psd((3, 2, 5)),)),
    "eigvalsh": (_linalg._eigvalsh, lambda: (_psd((3, 2, 5)),)),
    "qr": (_linalg._qr, lambda: (jr.normal(jr.key(1), (3, 2, 6, 4)),)),
    "svd": (_linalg._svd, lambda: (jr.normal(jr.key(2), (3, 2, 6, 4)),)),
    "cho_solve": (
        _linalg._cho_solve,
        lambda: (
            jnp.linalg.cholesky(_psd((3, 2, 5))),
            jr.normal(jr.key(3), (3, 2, 5, 2)),
        ),
    ),
}


def _smooth(out):
    # A scalar of the outputs that does not depend on the sign or order conventions
    # of eigenvectors and singular vectors.
    leaves = jax.tree.leaves(out)
    return sum(jnp.sum(jnp.abs(x) ** 3) for x in leaves)


@pytest.mark.parametrize("name", OPS)
def test_looped_equals_plain(name):
    op, args = OPS[name]
    args = args()
    looped = _linalg.one_matrix_at_a_time(op)
    expected = op(*args)
    for got in (
        looped(*args),  # leading axes
        jax.vmap(looped)(*args),
        jax.vmap(jax.vmap(looped))(*args),
        jax.jit(jax.vmap(looped, in_axes=1, out_axes=1))(*args),
    ):
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12)
    tangents = tuple(jr.normal(jr.key(9), a.shape) for a in args)
    if name == "cholesky":  # a symmetric direction keeps the derivative defined
        tangents = (tangents[0] + jnp.swapaxes(tangents[0], -1, -2),)
    f = lambda *a: _smooth(looped(*a))
    g = lambda *a: _smooth(op(*a))
    np.testing.assert_allclose(
        jax.jvp(jax.vmap(f), args, tangents)[1],
        jax.jvp(jax.vmap(g), args, tangents)[1],
        rtol=1e-10,
    )
    for a, b in zip(jax.vmap(jax.grad(f))(*args), jax.vmap(jax.grad(g))(*args)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def _batched_lapack_calls(lowered_text: str) -> list[str]:
    """The LAPACK custom calls of a lowered program with an operand of rank > 2."""
    found = []
    for line in lowered_text.splitlines():
        call = re.search(r"custom_call @(\w*lapack\w*)", line)
        if call is None:
            continue
        ranks = [len(t.split("x")) - 1 for t in re.findall(r"tensor<([^>]*)>", line)]
        if max(ranks, default=0) > 2:
            found.append(f"{call.group(1)}: {line.strip()[:160]}")
    return found


def test_finds_a_batched_call():
    text = jax.jit(jnp.linalg.cholesky).lower(_psd((4, 5))).as_text()
    assert _batched_lapack_calls(text), text
    one = jax.jit(jnp.linalg.cholesky).lower(_psd((5,))).as_text()
    assert not _batched_lapack_calls(one)


class Stack(eqx.Module):
    layers: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(6, 6, key=k))(
            jr.split(k1, 3)
        )
        self.head = eqx.nn.Linear(6, 4, key=k2)

    def __call__(self, x):
        dyn, static = eqx.partition(self.layers, eqx.is_array)
        x, _ = jax.lax.scan(
            lambda h, d: (jnp.tanh(eqx.combine(d, static)(h)), None), x, dyn
        )
        return self.head(x)


def _loss(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


@pytest.fixture
def looped(monkeypatch):
    monkeypatch.setattr(_compat, "LAPACK_SPLITS_BATCHES", True)
    jax.clear_caches()  # the flag is read when a program is traced
    yield
    jax.clear_caches()


# FactoredTikhonov's refresh in XLA, as off the CPU (on the CPU it runs on the host
# by default: tests/test_host_inverses.py).
@pytest.mark.parametrize(
    "variant", [ef.optim.FactoredTikhonov(on_host=False), ef.optim.Tikhonov()]
)
def test_kfac_inverses_of_a_stacked_layer_call_lapack_unbatched(looped, variant):
    model = Stack(jr.key(0))
    batch = (jr.normal(jr.key(1), (8, 6)), jr.randint(jr.key(2), (8,), 0, 4))
    curv = ef.curvature(_loss, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    assert curv.runs, "the scanned layer's blocks are stored stacked"
    params = eqx.filter(model, eqx.is_inexact_array)
    opt = ef.optim.kfac(1e-1, like=curv, damping_variant=variant)
    grads = eqx.filter_grad(_loss)(model, batch)

    def step(grads, state, params, curv):
        return opt.update(grads, state, params, curvature=curv)

    state = opt.init(params)
    text = eqx.filter_jit(step).lower(grads, state, params, curv).as_text()
    assert "lapack" in text
    assert not _batched_lapack_calls(text)
    # and the loop computes what the batched kernels compute
    with_loop = eqx.filter_jit(step)(grads, state, params, curv)[0]
    _compat.LAPACK_SPLITS_BATCHES = False
    jax.clear_caches()  # programs traced with the loop
    plain_text = eqx.filter_jit(step).lower(grads, state, params, curv).as_text()
    assert _batched_lapack_calls(plain_text)  # the stacked inverses, batched
    plain = eqx.filter_jit(step)(grads, state, params, curv)[0]
    for a, b in zip(jax.tree.leaves(with_loop), jax.tree.leaves(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_an_eager_vmapped_loop_compiles_once(looped):
    # `Curvature.solve` on a stacked layer vmaps its blocks' solves eagerly: a loop
    # made afresh at each call (`sequential_vmap`'s `lax.map`) compiled each time.
    model = Stack(jr.key(0))
    batch = (jr.normal(jr.key(1), (8, 6)), jr.randint(jr.key(2), (8,), 0, 4))
    curv = ef.curvature(_loss, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    grads = eqx.filter_grad(_loss)(model, batch)
    first = curv.solve(grads, 1e-3)
    assert compiled_during(lambda: curv.solve(grads, 2e-3)) == []
    dense = curv.as_matrix() + 1e-3 * jnp.eye(curv.as_matrix().shape[0])
    flat = jax.flatten_util.ravel_pytree(grads)[0]
    np.testing.assert_allclose(
        jax.flatten_util.ravel_pytree(first)[0],
        jnp.linalg.solve(dense, flat),
        rtol=1e-9,
    )
    # An argument the vmap does not batch is shared by every matrix of the loop.
    factor = jnp.linalg.cholesky(_psd((5,)))
    b = jr.normal(jr.key(3), (4, 5, 2))
    looped_solve = _linalg.one_matrix_at_a_time(_linalg._cho_solve)
    np.testing.assert_allclose(
        jax.vmap(looped_solve, in_axes=(None, 0))(factor, b),
        jax.vmap(_linalg._cho_solve, in_axes=(None, 0))(factor, b),
        rtol=1e-12,
    )


@pytest.mark.parametrize(
    "estimator", [sp.XTrace(matvecs=8), sp.HutchPlusPlus(matvecs=9)]
)
def test_vmapped_sketches_call_lapack_unbatched(looped, estimator):
    x = jr.normal(jr.key(0), (12, 12))
    op = lx.MatrixLinearOperator(x @ x.T, lx.positive_semidefinite_tag)
    keys = jr.split(jr.key(1), 5)
    fn = jax.jit(jax.vmap(lambda k: sp.trace(op, estimator, key=k)))
    text = fn.lower(keys).as_text()
    assert "lapack" in text
    assert not _batched_lapack_calls(text)
    with_loop = fn(keys)
    _compat.LAPACK_SPLITS_BATCHES = False
    jax.clear_caches()  # programs traced with the loop
    plain_fn = jax.jit(jax.vmap(lambda k: sp.trace(op, estimator, key=k)))
    assert _batched_lapack_calls(plain_fn.lower(keys).as_text())
    plain = plain_fn(keys)
    np.testing.assert_allclose(with_loop, plain, rtol=1e-10)


def test_the_flag_follows_the_jaxlib_release():
    assert _compat.release("0.10.2") == (0, 10)
    assert _compat.release("0.12.0.1") == (0, 12)
    import jaxlib

    expected = _compat.release(jaxlib.__version__)[:2] == (0, 10)
    assert _compat.LAPACK_SPLITS_BATCHES == expected


def test_fallible_cholesky_differentiates_as_cholesky_where_it_succeeds():
    x = _psd((5,)).astype(jnp.float64)
    dx = jr.normal(jr.key(3), (5, 5), jnp.float64)
    dx = dx + dx.T
    got = jax.jvp(_linalg.fallible_cholesky, (x,), (dx,))
    want = jax.jvp(jnp.linalg.cholesky, (x,), (dx,))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-10, atol=1e-12)
    # Reverse mode too (the rule's tangent map is transposed).
    g = jax.grad(lambda m: jnp.sum(jnp.sin(_linalg.fallible_cholesky(m))))(x)
    h = jax.grad(lambda m: jnp.sum(jnp.sin(jnp.linalg.cholesky(m))))(x)
    np.testing.assert_allclose(g, h, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_full_block_derivatives_in_the_damping_are_finite_where_cholesky_fails(dtype):
    # A Full block with an eigenvalue just below zero: at a damping below it the
    # Cholesky fails and `solve`/`logdet` fall back to the clamped eigenvalues.
    # Their values were finite but reverse mode gave NaN (0 x the NaN factor's
    # derivative); now both modes agree with the eigendecomposition's own path.
    q, _ = jnp.linalg.qr(jr.normal(jr.key(0), (6, 6), jnp.float64))
    values = jnp.array([-1e-5, 1e-3, 0.1, 0.5, 1.0, 2.0], jnp.float64)
    matrix = ((q * values[None, :]) @ q.T).astype(dtype)
    block = ef.blocks.Full(matrix, (jax.ShapeDtypeStruct((6,), dtype),))
    eig = block.precompute()
    v = (jnp.arange(6.0, dtype=dtype) - 2.5,)
    lam = jnp.asarray(1e-6, dtype)  # below the negative eigenvalue's size
    for b in (block, eig):
        assert jnp.isfinite(b.logdet(lam))

    def logdet(b, damping):
        return b.logdet(damping)

    def solved(b, damping):
        return jnp.sum(b.solve(v, damping)[0])

    for f in (logdet, solved):
        want = jax.grad(functools.partial(f, eig))(lam)
        got = jax.grad(functools.partial(f, block))(lam)
        assert jnp.isfinite(got), got
        np.testing.assert_allclose(got, want, rtol=1e-3)
        forward = jax.jacfwd(functools.partial(f, block))(lam)
        np.testing.assert_allclose(forward, want, rtol=1e-3)
