import jax


# Reference comparisons are made in float64; rank and dtype promotion are strict so
# that shape or dtype slips in eqfisher fail loudly instead of broadcasting silently.
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
