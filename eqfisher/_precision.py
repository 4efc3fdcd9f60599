"""The dtype in which eqfisher accumulates a half-precision model's numbers."""

import jax.numpy as jnp


def at_least_float32(dtype) -> jnp.dtype:
    """`dtype`, or float32 where it is narrower (float16, bfloat16): statistics,
    sums over examples and hyperparameters are kept there. (In float16 a count
    above 65,504 is inf, and in bfloat16 a sum of a few hundred terms has lost
    its third digit.)"""
    return jnp.dtype(jnp.float32) if jnp.finfo(dtype).bits < 32 else jnp.dtype(dtype)
