"""Shifted inverses of PSD matrices computed on the host, by SciPy's LAPACK.

On the CPU, the K-FAC optimiser's refresh of its cached inverses
(`blocks.kronecker.shifted_inverses`) runs here, all of it in one
`jax.pure_callback`. XLA compiles the callback as one call. The same inverses
written in XLA (a batched Cholesky per size class, each with its
eigendecomposition fallback under a `lax.cond`) took a fifth to a third of a
K-FAC training step's first-call compile, and ran about as fast: it is the same
LAPACK (benchmarks/RESULTS.md, "Issue 26, eighth session"). The callback runs
LAPACK on one thread (`one_blas_thread`), so that no OpenBLAS worker is left
spinning beside XLA's threads after it, and inverts its wide matrices on worker
threads at once (`_run`), calling LAPACK without the GIL (`Lapack`)."""

import concurrent.futures
import contextlib
import ctypes
import functools
import glob
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
import scipy.linalg.cython_lapack
from jaxtyping import Array


# LAPACK's inverse from a Cholesky factor (`potri`, then the lower triangle
# mirrored) takes less time than two triangular solves with the identity (`potrs`)
# from this width on; below it, more. One thread: float32 0.23 against 0.16 ms at
# 129, 2.09 against 2.07 at 385; float64 0.28 against 0.31 ms at 129, 1.35
# against 1.73 at 257 (benchmarks/RESULTS.md, "Issue 26, sixteenth session").
POTRI_MIN_DIM = {np.dtype(np.float32): 384, np.dtype(np.float64): 128}


def use_host(on_host: bool | None) -> bool:
    """Whether `shifted_inverses` is used: `on_host`, or where it is None, whether
    jax's default backend is the CPU (read when traced)."""
    return jax.default_backend() == "cpu" if on_host is None else on_host


def shifted_inverses(factors: Sequence[Array], shifts: Array) -> list[Array]:
    """`(factor + shift·I)⁻¹` of stacks of PSD matrices, `(k, d, d)` each, `shifts`
    the stacks' shifts one after another (`(Σk,)`), computed on the host in one
    callback: by Cholesky, or where
    that fails (float32 rounding) from the clamped eigendecomposition,
    `(clamp(F) + shift·I)⁻¹`. A matrix that is not finite, or whose
    eigendecomposition does not converge, gives NaN (the optimiser then keeps its
    last inverse). Not differentiable itself (`blocks.kronecker` differentiates
    it)."""
    shapes = [jax.ShapeDtypeStruct(f.shape, f.dtype) for f in factors]
    packing = Packing.of([*factors, shifts])
    return jax.pure_callback(
        _inverses_of(packing),
        shapes,
        *packing.pack([*factors, shifts]),
        vmap_method="sequential",
    )


@functools.cache
def _inverses_of(packing: "Packing") -> Callable[..., list[np.ndarray]]:
    """The callback for one packing, one object for equal packings: jax compiles
    a callback again for a new callable, so a new `functools.partial` at every
    eager call (an update outside `jit`) was compiled at every call."""
    return functools.partial(_numpy_inverses, packing)


# jax hands a callback's operands to it as jax Arrays, a `device_put` each: about
# 45 us an operand on the CPU, against 7 us a result (one callback, 32 x 32
# float32 operands: 162 us with one, 409 with seven; jax 0.9-0.12). So the
# refresh's small operands travel joined, one operand per dtype, each at most
# this many elements: copying them costs less than passing them one by one
# (benchmarks/RESULTS.md, "Issue 26, eighteenth session").
PACKED_MAX_SIZE = 2**16


class Packing(NamedTuple):
    """How a callback's arrays travel as its operands: `groups[i]`, the positions
    of the arrays joined (raveled, one after another) in operand `i`, or of the
    one array passed as it is; `shapes`, every array's shape."""

    groups: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, arrays: Sequence[Array | np.ndarray]) -> "Packing":
        """The small arrays (`PACKED_MAX_SIZE`) joined by dtype, the rest alone."""
        joined: dict[np.dtype, list[int]] = {}
        groups: list[tuple[int, ...]] = []
        for i, x in enumerate(arrays):
            if x.size <= PACKED_MAX_SIZE:
                joined.setdefault(np.dtype(x.dtype), []).append(i)
            else:
                groups.append((i,))
        groups += [tuple(members) for members in joined.values()]
        return cls(tuple(groups), tuple(tuple(x.shape) for x in arrays))

    def pack(self, arrays: Sequence[Array | np.ndarray]) -> list[Array | np.ndarray]:
        """The callback's operands."""
        return [
            arrays[g[0]]
            if len(g) == 1
            else jnp.concatenate([jnp.ravel(arrays[i]) for i in g])
            for g in self.groups
        ]

    def unpack(self, operands: Sequence[Any]) -> list[np.ndarray]:
        """The arrays, from the callback's operands (NumPy views of them)."""
        out: list[np.ndarray] = [np.empty(0)] * len(self.shapes)
        for g, operand in zip(self.groups, operands):
            operand = np.asarray(operand)
            if len(g) == 1:
                out[g[0]] = operand
                continue
            start = 0
            for i in g:
                size = math.prod(self.shapes[i])
                out[i] = operand[start : start + size].reshape(self.shapes[i])
                start += size
        return out


def _numpy_inverses(packing: Packing, *operands) -> list[np.ndarray]:
    *factors, shifts = packing.unpack(operands)
    with one_blas_thread():
        return _numpy_inverses_here(factors, shifts)


def _numpy_inverses_here(factors, shifts) -> list[np.ndarray]:
    shifts = np.asarray(shifts)
    ends = np.cumsum([np.shape(stack)[0] for stack in factors])
    out, jobs, widths = [], [], []
    for stack, shift in zip(factors, np.split(shifts, ends[:-1])):
        stack = np.asarray(stack)
        # Half precisions are inverted in float32 (LAPACK has none below it).
        work = np.dtype(np.float64 if stack.dtype == np.float64 else np.float32)
        inverses = np.empty(stack.shape, work)
        stack_jobs = _jobs(inverses, stack.astype(work, copy=False), shift.astype(work))
        jobs += stack_jobs
        widths += [stack.shape[-1]] * len(stack_jobs)
        out.append((inverses, stack.dtype))
    _run(jobs, widths)
    return [inverses.astype(dtype, copy=False) for inverses, dtype in out]


# Where at least two matrices are this wide, the refresh inverts them at once on
# worker threads, LAPACK on one thread each, called without the GIL. Two matrices,
# one thread against two (median of 30, 2 cores): float32 1.92 against 1.55 ms at
# 256, 0.82 against 0.90 at 192; float64 7.2 against 4.6 ms at 384, 3.1 at 256
# either way (benchmarks/RESULTS.md, "Issue 26, seventeenth session").
PARALLEL_MIN_DIM = 256


class _Pool:
    """The refresh's worker threads, made at first use (and again in a forked
    child, which has none of its parent's threads)."""

    lock = threading.Lock()
    executor: concurrent.futures.ThreadPoolExecutor | None = None
    pid = 0


def _run(jobs: Sequence[Callable[[], None]], widths: Sequence[int]) -> None:
    """Runs the jobs (inverses of matrices `widths` wide), widest first, on worker
    threads where at least two are `PARALLEL_MIN_DIM` wide and this process may run
    on more than one core; else one after another here."""
    order = sorted(range(len(jobs)), key=lambda i: -widths[i])
    wide = sum(w >= PARALLEL_MIN_DIM for w in widths)
    if min(wide, usable_cores()) < 2:
        for i in order:
            jobs[i]()
        return
    with _Pool.lock:
        if _Pool.executor is None or _Pool.pid != os.getpid():
            _Pool.executor = concurrent.futures.ThreadPoolExecutor(
                usable_cores(), thread_name_prefix="eqfisher-refresh"
            )
            _Pool.pid = os.getpid()
        executor = _Pool.executor
    for future in [executor.submit(jobs[i]) for i in order]:
        future.result()


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cython_lapack(name: str, arguments: int) -> Callable:
    """SciPy's LAPACK function `name` (`scipy.linalg.cython_lapack`, all `arguments`
    pointers), called through ctypes, which releases the GIL while it runs (SciPy's
    Python wrappers hold it, so two threads would take turns)."""
    capsule = scipy.linalg.cython_lapack.__pyx_capi__[name]  # pyright: ignore[reportAttributeAccessIssue]
    address = _capsule_pointer(capsule, _capsule_name(capsule))
    return ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * arguments)(address)


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]

# LAPACK reads a matrix by columns and NumPy by rows: LAPACK's upper triangle of a
# C-ordered matrix is NumPy's lower one.
_UPPER = ctypes.c_char(b"U")


def _data(a: np.ndarray) -> ctypes.c_void_p:
    if not a.flags.c_contiguous:
        raise ValueError("LAPACK is called on C-ordered matrices only")
    return ctypes.c_void_p(a.ctypes.data)


class Lapack:
    """Cholesky's LAPACK routines for one dtype, in place on C-ordered square
    arrays, each returning LAPACK's `info` (0 when it succeeded); the triangle
    read and written is NumPy's lower one."""

    def __init__(self, dtype: np.dtype):
        prefix = "d" if dtype == np.float64 else "s"
        self._potrf = _cython_lapack(prefix + "potrf", 5)
        self._potrs = _cython_lapack(prefix + "potrs", 8)
        self._potri = _cython_lapack(prefix + "potri", 5)

    def potrf(self, a: np.ndarray) -> int:
        """`a`'s lower triangle becomes L, `a = L Lᵀ`."""
        n, info, ref = ctypes.c_int(a.shape[0]), ctypes.c_int(0), ctypes.byref
        self._potrf(ref(_UPPER), ref(n), _data(a), ref(n), ref(info))
        return info.value

    def potrs(self, chol: np.ndarray, b: np.ndarray) -> int:
        """`b`, as wide as `chol`, becomes `b (L Lᵀ)⁻¹`, L the lower triangle of
        `chol` (LAPACK solves for the columns of `bᵀ`, its rows)."""
        n, info, ref = ctypes.c_int(chol.shape[0]), ctypes.c_int(0), ctypes.byref
        self._potrs(
            ref(_UPPER),
            ref(n),
            ref(n),
            _data(chol),
            ref(n),
            _data(b),
            ref(n),
            ref(info),
        )
        return info.value

    def potri(self, chol: np.ndarray) -> int:
        """`chol`'s lower triangle, L, becomes that of `(L Lᵀ)⁻¹`."""
        n, info, ref = ctypes.c_int(chol.shape[0]), ctypes.c_int(0), ctypes.byref
        self._potri(ref(_UPPER), ref(n), _data(chol), ref(n), ref(info))
        return info.value


@functools.cache
def _lapack(dtype: np.dtype) -> Lapack:
    return Lapack(dtype)


# OpenBLAS's Cholesky and its inverse slow down on a matrix whose width is a
# multiple of 128 from 256 on, by cache-set conflicts along its columns: one
# thread, float32, 7.0 ms at 512 against 4.3 at 511 and 513, 45 against 26 ms at
# 1024. Such a matrix is inverted as the leading block of one a row and a column
# wider, `[[F + shift·I, 0], [0, 1]]`, whose inverse's leading block is
# `(F + shift·I)⁻¹` exactly: 4.4 ms at 512, 27 ms at 1024 (benchmarks/RESULTS.md,
# "Issue 26, sixteenth session").
def padded_width(d: int) -> int:
    """The width at which LAPACK inverts a `d × d` matrix."""
    return d + 1 if d >= 256 and d % 128 == 0 else d


def _jobs(out: np.ndarray, stack: np.ndarray, shifts: np.ndarray) -> list[Callable]:
    """One job a matrix of `stack`, `(k, d, d)`, each writing `(F + shift·I)⁻¹` into
    its `out[i]`. Where `stack` is narrower than `PARALLEL_MIN_DIM`, what NumPy can
    do for the whole stack at once is done here: the finite checks, the copy, the
    shift (the jobs' own NumPy calls cost about 5 us each, a few times the LAPACK of
    a narrow matrix). A wide matrix's job does its own, on the worker thread that
    inverts it: for two 513-wide matrices, about 1 ms less on two cores."""
    k, d = stack.shape[0], stack.shape[-1]
    if d >= PARALLEL_MIN_DIM:
        return [
            functools.partial(_prepare_and_invert, out[i], stack[i], shifts[i])
            for i in range(k)
        ]
    shifted = _shifted(stack, shifts)
    finite = np.all(np.isfinite(stack), axis=(1, 2)).tolist()
    return [
        functools.partial(_invert, out[i], shifted[i], stack[i], shifts[i])
        if finite[i]
        else functools.partial(out[i].fill, np.nan)
        for i in range(k)
    ]


def _shifted(stack: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """A copy of each matrix of `stack`, `(k, d, d)`, at its `padded_width`, with
    its shift added to its diagonal (and 1 on the padding's)."""
    k, d = stack.shape[0], stack.shape[-1]
    width = padded_width(d)
    if width > d:
        shifted = np.zeros((k, width, width), stack.dtype)
        shifted[:, :d, :d] = stack
    else:
        shifted = stack.copy()
    diagonals = shifted.reshape(k, width * width)[:, :: width + 1]
    diagonals[:, :d] += shifts[:, None]
    diagonals[:, d:] = 1
    return shifted


def _prepare_and_invert(out: np.ndarray, factor: np.ndarray, shift) -> None:
    """`_invert` of one matrix, after its finite check, copy and shift (NaN where
    it is not finite)."""
    if not np.isfinite(factor).all():
        out.fill(np.nan)
        return
    shifted = _shifted(factor[None], np.asarray(shift)[None])[0]
    _invert(out, shifted, factor, shift)


def _invert(out: np.ndarray, shifted: np.ndarray, factor: np.ndarray, shift) -> None:
    """`out` becomes `shifted⁻¹`'s leading block by Cholesky, or where that fails
    `(clamp(factor) + shift·I)⁻¹` from the eigendecomposition (NaN where that does
    not converge); `shifted` is overwritten."""
    d, width = factor.shape[0], shifted.shape[0]
    lapack = _lapack(factor.dtype)
    info = lapack.potrf(shifted)
    if info == 0:
        if d < POTRI_MIN_DIM[factor.dtype]:
            inverse = out if width == d else np.empty_like(shifted)
            np.copyto(inverse, _eye(width, factor.dtype))
            info = lapack.potrs(shifted, inverse)
        else:
            info = lapack.potri(shifted)
            # Its lower triangle mirrored; the upper one still holds the factor.
            np.copyto(shifted, shifted.T, where=_above(width))
            inverse = shifted
        if info == 0 and np.isfinite(inverse).all():
            if inverse is not out:
                out[...] = inverse[:d, :d]
            return
    try:
        values, vectors = np.linalg.eigh(factor)
    except np.linalg.LinAlgError:  # did not converge
        out.fill(np.nan)
        return
    out[...] = (vectors / (np.maximum(values, 0) + shift)) @ vectors.T


@functools.cache
def _eye(d: int, dtype: np.dtype) -> np.ndarray:
    return np.eye(d, dtype=dtype)


@functools.cache
def _above(d: int) -> np.ndarray:
    """Where a `d × d` matrix is above its diagonal."""
    return np.triu(np.ones((d, d), bool), 1)


# OpenBLAS's worker threads spin for about 2**28 cycles (0.1 s) after each
# multithreaded call before they sleep. On a CPU with few cores, a worker left
# spinning by the refresh takes a core from XLA's own threads for the next steps:
# on the 2-core machine of benchmarks/RESULTS.md a K-FAC step of the CNN that
# follows a refresh took 9-12 ms instead of 7 (benchmarks/RESULTS.md, "Issue 26,
# fourteenth session"). So the refresh runs its LAPACK on one thread, by OpenBLAS's
# `openblas_set_num_threads_local` (0.3.27 on): a variable each BLAS call reads,
# process-wide in OpenBLAS's pthreads builds, so it is set while any callback is
# inside `one_blas_thread` and set back when the last one leaves.
_LOCAL_SETTER = "openblas_set_num_threads_local"


def _openblas_paths() -> set[str]:
    """The OpenBLAS libraries this process has loaded (from /proc/self/maps), or
    elsewhere those that NumPy's and SciPy's wheels ship."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps}
    except OSError:  # not Linux
        paths = set()
        for package in (np, scipy):
            root = os.path.dirname(os.path.dirname(package.__file__ or ""))
            name = package.__name__
            for where in (f"{name}.libs", os.path.join(name, ".dylibs")):
                paths.update(glob.glob(os.path.join(root, where, "*")))
    return {p for p in paths if "openblas" in os.path.basename(p).lower()}


@functools.cache
def thread_local_setters() -> tuple[Callable[[int], int], ...]:
    """`openblas_set_num_threads_local` of each OpenBLAS found that has it; each
    returns the setting it replaces."""
    setters = []
    for path in sorted(_openblas_paths()):
        try:
            setter = getattr(ctypes.CDLL(path), _LOCAL_SETTER)
        except (OSError, AttributeError):  # not loadable, or OpenBLAS < 0.3.27
            continue
        setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
        setters.append(setter)
    return tuple(setters)


class _OneThread:
    """How many callers are inside `one_blas_thread`, and the settings the first
    of them replaced."""

    lock = threading.Lock()
    inside = 0
    replaced: list[int] = []


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """OpenBLAS on one thread inside the block (each OpenBLAS loaded that has
    `openblas_set_num_threads_local`; else nothing changes), its setting back
    when the last caller inside leaves."""
    setters = thread_local_setters()
    with _OneThread.lock:
        if _OneThread.inside == 0:
            _OneThread.replaced = [setter(1) for setter in setters]
        _OneThread.inside += 1
    try:
        yield
    finally:
        with _OneThread.lock:
            _OneThread.inside -= 1
            if _OneThread.inside == 0:
                for setter, n in zip(setters, _OneThread.replaced):
                    setter(n)
