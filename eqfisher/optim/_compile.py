"""The K-FAC step's jit: XLA options that halve its first-call compile on the CPU,
and a dispatch leaner than `eqx.filter_jit`'s."""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp

from .._host_linalg import usable_cores
from .._refusal import checks_surfaced


# XLA:CPU's element-wise code from its older emitters, optimised by LLVM at -O1: on
# jaxlib 0.9-0.10 the XLA compile of a `kfac_step` takes about half the time of
# XLA's defaults (the newer fusion emitters' pipeline is most of it), its steps
# 0-10% longer. jaxlib 0.12 has only the newer emitters and refuses the first
# option; -O1 alone saves 6-13% of its XLA compile there, steps unchanged
# (benchmarks/RESULTS.md, "Issue 26, sixth session"). The first set the compiler
# takes is used.
_CPU_CANDIDATES: tuple[dict[str, Any], ...] = (
    {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1},
    {"xla_backend_optimization_level": 1},
)


def _codegen_split_count() -> int:
    """The parts XLA:CPU splits a program's LLVM module into, to compile them at
    once (`xla_cpu_parallel_codegen_split_count`, 32 by default): four a core, at
    most 32. Each part is cloned and run through LLVM's passes; on 2 cores, 8 parts
    took a K-FAC step's XLA compile 3-10% less time than 32 (jaxlib 0.10 and
    0.12), the code the same (benchmarks/RESULTS.md, "Issue 26, nineteenth
    session"). Measured on 2 cores only: four a core is that grid's choice
    carried to other machines, and from 8 cores on it is XLA's own 32."""
    return min(32, 4 * usable_cores())


@functools.cache
def _cpu_options() -> tuple[tuple[str, Any], ...]:
    """The first of `_CPU_CANDIDATES` that the CPU compiler takes (tried once on a
    one-op function), with `_codegen_split_count()` where it takes that too, as
    items; none when it takes none."""
    x = jax.ShapeDtypeStruct((), jnp.float32)
    split = {"xla_cpu_parallel_codegen_split_count": _codegen_split_count()}
    for candidate in _CPU_CANDIDATES:
        for options in ({**candidate, **split}, candidate):
            try:  # ahead of time: allowed inside a trace too
                jax.jit(jnp.negative).lower(x).compile(dict(options))
            except RuntimeError:  # jax.errors.JaxRuntimeError: no such option
                continue
            return tuple(options.items())
    return ()


def fast_compile_options() -> dict[str, Any]:
    """XLA compiler options for a training step compiled in about half the time.

    On the CPU, with jaxlib 0.9-0.10: XLA's older element-wise emitters and LLVM at
    -O1. The XLA compile of `kfac_step`'s step takes 0.4-0.6 of its time at XLA's
    defaults on the five problems of `benchmarks/kfac_defaults.py` and the 12-block
    GPT, and its steps 0-10% longer: worth it for runs of up to a few thousand
    steps. With jaxlib 0.12, which has only the newer emitters, LLVM at -O1 alone:
    0.87-0.94 of the XLA compile, steps unchanged. With either, the LLVM module is
    compiled in four parts a core, at most 32 (XLA's default is 32 whatever the
    cores): on 2 cores, 3-10% less XLA compile. On a GPU an empty dict: nothing
    applies.

    `kfac_step(..., fast_compile=True)` (the default) compiles its step with these;
    a step jitted by hand can too, as `jax.jit(step, compiler_options=...)` or
    `eqx.filter_jit(step, compiler_options=...)`. They apply to the outermost
    `jit` only: a jitted function called inside another is compiled with it.

    **Returns:**

    A dict for `jax.jit(..., compiler_options=...)`, for the default backend.

    !!! Example

        ```python
        options = ef.optim.fast_compile_options()  # {} on a GPU
        double = eqx.filter_jit(lambda x: 2 * x, compiler_options=options)
        assert double(jnp.ones(3))[0] == 2.0
        ```
    """
    return dict(_cpu_options()) if jax.default_backend() == "cpu" else {}


def _nested_options_error(error: ValueError) -> bool:
    return "compiler_options" in str(error) and "top-level" in str(error)


class _Static(eqx.Module):
    """A traced function's non-array outputs and their places, carried by the
    output's tree structure: no leaves, so `jax.jit` returns them as they are."""

    value: Any = eqx.field(static=True)


# Stands for an array leaf in the static half of a flattened call.
_ARRAY = object()


def _split(tree: Any) -> tuple[list[Any], tuple[Any, tuple[Any, ...]]]:
    """`tree`'s array leaves, and what rebuilds it from them (`_join`): its
    structure and its other leaves, in place, with `_ARRAY` for each array."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [x for x in leaves if eqx.is_array(x)]
    rest = tuple(_ARRAY if eqx.is_array(x) else x for x in leaves)
    return arrays, (treedef, rest)


def _join(arrays: Sequence[Any], static: tuple[Any, tuple[Any, ...]]) -> Any:
    treedef, rest = static
    it = iter(arrays)
    return jax.tree_util.tree_unflatten(
        treedef, [next(it) if x is _ARRAY else x for x in rest]
    )


def _buffer(x: Any) -> Any:
    """What identifies `x`'s memory: two arrays that `jax.device_put` made from one
    (a model holding one array in two leaves, replicated) are two objects on one
    buffer, which XLA refuses to be given twice, donated."""
    try:
        return x.unsafe_buffer_pointer()  # on one device
    except Exception:
        try:
            return x.addressable_data(0).unsafe_buffer_pointer()  # sharded
        except Exception:  # NumPy, a deleted array, no pointers: by identity
            return id(x)


def _distinct(donated: list[Any], kept: list[Any]) -> list[Any]:
    """`donated`, where an array on a buffer also found earlier among them or among
    `kept` replaced by a copy: jax refuses to donate one buffer twice, and a model
    can hold one array in several leaves."""
    seen = {_buffer(x) for x in kept}
    out = []
    for x in donated:
        buffer = _buffer(x)
        if buffer in seen:
            x = jnp.copy(x)
            buffer = _buffer(x)
        seen.add(buffer)
        out.append(x)
    return out


class _FlatJit:
    """`fun` jitted as `eqx.filter_jit` does; see `filter_jit_with_options`."""

    def __init__(self, fun: Callable, options: dict[str, Any], donate_first: int):
        def flat(static, donated, kept):
            head = _join(donated, static[0])
            tail, kwargs = _join(kept, static[1])
            out_arrays, out_static = _split(fun(*head, *tail, **kwargs))
            return out_arrays, _Static(out_static)

        self._donate_first = donate_first
        self._plain = jax.jit(flat, static_argnums=0)
        self._top = jax.jit(
            flat,
            static_argnums=0,
            donate_argnums=1 if donate_first else (),
            compiler_options=options or None,
        )
        functools.update_wrapper(self, fun)

    def _flatten(self, args: tuple, kwargs: dict) -> tuple[Any, list, list]:
        donated, static_head = _split(args[: self._donate_first])
        kept, static_tail = _split((args[self._donate_first :], kwargs))
        return (static_head, static_tail), donated, kept

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        static, donated, kept = self._flatten(args, kwargs)
        if any(isinstance(x, jax.core.Tracer) for x in (*donated, *kept)):
            out_arrays, out_static = self._plain(static, donated, kept)
        else:
            try:
                with checks_surfaced():
                    out_arrays, out_static = self._top(
                        static, _distinct(donated, kept) if donated else donated, kept
                    )
            except ValueError as e:
                # Inside a trace that closed over these arrays: without options.
                if not _nested_options_error(e):
                    raise
                out_arrays, out_static = self._plain(static, donated, kept)
        return _join(out_arrays, out_static.value)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """jax's `Traced` of a call at the top level (`.lower()`, `.jaxpr`)."""
        return self._top.trace(*self._flatten(args, kwargs))

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """jax's `Lowered` of a call at the top level (`.compile()`, `.as_text()`),
        with the compiler options and donations of a call."""
        return self._top.lower(*self._flatten(args, kwargs))


def filter_jit_with_options(
    fun: Callable, options: dict[str, Any], donate_first: int = 0
) -> Callable:
    """`fun` jitted as `eqx.filter_jit` does (array leaves traced, every other leaf
    static), compiled with the XLA compiler `options` when called outside any
    trace, and there the arrays of its first `donate_first` positional arguments
    donated (`jax.jit(donate_argnums=...)`: XLA may write the outputs into their
    buffers, and deletes them). Inside a trace (another `jit`, `lax.scan`,
    `vmap`) without either: jax refuses compiler options on a nested `jit`, and
    the outer computation's options and donations apply to it anyway. Its
    `.trace(...)` and `.lower(...)` are jax's, for a call at the top level.

    A call flattens its arguments once and hands `jax.jit` the lists of arrays
    and a hashable static half; the outputs come back the same way. That costs
    less than `eqx.filter_jit`'s dispatch: 0.05-0.25 ms a call of a `kfac_step`
    step (benchmarks/RESULTS.md, "Issue 26, twelfth session")."""
    return _FlatJit(fun, options, donate_first)
