"""A transformation's state as one flat vector, for models of few parameters."""

import equinox as eqx
import jax
import jax.core
import numpy as np
import optax
from jaxtyping import PyTree


def _flattens(tree: PyTree, max_size: int) -> bool:
    """Whether `tree` is flattened: several leaves of one dtype, at most
    `max_size` elements in all (decided from shapes and dtypes alone, so that
    `init` and every `update` decide alike)."""
    leaves = jax.tree_util.tree_leaves(tree)
    dtypes = {getattr(x, "dtype", None) for x in leaves}
    return (
        len(leaves) > 1
        and len(dtypes) == 1
        and None not in dtypes  # a Python number, say: left to `inner`
        and sum(int(np.size(x)) for x in leaves) <= max_size
    )


def _on_one_device(tree: PyTree) -> bool:
    """Whether every leaf of `tree` is a concrete array on one device."""
    return all(
        isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and len(x.sharding.device_set) == 1
        for x in jax.tree_util.tree_leaves(tree)
    )


# `max_size`'s default: on the CPU an Adam step over flat moments was 2-22% faster
# for MLPs of 26-85 thousand parameters, equal at 300 thousand, 9% slower at 1.1
# million and 74% slower at 4.3 million (the concatenation's memory traffic);
# `benchmarks/RESULTS.md`, "Issue 26, ninth session".
def flatten_if_small(
    inner: optax.GradientTransformation, max_size: int = 2**17
) -> optax.GradientTransformationExtraArgs:
    r"""`inner` on one flat vector (`optax.flatten`) where the parameters are few,
    else on the parameters' own leaves.

    A small model's step spends its time on many small kernels, one or a few per
    parameter leaf and state leaf; over one vector they become a few kernels, at
    the cost of concatenating every leaf each step. The updates are the same (to
    rounding). Parameters of several dtypes are never flattened (that would
    promote them), nor more than `max_size` of them. Parameters sharded over
    several devices are concatenated like any others, which gathers them; give
    `inner` itself for those. `kfac`'s default
    `graft=flatten_if_small(optax.scale_by_adam())` uses it for Adam's moments.

    **Arguments:**

    - `inner`: any optax transformation.
    - `max_size`: the largest number of parameters flattened (default $2^{17}$,
      131,072: on the CPU an Adam step over one vector was up to a fifth faster
      below it and slower above a million, `benchmarks/RESULTS.md`).

    **Returns:**

    An `optax.GradientTransformationExtraArgs`; its state is `inner`'s, over one
    vector or over the parameters' leaves, decided at `init` from the parameters'
    shapes and dtypes, and alike at every `update`.

    **Raises:**

    `ValueError` when `max_size` is not a non-negative integer.

    !!! Example

        ```python
        adam = ef.optim.flatten_if_small(optax.scale_by_adam())
        state = adam.init(params)  # a few hundred parameters: one vector each
        assert state.mu.ndim == 1
        updates, state = adam.update(grads, state)
        expected, _ = optax.scale_by_adam().update(grads, optax.scale_by_adam().init(params))
        for u, e in zip(jax.tree.leaves(updates), jax.tree.leaves(expected)):
            assert jnp.allclose(u, e, atol=1e-6)
        ```
    """
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 0:
        raise ValueError(
            "`eqfisher.optim.flatten_if_small(max_size=...)`: a non-negative "
            f"integer (the most parameters kept as one vector), got {max_size!r}."
        )
    # Indexed by whether a tree is flattened.
    transforms = (optax.with_extra_args_support(inner), optax.flatten(inner))
    # Called eagerly, an init compiles a program per distinct leaf shape (each
    # zero moment, and the flat one's reshapes and concatenation): one program
    # instead (its leaves that are not arrays, if any, returned as they are), run
    # on the parameters' device (`keep_unused`: an init that reads only their
    # shapes would otherwise run on the default device).
    # (`filter_jit` passes `keep_unused` on to `jax.jit`; its overloads omit it.)
    compiled_inits = tuple(
        eqx.filter_jit(t.init, keep_unused=True)  # pyright: ignore[reportCallIssue]
        for t in transforms
    )

    def init(params):
        flat = _flattens(params, max_size)
        # Arrays on several devices keep the eager init: `jax.jit` asks for a mesh
        # context to read arrays of explicitly sharded axes.
        if _on_one_device(params):
            return compiled_inits[flat](params)
        return transforms[flat].init(params)

    def update(updates, state, params=None, **extra):
        return transforms[_flattens(updates, max_size)].update(
            updates, state, params, **extra
        )

    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]
