import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from eqfisher.blocks import (
    DiagonalBlock,
    EigenKroneckerFactored,
    Full,
    KroneckerFactored,
    ekfac_from_kronecker,
)


# name: (weight shape, weight_perm, bias shape or None, d_out)
LAYOUTS = {
    "linear": ((3, 4), (0, 1), (3,), 3),
    "transposed": ((4, 3), (1, 0), None, 3),
    "conv": ((2, 3, 2, 2), (0, 1, 2, 3), (2, 1, 1), 2),
    "two_out_axes": ((5, 2, 3), (1, 2, 0), (2, 3), 6),
}
KINDS = ["full", "diagonal", "kfac", "ekfac"]


def structure_of(layout, dtype=np.float64):
    w, _, b, _ = LAYOUTS[layout]
    shapes = (w,) if b is None else (w, b)
    return tuple(jax.ShapeDtypeStruct(s, dtype) for s in shapes)


def view_matrix(layout):
    """The permutation matrix from ravelled operand coordinates to vec(M), by loops."""
    w, perm, b, d_out = LAYOUTS[layout]
    d_w = int(np.prod(w))
    d_in = d_w // d_out
    cols = d_in + (b is not None)
    view = np.zeros((d_out * cols, d_w + (0 if b is None else d_out)))
    permuted = tuple(w[p] for p in perm)
    for flat, idx in enumerate(np.ndindex(*w)):
        pos = np.ravel_multi_index(tuple(idx[p] for p in perm), permuted)
        view[(pos // d_in) * cols + pos % d_in, flat] = 1
    for k in range(0 if b is None else d_out):
        view[k * cols + d_in, d_w + k] = 1
    return view


def spd(rng, n, dtype=np.float64):
    x = rng.standard_normal((n, 2 * n))
    return (x @ x.T / (2 * n) + 0.1 * np.eye(n)).astype(dtype)


def orthogonal(rng, n):
    return np.linalg.qr(rng.standard_normal((n, n)))[0]


def make(kind, layout, seed=0, dtype=np.float64):
    """A block and its dense matrix, built without eqfisher."""
    rng = np.random.default_rng(seed)
    structure = structure_of(layout, dtype)
    w, perm, b, d_out = LAYOUTS[layout]
    size = sum(int(np.prod(s.shape)) for s in structure)
    d_in = int(np.prod(w)) // d_out + (b is not None)
    view = view_matrix(layout)
    if kind == "full":
        dense = spd(rng, size, dtype)
        return Full(jnp.asarray(dense), structure), dense
    if kind == "diagonal":
        diag = rng.uniform(0.1, 2.0, size).astype(dtype)
        leaves = ravel_pytree(tuple(jnp.zeros(s.shape, dtype) for s in structure))[1]
        return DiagonalBlock(leaves(jnp.asarray(diag))), np.diag(diag)
    layout_kw = dict(weight_perm=perm, structure=structure)
    if kind == "kfac":
        a, g = spd(rng, d_in, dtype), spd(rng, d_out, dtype)
        block = KroneckerFactored(jnp.asarray(a), jnp.asarray(g), **layout_kw)
        return block, view.T @ np.kron(g, a) @ view
    q_a, q_g = orthogonal(rng, d_in), orthogonal(rng, d_out)
    scales = rng.uniform(0.0, 2.0, (d_out, d_in))
    basis = np.kron(q_g, q_a)
    dense = view.T @ basis @ np.diag(scales.ravel()) @ basis.T @ view
    arrays = [jnp.asarray(x.astype(dtype)) for x in (q_a, q_g, scales)]
    return EigenKroneckerFactored(*arrays, **layout_kw), dense.astype(dtype)


def random_operand(block, seed=1):
    rng = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(rng.standard_normal(s.shape).astype(s.dtype))
        for s in block.in_structure()
    )


def flat(v):
    return np.asarray(ravel_pytree(v)[0])


cases = pytest.mark.parametrize(
    "kind,layout", [(k, lay) for k in KINDS for lay in LAYOUTS]
)


@cases
def test_dense_views(kind, layout):
    block, dense = make(kind, layout)
    assert np.allclose(block.as_matrix(), dense, atol=1e-12)
    v = random_operand(block)
    assert np.allclose(flat(block.mv(v)), dense @ flat(v), atol=1e-12)
    unravel = ravel_pytree(v)[1]
    columns = [flat(block.mv(unravel(e))) for e in jnp.eye(dense.shape[0])]
    assert np.allclose(np.stack(columns, axis=1), dense, atol=1e-12)
    assert block.transpose() is block and block.T is block
    assert block.in_structure() == block.out_structure() == structure_of(layout)
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(block))


def test_kronecker_is_kron_for_linear():
    rng = np.random.default_rng(3)
    a, g = spd(rng, 5), spd(rng, 3)
    linear = structure_of("linear")
    block = KroneckerFactored(a=a, g=g, weight_perm=(0, 1), structure=linear)
    dense = np.asarray(block.as_matrix())
    assert np.allclose(dense[:12, :12], np.kron(g, a[:4, :4]))
    assert np.allclose(dense[:12, 12:], np.kron(g, a[:4, 4:]))
    assert np.allclose(dense[12:, 12:], g * a[4, 4])
    weight_only = KroneckerFactored(
        a[:4, :4], g, weight_perm=(0, 1), structure=linear[:1]
    )
    assert np.allclose(weight_only.as_matrix(), np.kron(g, a[:4, :4]))


@cases
@pytest.mark.parametrize("damping", [1e-3, 0.5])
def test_solve_and_spectrum(kind, layout, damping):
    block, dense = make(kind, layout)
    v = random_operand(block)
    eye = np.eye(dense.shape[0])
    back = block.solve(
        tuple(m + damping * x for m, x in zip(block.mv(v), v, strict=True)), damping
    )
    assert np.allclose(flat(back), flat(v), atol=1e-9)
    expected = np.linalg.solve(dense + damping * eye, flat(v))
    assert np.allclose(flat(block.solve(v, damping)), expected, atol=1e-9)
    sign, logdet = np.linalg.slogdet(dense + damping * eye)
    assert sign == 1 and np.isclose(block.logdet(damping), logdet, rtol=1e-10)
    assert np.isclose(block.trace(), np.trace(dense), rtol=1e-10)
    eigenvalues = np.sort(np.asarray(block.eigenvalues()))
    assert np.allclose(eigenvalues, np.linalg.eigvalsh(dense), atol=1e-10)
    assert np.allclose(flat(block.diagonal()), np.diag(dense), atol=1e-12)
    assert np.allclose(lx.diagonal(block), np.diag(dense), atol=1e-12)


@cases
def test_ema_and_scale(kind, layout):
    old, dense_old = make(kind, layout, seed=0)
    new, dense_new = make(kind, layout, seed=5)
    if kind == "ekfac":  # EKFAC averages scales in the newer basis
        old = eqx.tree_at(lambda b: (b.q_a, b.q_g), old, (new.q_a, new.q_g))
        basis = view_matrix(layout).T @ np.kron(new.q_g, new.q_a)
        dense_old = basis @ np.diag(np.ravel(old.scales)) @ basis.T
    mixed = old.ema(new, 0.9)
    assert type(mixed) is type(old)
    if kind == "kfac":  # each factor is averaged, not the Kronecker product
        a, g = 0.9 * old.a + 0.1 * new.a, 0.9 * old.g + 0.1 * new.g
        view = view_matrix(layout)
        expected = view.T @ np.kron(g, a) @ view
    else:
        expected = 0.9 * dense_old + 0.1 * dense_new
    assert np.allclose(mixed.as_matrix(), expected, atol=1e-12)
    assert np.allclose(old.scale(2.5).as_matrix(), 2.5 * dense_old, atol=1e-12)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kronecker_factored_damping_and_precompute(layout):
    block, _ = make("kfac", layout)
    v = random_operand(block)
    lam = 0.3
    a, g = np.asarray(block.a), np.asarray(block.g)
    pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
    damped = np.kron(
        g + np.sqrt(lam) / pi * np.eye(len(g)), a + pi * np.sqrt(lam) * np.eye(len(a))
    )
    view = view_matrix(layout)
    expected = np.linalg.solve(view.T @ damped @ view, flat(v))
    assert np.allclose(flat(block.solve_factored(v, lam)), expected, atol=1e-10)

    cached = block.precompute()
    assert block.a_eig is None and cached.a_eig is not None
    assert np.allclose(flat(cached.solve(v, lam)), flat(block.solve(v, lam)))
    assert np.isclose(cached.logdet(lam), block.logdet(lam))
    assert np.allclose(
        flat(cached.scale(3.0).solve(v, lam)), flat(block.scale(3.0).solve(v, lam))
    )


@pytest.mark.parametrize("factors", ["repeated", "generic", "diagonal"])
def test_kronecker_solve_derivatives_where_eigenvalues_repeat(factors):
    # jnp.linalg.eigh's derivative is NaN at a repeated eigenvalue (two always-zero
    # inputs give A two zero eigenvalues), though (G⊗A + λI)⁻¹ v is smooth there.
    rng = np.random.default_rng(0)
    layout = "linear"
    w, perm, _, d_out = LAYOUTS[layout]
    g = spd(rng, d_out)
    a, other = {
        "repeated": (np.diag([1.0, 1.0, 2.0, 0.0, 0.0]), np.diag([2.0, 2, 1, 0, 0])),
        "generic": (spd(rng, w[1] + 1), spd(rng, w[1] + 1)),
        "diagonal": (np.array([1.0, 1.0, 2.0, 0.5, 0.5]), np.array([2.0, 2, 1, 1, 1])),
    }[factors]
    st = structure_of(layout)
    v = tuple(jnp.asarray(rng.standard_normal(x.shape)) for x in st)
    view = view_matrix(layout)

    def block(a):
        return KroneckerFactored(
            jnp.asarray(a), jnp.asarray(g), weight_perm=perm, structure=st
        )

    def ours(s, decay, damping):
        mixed = block(s * a).ema(block(other), decay)
        return sum(jnp.sum(x) for x in mixed.solve(v, damping))

    def reference(s, decay, damping):
        dense = np.diag if a.ndim == 1 else np.asarray
        mixed_a = decay * s * dense(a) + (1 - decay) * dense(other)
        m = view.T @ jnp.kron(g, mixed_a) @ view
        return jnp.sum(jnp.linalg.solve(m + damping * jnp.eye(len(m)), flat(v)))

    args = (1.0, 0.7, 0.1)
    got = jax.grad(ours, argnums=(0, 1, 2))(*args)
    expected = jax.grad(reference, argnums=(0, 1, 2))(*args)
    np.testing.assert_allclose(got, expected, rtol=1e-10)
    np.testing.assert_allclose(ours(*args), reference(*args), rtol=1e-12)


def _calls_lapack(fn, *args) -> bool:
    """Whether the compiled `fn` calls a LAPACK factorisation (XLA:CPU)."""
    return "lapack" in jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_full_precompute(layout):
    """A `Full` block carrying its eigendecomposition solves and takes
    log-determinants for any damping without a new factorisation, equal to the
    dense references, and differentiable in the damping."""
    block, dense = make("full", layout)
    cached = block.precompute()
    assert block.eig is None and cached.eig is not None
    v = random_operand(block)
    eye = np.eye(dense.shape[0])
    for lam in (1e-3, 0.3, 4.0):
        expected = np.linalg.solve(dense + lam * eye, flat(v))
        assert np.allclose(flat(cached.solve(v, lam)), expected, atol=1e-10)
        logdet = np.linalg.slogdet(dense + lam * eye)[1]
        assert np.isclose(cached.logdet(lam), logdet, rtol=1e-12)
    assert np.allclose(cached.eigenvalues(), np.linalg.eigvalsh(dense), atol=1e-12)
    # d/dλ log det(B + λI) = tr (B + λI)⁻¹, and d/dλ (B + λI)⁻¹ v = -(B + λI)⁻² v.
    lam = 0.3
    inverse = np.linalg.inv(dense + lam * eye)
    grad = jax.grad(cached.logdet)(lam)
    assert np.isclose(grad, np.trace(inverse), rtol=1e-10)
    tangent = jax.jvp(lambda d: cached.solve(v, d), (lam,), (1.0,))[1]
    assert np.allclose(flat(tangent), -inverse @ inverse @ flat(v), atol=1e-10)
    # Value and gradient in λ compute no factorisation once it is cached.
    summed = lambda b, d: ravel_pytree(b.solve(v, d))[0].sum()
    for fn in (lambda b, d: b.logdet(d), summed):
        assert not _calls_lapack(jax.value_and_grad(fn, argnums=1), cached, lam)
        assert _calls_lapack(jax.value_and_grad(fn, argnums=1), block, lam)
    # scale keeps the decomposition consistent; ema (new matrix) drops it.
    scaled = cached.scale(2.5)
    assert scaled.eig is not None
    assert np.isclose(scaled.logdet(lam), block.scale(2.5).logdet(lam), rtol=1e-12)
    assert cached.ema(block, 0.5).eig is None


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ekfac_from_kronecker(layout):
    kfac, _ = make("kfac", layout)
    rng = np.random.default_rng(7)
    d_out, d_in = kfac.g.shape[0], kfac.a.shape[0]
    matrices = rng.standard_normal((6, d_out, d_in))
    ekfac = ekfac_from_kronecker(kfac, jnp.asarray(matrices))
    vecs = matrices.reshape(6, -1)
    true = vecs.T @ vecs  # in vec(M) order
    _, q_a = np.linalg.eigh(kfac.a)
    _, q_g = np.linalg.eigh(kfac.g)
    basis = np.kron(q_g, q_a)
    expected = np.diag(basis.T @ true @ basis).reshape(d_out, d_in)
    assert np.allclose(ekfac.scales, expected, atol=1e-10)

    # One example: the true curvature g gᵀ ⊗ ã ãᵀ is Kronecker, and EKFAC == K-FAC.
    a_vec, g_vec = rng.standard_normal(d_in), rng.standard_normal(d_out)
    one = KroneckerFactored(
        jnp.outer(a_vec, a_vec),
        jnp.outer(g_vec, g_vec),
        weight_perm=kfac.weight_perm,
        structure=kfac.structure,
    )
    single = ekfac_from_kronecker(one, jnp.outer(g_vec, a_vec)[None])
    assert np.allclose(single.as_matrix(), one.as_matrix(), atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["linear", "two_out_axes"])
def test_lineax(kind, layout):
    block, _ = make(kind, layout)
    v = random_operand(block)
    assert lx.is_symmetric(block) and lx.is_positive_semidefinite(block)
    assert lx.is_diagonal(block) == (kind == "diagonal")
    assert lx.materialise(block) is block and lx.linearise(block) is block
    diag, lower, upper = lx.tridiagonal(block)
    assert np.allclose(diag, flat(block.diagonal())) and lower.shape == upper.shape
    # lineax cannot see the sign of `* 0.2` (an array scalar): tag the sum as PSD.
    damped = block + lx.IdentityLinearOperator(block.in_structure()) * 0.2
    damped = lx.TaggedLinearOperator(damped, lx.positive_semidefinite_tag)
    solution = lx.linear_solve(damped, v, lx.CG(rtol=1e-12, atol=1e-12)).value
    assert np.allclose(flat(solution), flat(block.solve(v, 0.2)), atol=1e-8)
    plain = lx.linear_solve(block, v, lx.CG(rtol=1e-12, atol=1e-12, max_steps=1000))
    assert np.allclose(flat(block.mv(plain.value)), flat(v), atol=1e-7)


@cases
def test_jit(kind, layout):
    block, _ = make(kind, layout)
    v = random_operand(block)

    def compute(block, v, damping):
        return block.mv(v), block.solve(v, damping), block.logdet(damping)

    run = eqx.filter_jit(compute)
    for got, want in zip(
        run(block, v, jnp.asarray(0.4)), compute(block, v, 0.4), strict=True
    ):
        assert np.allclose(flat(got), flat(want), atol=1e-12)
    with pytest.raises(RuntimeError, match="damping"):
        run(block, v, jnp.asarray(-1.0))


@pytest.mark.parametrize("kind", KINDS)
def test_float32(kind):
    block, dense = make(kind, "conv", dtype=np.float32)
    v = random_operand(block)
    for out in (block.mv(v), block.solve(v, 0.1), block.diagonal()):
        assert all(x.dtype == jnp.float32 for x in out)
    assert (
        block.as_matrix().dtype == jnp.float32
        and block.logdet(0.1).dtype == jnp.float32
    )
    assert np.allclose(flat(block.mv(v)), dense @ flat(v), rtol=1e-4, atol=1e-4)


@cases
def test_bad_arguments(kind, layout):
    block, _ = make(kind, layout)
    v = random_operand(block)
    for damping in (0.0, -1.0):
        with pytest.raises(ValueError, match="`damping`"):
            block.solve(v, damping)
        with pytest.raises(ValueError, match="`damping`"):
            block.logdet(damping)
    with pytest.raises(ValueError, match="`decay`"):
        block.ema(block, 1.5)
    with pytest.raises(ValueError, match="`vector`"):
        block.mv(v[:1] + (v[0],))


def kfac_linear(a, g, perm=(0, 1)):
    return KroneckerFactored(a, g, weight_perm=perm, structure=structure_of("linear"))


BAD_CONSTRUCTION = {
    "`a`": lambda r: kfac_linear(spd(r, 4), spd(r, 3)),
    "`g`": lambda r: kfac_linear(spd(r, 5), spd(r, 4)),
    "weight_perm": lambda r: kfac_linear(spd(r, 5), spd(r, 3), perm=(0, 0)),
    "same dtype": lambda r: kfac_linear(spd(r, 5, np.float32), spd(r, 3)),
    "`scales`": lambda r: EigenKroneckerFactored(
        orthogonal(r, 5),
        orthogonal(r, 3),
        np.ones((3, 4)),
        weight_perm=(0, 1),
        structure=structure_of("linear"),
    ),
    "`matrix`": lambda r: Full(spd(r, 14), structure_of("linear")),
    "`diag`": lambda r: DiagonalBlock((np.ones(2), np.ones(2, np.float32))),
}


@pytest.mark.parametrize("match", list(BAD_CONSTRUCTION))
def test_bad_construction(match):
    with pytest.raises(ValueError, match=match):
        BAD_CONSTRUCTION[match](np.random.default_rng(0))
    with pytest.raises(TypeError, match="`other`"):
        make("full", "linear")[0].ema(make("diagonal", "linear")[0], 0.5)


def test_full_solve_and_logdet_outside_jit_compile_once():
    # Their Cholesky-or-eigendecomposition `lax.cond` took new closures at every
    # call, which outside `jit` compiled anew each time (0.2-0.5 s a call).
    from .helpers import compiled_during

    rng = np.random.default_rng(0)
    root = rng.normal(size=(6, 6))
    structure = (jax.ShapeDtypeStruct((6,), np.float64),)
    block = Full(jnp.asarray(root @ root.T), structure)
    v = (jnp.ones(6),)
    block.solve(v, 0.1), block.logdet(0.1)  # the first calls compile
    assert compiled_during(lambda: block.solve(v, 0.2)) == []
    assert compiled_during(lambda: block.logdet(0.2)) == []
    dense = root @ root.T + 0.2 * np.eye(6)
    np.testing.assert_allclose(
        block.solve(v, 0.2)[0], np.linalg.solve(dense, np.ones(6))
    )
    np.testing.assert_allclose(block.logdet(0.2), np.linalg.slogdet(dense)[1])
    # The fallback branch: an indefinite matrix fails the Cholesky factor.
    flat = Full(jnp.asarray(-np.eye(6)), structure)
    np.testing.assert_allclose(flat.logdet(0.5), 6 * np.log(0.5))
    np.testing.assert_allclose(flat.solve(v, 0.5)[0], 2 * np.ones(6))


def test_full_solves_of_a_stack_fall_back_to_eigh_only_where_cholesky_failed():
    # `jax.vmap` of `Full.solve` (a stacked layer's blocks) selected between the
    # Cholesky and the eigendecomposition branches, computing every
    # eigendecomposition; it now computes them only when a factor failed, and
    # then takes them where it did. A block with a negative eigenvalue (float32
    # rounding, exaggerated) fails Cholesky at this damping.
    structure = structure_of("linear")
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(15, 15)))
    matrices = [
        (q * np.linspace(0.1, 3.0, 15)) @ q.T,  # positive definite
        (q * np.linspace(-1.0, 3.0, 15)) @ q.T,  # Cholesky fails at damping 0.5
    ]
    vectors = [
        tuple(jnp.asarray(rng.normal(size=s.shape)) for s in structure)
        for _ in range(2)
    ]
    for order in ([0, 1], [1, 0], [0, 0]):
        blocks = [Full(jnp.asarray(matrices[i]), structure) for i in order]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
        vs = jax.tree.map(lambda *xs: jnp.stack(xs), *[vectors[i] for i in order])
        batched = jax.jit(jax.vmap(lambda b, v: b.solve(v, 0.5)))(stacked, vs)
        for k, i in enumerate(order):
            values, basis = np.linalg.eigh(matrices[i])
            clamped = (basis * np.maximum(values, 0)) @ basis.T
            flat = np.concatenate([np.ravel(x) for x in vectors[i]])
            want = np.linalg.solve(clamped + 0.5 * np.eye(15), flat)
            got = np.concatenate([np.ravel(x[k]) for x in batched])
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
            one = blocks[k].solve(vectors[i], 0.5)
            np.testing.assert_allclose(
                np.concatenate([np.ravel(x) for x in one]), want, rtol=1e-12, atol=1e-14
            )
