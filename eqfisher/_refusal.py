"""`refused_where`: a check on values that may be concrete or traced;
`checks_surfaced`, which gives the caller a failed check as Equinox's error; and
the argument checks several public functions share (`check_key`, `check_count`)."""

import logging
from collections.abc import Callable
from typing import TypeVar

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool


_Carrier = TypeVar("_Carrier")


def refused_where(
    carrier: _Carrier,
    bad: Bool[Array | np.ndarray, "..."],
    message: str,
    got: Callable[[], str] | None = None,
) -> _Carrier:
    """`carrier`, after checking that `bad` is False everywhere: a concrete `bad`
    that is not raises `ValueError` (with `got()`, the offending value, appended),
    a traced one Equinox's runtime error (`eqx.error_if`, attached to `carrier`,
    so the check runs wherever `carrier` is used)."""
    if isinstance(bad, jax.core.Tracer):
        if all(jnp.ndim(x) == 0 for x in jax.tree_util.tree_leaves(carrier)):
            return eqx.error_if(carrier, bad, message)
        return _carried(carrier, eqx.error_if(jnp.asarray(0), bad, message))
    if bool(np.any(np.asarray(bad))):
        raise ValueError(message if got is None else f"{message} Got {got()}.")
    return carrier


def check_key(caller: str, key) -> None:
    """`key` one PRNG key: a typed key of shape `()` (`jax.random.key`), or raw
    `uint32` data (`jax.random.PRNGKey`: threefry's 2 words, rbg's 4)."""
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        ok = jnp.shape(key) == ()
    else:
        ok = dtype == jnp.uint32 and jnp.shape(key) in ((2,), (4,))
    if not ok:
        got = type(key).__name__ if dtype is None else f"{dtype} of shape"
        shape = "" if dtype is None else f" {jnp.shape(key)}"
        raise TypeError(
            f"`{caller}(..., key=...)`: one PRNG key, `jax.random.key(seed)` (or a "
            f"legacy `jax.random.PRNGKey(seed)`), got {got}{shape}."
        )


def check_count(value: int, name: str, caller: str, *, minimum: int = 1) -> None:
    """`value` an int (not a bool) of at least `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"`{caller}({name}=...)` must be an integer >= {minimum}, got {value!r}"
            f"{int_hint(value)}."
        )


def check_flag(caller: str, name: str, flag) -> None:
    """`flag` is a bool: a string such as `"no"` would be read as `True`."""
    if not isinstance(flag, bool):
        raise TypeError(f"`{caller}({name}=...)`: True or False, got {flag!r}.")


def int_hint(value) -> str:
    """Advice for a count given as a NumPy or JAX integer (a shape fixed when
    traced: it must be a Python int), or '' for anything else."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        return ""
    if isinstance(value, jax.core.Tracer):
        return (
            " (a NumPy or JAX integer, traced: counts fix shapes, so pass a Python "
            "int, `int(...)`)"
        )
    return " (a NumPy or JAX integer: pass a Python int, `int(...)`)"


def _carried(carrier: _Carrier, zero) -> _Carrier:
    """`carrier` with the checked `zero` (a weakly typed int 0) added to its
    arrays, so that the check runs wherever they are used. Equinox's check is a
    `cond` whose outputs XLA places on one device: a sharded `carrier` passed
    through it would be gathered there and scattered back at every call, where a
    scalar costs nothing. (A carrier of scalars goes through the `cond` itself:
    one kernel fewer.)"""

    def attach(x):
        if not eqx.is_array(x) or jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x
        if x.dtype == jnp.bool_:
            return x | (zero != 0)
        return x + zero  # the weak int keeps `x`'s dtype and weak type

    return jax.tree_util.tree_map(attach, carrier)


# A failed `eqx.error_if` check in a program compiled by `jax.jit` (as a step, or
# jax's own `lax.map` called outside any `jit`) reaches the caller as a
# `JaxRuntimeError` from its host callback, with the message inside a traceback
# and Equinox's advice to use `eqx.filter_jit`; and jax logs the callback's
# failure to stderr. `checks_surfaced` raises Equinox's own error instead, as
# `eqx.filter_jit` does, and keeps failed checks out of the log.
_callback_log = logging.getLogger("jax._src.callback")
_CHECK_ERROR = "_EquinoxRuntimeError"  # the class Equinox's check raises inside
_CHECK = _CHECK_ERROR + ": "
_CHECK_END = "\n\n\n--------------------\n"


def _quiet_check(record: logging.LogRecord) -> bool:
    """Whether jax's log of a failed callback is kept: not for a failed check."""
    error = record.exc_info[1] if record.exc_info else None
    return type(error).__name__ != _CHECK_ERROR


def _check_message(error: str) -> str | None:
    """The message of the failed `eqx.error_if` check in `error`, if one failed."""
    start = error.rfind(_CHECK)
    if start < 0:
        return None
    start += len(_CHECK)
    end = error.find(_CHECK_END, start)
    return error[start : end if end >= 0 else None].strip()


_FILTER_JIT_CHECK = "EquinoxRuntimeError: "
_FILTER_JIT_END = "\n\n-------------------\n"


def _filter_jit_message(error: str) -> str | None:
    """The failed check's message in `eqx.filter_jit`'s error, if it has one."""
    start = error.find(_FILTER_JIT_CHECK)
    end = error.find(_FILTER_JIT_END, start)
    if start < 0 or end < 0:
        return None
    return error[start + len(_FILTER_JIT_CHECK) : end].strip()


class _ChecksSurfaced:
    """The context manager `checks_surfaced` returns (a class: entered at every
    `kfac_step` call, where a generator's would cost 0.7 µs more)."""

    def __enter__(self) -> None:
        _callback_log.addFilter(_quiet_check)

    def __exit__(self, kind, error, traceback) -> None:
        _callback_log.removeFilter(_quiet_check)
        if isinstance(error, eqx.EquinoxRuntimeError):
            # From a function compiled by `eqx.filter_jit`: the message between
            # its traceback and its debugging advice.
            message = _filter_jit_message(str(error))
            if message is not None:
                raise eqx.EquinoxRuntimeError(message) from None
        elif isinstance(error, (ValueError, jax.errors.JaxRuntimeError)):
            message = _check_message(str(error))
            if message is not None:
                raise eqx.EquinoxRuntimeError(message) from None


_CHECKS_SURFACED = _ChecksSurfaced()


def checks_surfaced() -> _ChecksSurfaced:
    """A context manager: the block's failed `eqx.error_if` check is raised as
    `eqx.EquinoxRuntimeError` with its message alone (older jaxlibs raise the
    callback's error as a `ValueError`), and not logged; other errors as they are."""
    return _CHECKS_SURFACED
