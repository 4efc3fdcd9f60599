"""`refused_where`: a check on values that may be concrete or traced."""

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
from jaxtyping import Array, Bool, PyTree


def refused_where(carrier: PyTree, bad: Bool[Array, "..."], message: str) -> PyTree:
    """`carrier`, after checking that `bad` is False everywhere: a concrete `bad`
    that is not raises `ValueError`, a traced one Equinox's runtime error
    (`eqx.error_if`, attached to `carrier`, so the check runs wherever `carrier`
    is used)."""
    if isinstance(bad, jax.core.Tracer):
        return eqx.error_if(carrier, bad, message)
    if bool(jnp.any(bad)):
        raise ValueError(message)
    return carrier
