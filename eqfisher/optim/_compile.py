"""XLA compiler options that halve the first-call compile of a K-FAC step on the CPU."""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp


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


@functools.cache
def _cpu_options() -> tuple[tuple[str, Any], ...]:
    """The first of `_CPU_CANDIDATES` that the CPU compiler takes (tried once on a
    one-op function), as items; none when it takes none."""
    x = jax.ShapeDtypeStruct((), jnp.float32)
    for options in _CPU_CANDIDATES:
        try:  # ahead of time: allowed inside a trace too
            jax.jit(jnp.negative).lower(x).compile(dict(options))
        except RuntimeError:  # jax.errors.JaxRuntimeError: no such compile option
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
    0.87-0.94 of the XLA compile, steps unchanged. On a GPU an empty dict: nothing
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


def filter_jit_with_options(fun: Callable, options: dict[str, Any]) -> Callable:
    """`eqx.filter_jit(fun)`, compiled with the XLA compiler `options` when called
    outside any trace. Inside one (another `jit`, `lax.scan`, `vmap`) the plain
    `filter_jit`: jax refuses compiler options on a nested `jit`, and the outer
    computation's options apply to it anyway."""
    plain = eqx.filter_jit(fun)
    if not options:
        return plain
    # equinox's typed overloads leave out the `**jitkwargs` it passes to `jax.jit`.
    optioned = eqx.filter_jit(fun, compiler_options=options)  # pyright: ignore[reportCallIssue]

    @functools.wraps(fun)
    def call(*args, **kwargs):
        if any(
            isinstance(x, jax.core.Tracer)
            for x in jax.tree_util.tree_leaves((args, kwargs))
        ):
            return plain(*args, **kwargs)
        try:
            return optioned(*args, **kwargs)
        except ValueError as e:  # inside a trace that closed over these arrays
            if not _nested_options_error(e):
                raise
            return plain(*args, **kwargs)

    return call
