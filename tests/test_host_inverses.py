"""The K-FAC refresh's inverses on the host (`eqfisher._host_linalg`).

On the CPU, `blocks.kronecker.shifted_inverses` inverts every matrix factor in one
`jax.pure_callback` (SciPy's LAPACK); elsewhere, and wherever `on_host=False`, in
XLA by size class. Checked: both against dense float64 inverses written here,
their derivatives against central differences, Cholesky's fallback in float32,
half precision, non-finite factors, `vmap`, what the compiled refresh contains,
and a K-FAC run taking the same steps either way.
"""

import contextlib
import os
import re
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqfisher as ef
from eqfisher import _host_linalg as host_linalg
from eqfisher.blocks import kronecker

from . import optim_problem


F64 = jnp.float64
PATHS = pytest.mark.parametrize("on_host", [True, False], ids=["host", "xla"])


def _jitted(on_host):
    return jax.jit(lambda f, s: kronecker.shifted_inverses(f, s, on_host))


def _psd(key, k, d, dtype=F64, rank=None):
    x = jr.normal(key, (k, d, rank or d + 2), dtype)
    return x @ jnp.swapaxes(x, 1, 2) / d


def _dense_inverse(f, s):
    """(clamp(F) + s·I)⁻¹ in float64 NumPy."""
    values, vectors = np.linalg.eigh(np.asarray(f, np.float64))
    return (vectors / (np.maximum(values, 0) + float(s))) @ vectors.T


@PATHS
def test_derivatives_equal_central_differences(on_host):
    factors = [_psd(jr.key(0), 2, 7), _psd(jr.key(1), 1, 20)]
    shifts = [jnp.array([0.3, 0.5], F64), jnp.array([0.2], F64)]
    d_factors = [_psd(jr.key(2), 2, 7), _psd(jr.key(3), 1, 20)]
    d_shifts = [jnp.array([1.0, -2.0], F64), jnp.array([0.5], F64)]

    def total(t):
        fs = [f + t * df for f, df in zip(factors, d_factors)]
        ss = [s + t * ds for s, ds in zip(shifts, d_shifts)]
        return kronecker.shifted_inverses(fs, ss, on_host)

    _, tangents = jax.jvp(total, (0.0,), (1.0,))
    eps = 1e-6
    plus, minus = total(eps), total(-eps)
    for t, p, m in zip(tangents, plus, minus):
        np.testing.assert_allclose(t, (p - m) / (2 * eps), rtol=1e-6, atol=1e-8)
    # Reverse mode (the tangent rule transposed), jitted.
    weights = [jr.normal(jr.key(11), f.shape, F64) for f in factors]

    def scalar(t):
        return sum(jnp.sum(w * inv) for w, inv in zip(weights, total(t)))

    numeric = (scalar(eps) - scalar(-eps)) / (2 * eps)
    np.testing.assert_allclose(jax.jit(jax.grad(scalar))(0.0), numeric, rtol=1e-6)


@PATHS
def test_float32_cholesky_failure_falls_back_to_the_clamped_inverse(on_host):
    """A rank-two PSD factor in float32 at a shift below its rounding (n·eps·‖F‖):
    Cholesky fails, and the inverse is the clamped eigendecomposition's. float32
    resolves the zero eigenvalues only to ±eps·‖F‖, so what it can promise is
    checked: the inverse's spectrum within [0, 1/shift], and on F's range the
    float64 inverse to float32's resolution."""
    u = jr.normal(jr.key(4), (80, 2), jnp.float32)
    factor = (u @ u.T)[None] * 1e5
    shift = jnp.array([1e-2], jnp.float32)
    eye = jnp.eye(80, dtype=jnp.float32)
    assert not bool(jnp.all(jnp.isfinite(jnp.linalg.cholesky(factor[0] + 1e-2 * eye))))
    (got,) = _jitted(on_host)([factor], [shift])
    assert got.dtype == jnp.float32
    inverse = np.asarray(got[0], np.float64)
    values = np.linalg.eigvalsh((inverse + inverse.T) / 2)
    assert values.min() >= -1e-3 and values.max() <= 100 * (1 + 1e-3)
    q, _ = np.linalg.qr(np.asarray(u, np.float64))
    want = _dense_inverse(factor[0], 1e-2)
    # To float32's resolution of an inverse of norm 1/shift = 100.
    np.testing.assert_allclose(q.T @ inverse @ q, q.T @ want @ q, atol=1e-4)


@PATHS
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_half_precision_factors_are_inverted_in_float32(dtype, on_host):
    factor = _psd(jr.key(5), 2, 12, jnp.float32).astype(dtype)
    shift = jnp.array([0.5, 1.0], dtype)
    (got,) = _jitted(on_host)([factor], [shift])
    assert got.dtype == dtype
    for f, s, inv in zip(factor, shift, got):
        want = _dense_inverse(np.asarray(f, np.float32), np.float32(s))
        np.testing.assert_allclose(np.asarray(inv, np.float32), want, atol=2e-2)


def _spied_cholesky(monkeypatch) -> list[tuple[threading.Thread, int]]:
    """The thread and the width of each Cholesky factorisation the host refresh
    runs from now on, in the list returned."""
    widths, lapack = [], host_linalg._lapack

    class Spied:
        def __init__(self, dtype):
            self.lapack = lapack(dtype)
            self.potrs, self.potri = self.lapack.potrs, self.lapack.potri

        def potrf(self, a):
            widths.append((threading.current_thread(), a.shape[0]))
            return self.lapack.potrf(a)

    monkeypatch.setattr(host_linalg, "_lapack", Spied)
    return widths


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("d", [255, 256, 512])
def test_widths_that_are_multiples_of_128_are_inverted_padded(d, dtype, monkeypatch):
    """From 256 on, a width that is a multiple of 128 is inverted inside one a row
    and a column wider (LAPACK is slower at such widths): the leading block of the
    wider inverse is the inverse itself, through `potrs` (float32 at 256) and
    `potri` (float64, and float32 at 512: its lower triangle mirrored), and an
    indefinite factor still falls back to the clamped eigendecomposition."""
    # Called here, not through a callback, so that this thread's calls are told
    # apart from any other test's still running.
    widths = _spied_cholesky(monkeypatch)
    monkeypatch.setattr(host_linalg, "usable_cores", lambda: 1)  # no worker threads
    factor = _psd(jr.key(13), 2, d).at[1].add(-3 * jnp.eye(d, dtype=F64))
    shift = jnp.array([0.1, 0.2], F64)
    (got,) = host_linalg._numpy_inverses_here(
        [np.asarray(factor, dtype)], np.asarray(shift, dtype)
    )
    assert got.dtype == dtype
    here = [w for thread, w in widths if thread is threading.current_thread()]
    assert here == [host_linalg.padded_width(d)] * 2
    assert host_linalg.padded_width(d) == (d if d == 255 else d + 1)
    tol = {"rtol": 1e-9, "atol": 1e-12} if dtype == np.float64 else {"atol": 2e-5}
    for f, s, inv in zip(factor, shift, got):
        np.testing.assert_allclose(inv, _dense_inverse(f, s), **tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_wide_matrices_are_inverted_on_worker_threads(dtype, monkeypatch):
    """Where at least two matrices are `PARALLEL_MIN_DIM` wide, the refresh inverts
    them on its worker threads at once (LAPACK without the GIL), else one after
    another on the calling thread: either way each stack's inverses, in its
    order, equal dense float64 ones, an indefinite factor's (the eigendecomposition
    fallback) and a narrow factor's among them. A forked child, which has none of
    its parent's threads, makes its own workers."""
    widths = _spied_cholesky(monkeypatch)
    monkeypatch.setattr(host_linalg, "usable_cores", lambda: 2)
    d = host_linalg.PARALLEL_MIN_DIM + 45
    wide = _psd(jr.key(14), 3, d).at[1].add(-3 * jnp.eye(d, dtype=F64))
    narrow = _psd(jr.key(15), 2, 20)
    shifts = jnp.array([0.1, 0.2, 0.3, 0.4, 0.5], F64)
    tol = {"rtol": 1e-9, "atol": 1e-12} if dtype == np.float64 else {"atol": 2e-5}

    def inverted(expect_workers):
        widths.clear()
        arrays = [np.asarray(x, dtype) for x in (wide, narrow, shifts)]
        packing = host_linalg.Packing.of(arrays)
        got = host_linalg._numpy_inverses(packing, *packing.pack(arrays))
        for f, s, inv in zip([*wide, *narrow], shifts, [*got[0], *got[1]]):
            assert inv.dtype == dtype
            np.testing.assert_allclose(inv, _dense_inverse(f, s), **tol)
        threads = {thread.name for thread, w in widths if w == d}
        assert len([w for _, w in widths if w == d]) == 3
        if expect_workers:
            assert all(name.startswith("eqfisher-refresh") for name in threads)
        else:
            assert threads == {threading.current_thread().name}

    inverted(expect_workers=True)
    monkeypatch.setattr(host_linalg._Pool, "pid", -1)  # as in a forked child
    before = host_linalg._Pool.executor
    inverted(expect_workers=True)
    assert host_linalg._Pool.executor is not before
    assert host_linalg._Pool.pid == os.getpid()
    monkeypatch.setattr(host_linalg, "PARALLEL_MIN_DIM", d + 1)
    inverted(expect_workers=False)


@pytest.mark.parametrize("d", [5, 259], ids=["narrow", "wide"])
def test_a_nonfinite_factor_gives_nan_on_the_host(d):
    """A narrow stack is checked as a whole; each matrix of a wide one
    (`PARALLEL_MIN_DIM` and wider) by the job that inverts it, on a worker thread
    where there are two cores."""
    assert (d >= host_linalg.PARALLEL_MIN_DIM) == (d == 259)
    on_host = True
    factor = _psd(jr.key(6), 2, d).at[1, 0, d - 1].set(jnp.nan)
    shift = jnp.array([0.1, 0.1], F64)
    (got,) = _jitted(on_host)([factor], [shift])
    np.testing.assert_allclose(
        got[0], _dense_inverse(factor[0], 0.1), rtol=1e-9, atol=1e-12
    )
    assert bool(jnp.all(jnp.isnan(got[1])))


def test_an_eigendecomposition_that_does_not_converge_gives_nan_on_the_host(
    monkeypatch,
):
    """Cholesky fails on the indefinite factor and its fallback raises (as LAPACK
    does when it does not converge): NaN, for the optimiser to keep its last
    inverse, not an error out of the compiled step."""

    def no_convergence(x):
        raise np.linalg.LinAlgError("Eigenvalues did not converge")

    factor = _psd(jr.key(12), 2, 5).at[1].add(-3 * jnp.eye(5, dtype=F64))
    shift = jnp.array([0.1, 0.1], F64)
    monkeypatch.setattr(np.linalg, "eigh", no_convergence)
    (got,) = _jitted(True)([factor], [shift])
    monkeypatch.undo()
    np.testing.assert_allclose(got[0], _dense_inverse(factor[0], 0.1), rtol=1e-10)
    assert bool(jnp.all(jnp.isnan(got[1])))


@PATHS
def test_vmap_equals_one_by_one(on_host):
    factors = _psd(jr.key(7), 3 * 2, 6).reshape(3, 2, 6, 6)
    shifts = jnp.linspace(0.1, 0.6, 6, dtype=F64).reshape(3, 2)
    got = jax.jit(
        jax.vmap(lambda f, s: kronecker.shifted_inverses([f], [s], on_host)[0])
    )(factors, shifts)
    for i in range(3):
        for j in range(2):
            want = _dense_inverse(factors[i, j], shifts[i, j])
            np.testing.assert_allclose(got[i, j], want, rtol=1e-9, atol=1e-12)


def test_small_operands_reach_the_callback_joined_by_dtype(monkeypatch):
    """The callback's small arrays travel joined, one operand per dtype (jax puts
    each operand on the device before the callback sees it), the large ones alone:
    the unpacked arrays are the originals, bit for bit, and the inverses of a mix
    of dtypes and sizes, the shifts among the joined ones, equal dense float64
    ones."""
    big = host_linalg.PACKED_MAX_SIZE
    side = int(np.sqrt(big)) + 1  # one matrix just over the limit
    arrays = [
        np.arange(12.0, dtype=np.float32).reshape(1, 3, 4),
        np.arange(big, dtype=np.float32),  # at the limit: joined
        np.arange(side * side, dtype=np.float32).reshape(1, side, side),
        np.arange(6.0, dtype=np.float64).reshape(2, 3),
        np.arange(5.0, dtype=np.float32),
    ]
    packing = host_linalg.Packing.of(arrays)
    assert sorted(packing.groups) == [(0, 1, 4), (2,), (3,)]
    unpacked = packing.unpack(jax.jit(packing.pack)(arrays))
    for x, y in zip(arrays, unpacked):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)

    seen, inverses = [], host_linalg._numpy_inverses

    def spied(packing, *operands):
        seen.append(len(operands))
        return inverses(packing, *operands)

    monkeypatch.setattr(host_linalg, "_numpy_inverses", spied)
    d = side  # a factor stack too large to join
    factors = [
        _psd(jr.key(20), 2, 7, jnp.float32),
        _psd(jr.key(21), 1, d, jnp.float32),
        _psd(jr.key(22), 3, 5),
        _psd(jr.key(23), 1, 9, jnp.float32),
    ]
    shifts = [jnp.asarray(np.linspace(0.1, 0.9, len(f))) for f in factors]
    shifts = [s.astype(f.dtype) for s, f in zip(shifts, factors)]
    got = _jitted(True)(factors, shifts)
    # The 7- and 9-wide float32 stacks join; the float64 stack joins the shifts
    # (one float64 vector, as one factor is float64); the wide stack is alone.
    assert seen == [3]
    for f, s, inv in zip(factors, shifts, got):
        tol = {"rtol": 1e-9, "atol": 1e-12} if f.dtype == F64 else {"atol": 3e-4}
        for i in range(len(f)):
            np.testing.assert_allclose(inv[i], _dense_inverse(f[i], s[i]), **tol)


@PATHS
def test_the_refresh_is_one_callback_on_the_cpu(on_host):
    """What the refresh's compiled program calls: the one host callback, or LAPACK's
    kernels (two size classes here)."""
    model, batch = optim_problem.problem()
    curv = optim_problem.VGC(model, batch)[2]
    invert = jax.jit(
        lambda c: ef.optim.FactoredTikhonov(on_host=on_host).invert(c, 0.1)
    )
    calls = re.findall(r"custom_call @(\w+)", invert.lower(curv).as_text())
    if on_host:
        assert len(calls) == 1 and "callback" in calls[0]
    else:
        assert calls and all(c.startswith("lapack_") for c in calls)


def test_kfac_takes_the_same_steps_on_the_host_and_in_xla():
    model, batch = optim_problem.problem()
    like = optim_problem.like()
    params = eqx.filter(model, eqx.is_inexact_array)
    runs = []
    for on_host in (True, False):
        variant = ef.optim.FactoredTikhonov(on_host=on_host)
        opt = ef.optim.kfac(1e-2, like=like, damping_variant=variant)
        step = ef.optim.kfac_step(
            optim_problem.loss_fn,
            opt,
            estimator=ef.GGN(),
            structure=ef.KFAC(),
            fast_compile=False,
        )
        m, state = model, opt.init(params)
        for _ in range(4):
            m, state, _ = step(m, state, batch)
        runs.append(eqx.filter(m, eqx.is_inexact_array))
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_on_host_must_be_a_bool_or_none(bad, unchecked):
    # As users see it (the runtime type check, on in the tests, refuses it first).
    with pytest.raises(ValueError, match=r"FactoredTikhonov\(on_host=\.\.\.\)"):
        ef.optim.FactoredTikhonov(on_host=bad)


def _scipy_openblas_version() -> tuple[int, ...] | None:
    """The version of the OpenBLAS SciPy's LAPACK was built with, if it is one."""
    import scipy

    config = scipy.show_config(mode="dicts") or {}
    lapack = config.get("Build Dependencies", {}).get("lapack", {})
    if "openblas" not in lapack.get("name", "").lower():
        return None
    return tuple(int(n) for n in re.findall(r"\d+", lapack.get("version", ""))[:3])


def _thread_settings() -> list[int]:
    """Each loaded OpenBLAS's thread setting (`openblas_set_num_threads_local`)."""
    settings = []
    for setter in host_linalg.thread_local_setters():
        current = setter(1)  # a setter returns the setting it replaces
        setter(current)
        settings.append(current)
    return settings


def test_one_blas_thread_sets_one_thread_and_sets_it_back():
    """OpenBLAS's workers, once woken, spin for about 0.1 s and take a core from
    XLA's threads: the refresh runs LAPACK on one thread."""
    version = _scipy_openblas_version()
    if version is not None and version >= (0, 3, 27):
        assert host_linalg.thread_local_setters(), "SciPy's OpenBLAS was not found"
    outside = _thread_settings()
    one = [1] * len(outside)
    with host_linalg.one_blas_thread():
        assert _thread_settings() == one
    assert _thread_settings() == outside
    with pytest.raises(RuntimeError, match="inside"):
        with host_linalg.one_blas_thread():
            raise RuntimeError("inside")
    assert _thread_settings() == outside


def test_one_blas_thread_sets_it_back_when_the_last_caller_leaves():
    """The setting is process-wide in OpenBLAS's pthreads builds: callbacks on two
    threads overlapping leave it as it was, whichever leaves first."""
    outside = _thread_settings()
    one = [1] * len(outside)
    first_in, second_out = threading.Event(), threading.Event()
    seen = []

    def first():
        with host_linalg.one_blas_thread():
            first_in.set()
            second_out.wait(timeout=10)
            seen.append(_thread_settings())

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait(timeout=10)
    with host_linalg.one_blas_thread():
        assert _thread_settings() == one
    second_out.set()
    thread.join()
    assert seen == [one]  # the second caller left, the first was still inside
    assert _thread_settings() == outside


def test_the_host_refresh_runs_inside_one_blas_thread(monkeypatch):
    entered = []
    one_thread = host_linalg.one_blas_thread

    @contextlib.contextmanager
    def recording():
        with one_thread():
            entered.append(_thread_settings())
            yield

    monkeypatch.setattr(host_linalg, "one_blas_thread", recording)
    factor = _psd(jr.key(13), 2, 5)
    shift = jnp.array([0.1, 0.2], F64)
    (got,) = _jitted(True)([factor], [shift])
    np.testing.assert_allclose(got[1], _dense_inverse(factor[1], 0.2), rtol=1e-10)
    assert entered == [[1] * len(host_linalg.thread_local_setters())]
