import os


# Eight CPU devices; must be set before JAX initialises its backend. `.ci/run` also
# sets it in the environment of this pytest process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402


jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
