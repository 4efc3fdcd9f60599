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
        return eqx.error_if(carrier, bad, message)
    if bool(jnp.any(bad)):
        raise ValueError(message if got is None else f"{message} Got {got()}.")
    return carrier
