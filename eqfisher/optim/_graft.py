"""Grafting: one transformation's direction at another's per-leaf step length."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import PyTree

from ._state import all_finite, float_type, sum_squares, where_tree, widened


class GraftState(NamedTuple):
    """State of `graft`: the direction's and the magnitude's states.

    - `direction`: the state of the transformation that gives the direction (for
      `kfac`, its `KFACState`).
    - `magnitude`: the state of the transformation whose step lengths are kept
      (for `kfac`'s default, `optax.scale_by_adam()`'s moments). It is not updated
      by gradients holding NaN or inf.

    !!! Example

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        opt = ef.optim.kfac(1e-2, like=curv)  # grafted onto Adam by default
        state = opt.init(params)
        assert isinstance(state[0], ef.optim.GraftState)
        assert ef.optim.find_kfac_state(state) is state[0].direction
        ```
    """

    direction: PyTree
    magnitude: PyTree


def graft(
    direction: optax.GradientTransformation,
    magnitude: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
    r"""Each leaf of `direction`'s update, rescaled to the length of `magnitude`'s.

    For every parameter leaf, the update is $d \, \lVert m \rVert / \lVert d
    \rVert$: $d$ the leaf's update from `direction` (e.g. a K-FAC preconditioner),
    $m$ the same leaf's update from `magnitude` (e.g. `optax.scale_by_adam()`).
    The curvature chooses where each layer steps, the magnitude how far, so the
    learning rate means what it means for the magnitude's optimiser (as
    Shampoo's grafting, Agarwal et al. 2020). A leaf whose direction is zero (no
    curvature received yet) gets no step, and one whose magnitude is not finite
    gets none either; a direction holding NaN or inf in any leaf gives no step
    at all; gradients holding NaN or inf leave the magnitude's state as it was.
    `magnitude` sees float16 and bfloat16 parameters and gradients in float32
    (in float16, Adam's second moment and `eps` underflow to zero), and keeps its
    state in float32 for them; the update is in each leaf's own dtype.

    **Arguments:**

    - `direction`: the transformation whose update gives the direction; it
      receives the extra arguments of `update` (`curvature=`, `curvature_due=`).
    - `magnitude`: the transformation whose update gives each leaf's length; it
      receives the gradients and `params` only.

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose state is a `GraftState`.

    !!! Example

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        pre = ef.optim.kfac_preconditioner(like=curv, norm_constraint=None)
        opt = ef.optim.graft(pre, optax.scale_by_adam())
        updates, state = opt.update(grads, opt.init(params), params, curvature=curv)
        adam, _ = optax.scale_by_adam().update(grads, optax.scale_by_adam().init(params))
        for u, a in zip(jax.tree.leaves(updates), jax.tree.leaves(adam)):
            assert jnp.allclose(jnp.linalg.norm(u), jnp.linalg.norm(a), rtol=1e-5)
        ```
    """

    def init(params):
        return GraftState(direction.init(params), magnitude.init(widened(params)))

    def update(updates, state, params=None, **extra):
        d, d_state = direction.update(updates, state.direction, params, **extra)
        # optax's own transformations (`scale_by_adam`'s bias correction) mix
        # Python floats with integer counts, which strict dtype promotion refuses.
        with jax.numpy_dtype_promotion("standard"):
            m, m_state = magnitude.update(
                widened(updates), state.magnitude, widened(params)
            )

        d_leaves, treedef = jax.tree_util.tree_flatten(d)
        # Raises when the two transformations' updates differ in structure.
        m_leaves = treedef.flatten_up_to(m)
        if not d_leaves:
            return d, GraftState(d_state, m_state)
        # Every leaf's two norms and scale as vectors: a few kernels for all the
        # leaves' sums and scalar arithmetic, not a few per leaf. (`direction`
        # may have reduced the same sums of squares: XLA computes them once.)
        dtype = float_type([*d_leaves, *m_leaves])
        d_norms = jnp.sqrt(sum_squares(d_leaves).astype(dtype))
        m_norms = jnp.sqrt(sum_squares(m_leaves).astype(dtype))
        # A direction holding NaN or inf anywhere gives no step at all.
        step = jnp.all(jnp.isfinite(d_norms))
        ok = step & (d_norms > 0) & jnp.isfinite(m_norms)
        scales = jnp.where(ok, m_norms / jnp.where(ok, d_norms, 1.0), 0.0)
        out = [
            jnp.where(step, scales[i].astype(x.dtype) * x, jnp.zeros_like(x))
            for i, x in enumerate(d_leaves)
        ]
        # Known before the magnitude's update, the test lets XLA fuse each leaf's
        # select into the kernel that updates that leaf's state.
        m_state = where_tree(all_finite(updates), m_state, state.magnitude)
        return jax.tree_util.tree_unflatten(treedef, out), GraftState(d_state, m_state)

    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]
