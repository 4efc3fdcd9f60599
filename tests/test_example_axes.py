"""The example-axis analysis (`eqfisher/_example_axes.py`) against Jacobians.

A function of a batch `x` whose examples lie along axis 0 gets the label of its
output: the axis whose slice `[e = n]` depends on example `n` only, or `MIXED`.
Every label the analysis proves is checked with `jax.jacfwd`: the output's slice
`n` has zero derivative with respect to every other example. Functions that mix
examples (batch statistics, sorts, scans, gathers and rolls along the examples,
contractions over them) must not be labelled.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

import eqfisher as ef
from eqfisher import internal


X = jr.normal(jr.key(0), (4, 3, 5), jnp.float64)
W = jr.normal(jr.key(1), (5, 2), jnp.float64)
K = jr.normal(jr.key(2), (2, 3, 3), jnp.float64)  # (out, in, width) conv kernel


def _label(fn, x=X) -> int:
    closed = jax.make_jaxpr(fn)(x)
    (label,) = internal.jaxpr_labels(
        closed.jaxpr, [None] * len(closed.jaxpr.constvars), [0]
    )
    return internal.MIXED if label is None else label


def _scan_time(x):
    def per_example(seq):  # (3, 5): a recurrence over the positions
        def step(h, v):
            h = jnp.tanh(h + v)
            return h, h

        return jax.lax.scan(step, jnp.zeros(5, seq.dtype), seq)[1]

    return jax.vmap(per_example)(x)


def _layer_norm(x):
    return jax.vmap(jax.vmap(eqx.nn.LayerNorm(5, dtype=jnp.float64)))(x)


PER_EXAMPLE = {
    "elementwise": (lambda x: jnp.tanh(x) * 2.0 + 1.0, 0),
    "flatten": (lambda x: jax.vmap(jnp.ravel)(x), 0),
    "transpose": (lambda x: x.transpose(1, 0, 2), 1),
    "reduce_features": (lambda x: jnp.sum(x, axis=(1, 2)), 0),
    "dense": (lambda x: x @ W, 0),
    "batched_dot": (lambda x: jnp.einsum("nij,nkj->nik", x, x), 0),
    "layer_norm": (_layer_norm, 0),
    "gather_features": (lambda x: x[:, jnp.array([1, 0])], 0),
    "vmapped_gather": (lambda x: jax.vmap(lambda v: v[jnp.array([2, 0])])(x), 0),
    "conv": (
        lambda x: jax.lax.conv_general_dilated(x, K, (1,), "SAME"),
        0,
    ),
    "max_pool": (
        lambda x: jax.lax.reduce_window(
            x, -jnp.inf, jax.lax.max, (1, 1, 2), (1, 1, 1), "VALID"
        ),
        0,
    ),
    "cumsum_positions": (lambda x: jnp.cumsum(x, axis=1), 0),
    "sort_features": (lambda x: jnp.sort(x, axis=2), 0),
    "concatenate_features": (
        lambda x: jnp.concatenate([x, jnp.ones((4, 3, 1), x.dtype)], axis=2),
        0,
    ),
    "stack_features": (lambda x: jnp.stack([x, 2.0 * x], axis=2), 0),
    "stack_in_front": (lambda x: jnp.stack([x, jnp.tanh(x)]), 1),
    "pad_positions": (lambda x: jnp.pad(x, ((0, 0), (1, 1), (0, 0))), 0),
    "scan_over_positions": (_scan_time, 0),
    "relu": (jax.nn.relu, 0),
    "where": (lambda x: jnp.where(x > 0, x, 0.1 * x), 0),
    "slice_positions": (lambda x: x[:, 1:], 0),
    "dynamic_slice_positions": (
        lambda x: jax.lax.dynamic_slice_in_dim(x, 1, 2, axis=1),
        0,
    ),
    "softmax": (lambda x: jax.nn.softmax(x, axis=-1), 0),
    "mean_keepdims_broadcast": (lambda x: x - x.mean(axis=-1, keepdims=True), 0),
}

MIXING = {
    "batch_mean": lambda x: x - x.mean(0, keepdims=True),
    "cumsum_examples": lambda x: jnp.cumsum(x, axis=0),
    "sort_examples": lambda x: jnp.sort(x, axis=0),
    "reshape_examples": lambda x: x.reshape(2, 2, 15),
    "roll_examples": lambda x: jnp.roll(x, 1, axis=0),
    "contract_examples": lambda x: jnp.einsum("nij,mij->nm", x, x),
    "reverse_examples": lambda x: x[::-1],
    "gather_examples": lambda x: x[jnp.array([1, 0, 3, 2])],
    "scan_over_examples": lambda x: jax.lax.scan(
        lambda c, v: (c + v, c + v), jnp.zeros_like(x[0]), x
    )[1],
    "one_example_everywhere": lambda x: x * x[:1],
    "concatenate_examples": lambda x: jnp.concatenate([x[1:], x[:1]]),
    "flip_add": lambda x: x + jnp.flip(x, 0),
    "stack_of_rolled": lambda x: jnp.stack([x, jnp.roll(x, 1, axis=0)], axis=1),
}


def _per_example_jacobian_ok(fn, axis: int) -> bool:
    """Whether `fn(X)[e = n]` has zero derivative with respect to `X[m]`, m ≠ n."""
    jac = jax.jacfwd(fn)(X)
    out_rank = jac.ndim - X.ndim
    jac = jnp.moveaxis(jac, axis, 0)  # (n, ..., m, ...)
    jac = jnp.moveaxis(jac, out_rank, 1)  # (n, m, ...)
    n = X.shape[0]
    off = jac * (1 - jnp.eye(n, dtype=jac.dtype)).reshape(
        (n, n) + (1,) * (jac.ndim - 2)
    )
    return bool(jnp.all(off == 0))


@pytest.mark.parametrize("name", list(PER_EXAMPLE))
def test_a_proven_label_is_per_example(name):
    fn, expected = PER_EXAMPLE[name]
    assert _label(fn) == expected
    assert _per_example_jacobian_ok(fn, expected)


@pytest.mark.parametrize("name", list(MIXING))
def test_mixing_is_never_labelled(name):
    assert _label(MIXING[name]) == internal.MIXED


def test_the_jacobian_check_sees_mixing():
    # The check of the first test fails on what the second test expects.
    assert not _per_example_jacobian_ok(MIXING["batch_mean"], 0)
    assert not _per_example_jacobian_ok(MIXING["roll_examples"], 0)


def test_curvature_of_interacting_examples_is_still_refused():
    # BatchNorm with batch statistics before a LayerNorm: K-FAC's exact diagonal
    # for the LayerNorm cannot come from the main pass unchecked.
    class Net(eqx.Module):
        linear: eqx.nn.Linear
        norm: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __call__(self, x):  # a whole batch
            h = jax.vmap(self.linear)(x)
            mean = h.mean(0, keepdims=True)  # batch statistics
            h = (h - mean) / (h.std(0, keepdims=True) + 1.0)
            return jax.vmap(self.head)(jax.vmap(self.norm)(h))

    keys = jr.split(jr.key(3), 2)
    net = Net(
        eqx.nn.Linear(3, 4, key=keys[0], dtype=jnp.float64),
        eqx.nn.LayerNorm(4, dtype=jnp.float64),
        eqx.nn.Linear(4, 2, key=keys[1], dtype=jnp.float64),
    )
    x = jr.normal(jr.key(4), (6, 3), jnp.float64)
    y = jr.normal(jr.key(5), (6, 2), jnp.float64)

    def loss_fn(m, b):
        return ef.squared_error(m(b[0]), b[1])

    with pytest.raises(eqx.EquinoxRuntimeError, match="examples interact"):
        ef.curvature(
            loss_fn, net, (x, y), estimator=ef.GGN(), structure=ef.KFAC()
        ).diagonal()
