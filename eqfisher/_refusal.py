"""`refused_where`: a check on values that may be concrete or traced."""

from collections.abc import Callable
from typing import TypeVar

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
from jaxtyping import Array, Bool


_Carrier = TypeVar("_Carrier")


def refused_where(
    carrier: _Carrier,
    bad: Bool[Array, "..."],
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
    if bool(jnp.any(bad)):
        raise ValueError(message if got is None else f"{message} Got {got()}.")
    return carrier


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
