import jax
import jaxtyping
import pytest


# Reference comparisons are made in float64; rank and dtype promotion are strict so
# that shape or dtype slips in eqfisher fail loudly instead of broadcasting silently.
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture
def unchecked():
    """Turns jaxtyping's runtime checking off, as for users: the annotations reject
    some bad inputs first (with a `TypeCheckError`) when it is on, before eqfisher's
    own `ValueError`/`TypeError` that users see."""
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)
