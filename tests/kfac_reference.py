"""K-FAC factors of an `eqx.nn.MLP` and dense GGN-type matrices, in plain JAX.

Written without eqfisher: the forward pass is spelled out layer by layer, output
Jacobians come from `jax.jacfwd` and loss Hessians from `jax.hessian`. Rows and
columns of dense matrices follow `ravel_pytree(eqx.filter(model, eqx.is_inexact_array))`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .helpers import block_slices, ravelled


def _identity(h):
    return h


def cross_entropy(z, y):
    """One example's softmax cross-entropy against an integer label."""
    return -jax.nn.log_softmax(z)[y]


def _layer_inputs(model, x):
    """One example's inputs of each layer of `model` (an MLP)."""
    h, inputs = x, []
    for k, lin in enumerate(model.layers):
        inputs.append(h)
        s = lin.weight @ h + lin.bias
        h = model.activation(s) if k < len(model.layers) - 1 else s
    return inputs


def _tail(model, k, s):
    """The MLP's output as a function of layer k's output (pre-activation) s."""
    h = model.activation(s) if k < len(model.layers) - 1 else s
    for j in range(k + 1, len(model.layers)):
        lin = model.layers[j]
        s = lin.weight @ h + lin.bias
        h = model.activation(s) if j < len(model.layers) - 1 else s
    return h


@eqx.filter_jit
def loss_hessians(model, x, y, transform=_identity):
    """Each example's Hessian of its loss in the model outputs, `transform`ed
    (e.g. to its diagonal), weighted 1/N: `(N, out, out)`."""
    z = jax.vmap(model)(x)
    hess = jax.vmap(jax.hessian(cross_entropy))(z, y)
    return jax.vmap(transform)(hess) / x.shape[0]


def kfac_factors(model, x, y, k, transform=_identity):
    """K-FAC's (A, G) of layer k, as NumPy arrays (see `_kfac_factors`)."""
    return tuple(np.asarray(f) for f in _kfac_factors(model, x, y, k, transform))


@eqx.filter_jit
def _kfac_factors(model, x, y, k, transform):
    """K-FAC's (A, G) of layer k: A = mean ã ãᵀ (ã = [a; 1]), G = Σₙ Jₙᵀ Hₙ Jₙ with
    Jₙ the Jacobian of the output in the layer's output."""
    a = jax.vmap(lambda ex: _layer_inputs(model, ex)[k])(x)
    a = jnp.concatenate([a, jnp.ones((a.shape[0], 1), a.dtype)], axis=1)
    lin = model.layers[k]
    s = jax.vmap(lambda ex: lin.weight @ _layer_inputs(model, ex)[k] + lin.bias)(x)
    jac = jax.vmap(jax.jacfwd(lambda v: _tail(model, k, v)))(s)
    hess = loss_hessians(model, x, y, transform)
    g = jnp.einsum("noi,nop,npj->ij", jac, hess, jac)
    return a.T @ a / x.shape[0], g


def kronecker_dense(a, g):
    """G ⊗ A in the ravel order of the operand `(weight, bias)` of a Linear."""
    d_out, d_in = g.shape[0], a.shape[0] - 1
    # vec(M) index of each operand coordinate, M = [W, b] row-major.
    matrix = np.arange(d_out * (d_in + 1)).reshape(d_out, d_in + 1)
    order = np.concatenate([matrix[:, :d_in].ravel(), matrix[:, d_in]])
    return np.kron(g, a)[np.ix_(order, order)]


def dense_ggn(model, x, y, transform=_identity):
    """Σₙ Jₙᵀ Hₙ Jₙ over the ravelled parameters (Hₙ weighted 1/N, transformed)."""
    return np.asarray(_dense_ggn(model, x, y, transform))


@eqx.filter_jit
def _dense_ggn(model, x, y, transform):
    flat, rebuild = ravelled(model)
    jac = jax.vmap(lambda ex: jax.jacfwd(lambda f: rebuild(f)(ex))(flat))(x)
    hess = loss_hessians(model, x, y, transform)
    return jnp.einsum("nai,nab,nbj->ij", jac, hess, jac)


def layer_slice(model, k) -> np.ndarray:
    """The ravelled-parameter indices of layer k's weight and bias."""
    params = eqx.filter(model, eqx.is_inexact_array)
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ]
    slices = block_slices(model)
    picked = [s for p, s in zip(paths, slices) if p.startswith(f".layers[{k}].")]
    return np.concatenate([np.arange(s.start, s.stop) for s in picked])


@eqx.filter_jit
def as_matrix(operator) -> jax.Array:
    """`operator.as_matrix()`, compiled (eagerly, each operation compiles alone)."""
    return operator.as_matrix()
