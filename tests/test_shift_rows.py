"""Scale-and-shift rows from the main pass (`eqfisher/_per_example.py`).

The exact diagonals K-FAC keeps for scale-and-shift layers (LayerNorm, a position
table, a GRU's `bias_n`) come from the layer input and output cotangent of the main
pass, per example, instead of a backward pass per example. Checked against dense
float64 GGNs and empirical Fishers from `jax.jacfwd`/`jax.grad` (tests/helpers.py):
a shared cell over every step of a scan, stacked blocks applied by `lax.scan`, a
time-major batch, and the fallbacks (an ambiguous example axis, a loss with
positions under the GGN).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import eqfisher as ef

from .helpers import block_slices, dense_empirical_fisher, dense_ggn, perturbed
from .zoo import GRUClassifier


F64 = jnp.float64


def _f64(tree):
    return jax.tree_util.tree_map(
        lambda x: x.astype(F64) if eqx.is_inexact_array(x) else x, tree
    )


def _ce(labels):
    def loss(out):
        onehot = jax.nn.one_hot(labels, out.shape[-1], dtype=out.dtype)
        return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(out), axis=-1))

    return loss


# --- a GRU over T steps: `bias_n` is a shift used at every step -----------------


def _gru(t=6, n=5):
    model = perturbed(_f64(GRUClassifier(jr.key(0))), jr.key(1))
    x = jr.normal(jr.key(2), (n, t, 2), F64)
    y = jr.randint(jr.key(3), (n,), 0, 4)

    def loss_fn(m, b):
        return ef.softmax_cross_entropy(jax.vmap(m)(b[0]), b[1])

    return loss_fn, model, (x, y), lambda m: jax.vmap(m)(x), _ce(y)


# --- stacked LayerNorm blocks applied by `lax.scan`, and a position table --------


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.norm = eqx.nn.LayerNorm(4)
        self.linear = eqx.nn.Linear(4, 4, key=key)

    def __call__(self, x):  # (T, 4)
        return x + jnp.tanh(jax.vmap(self.linear)(jax.vmap(self.norm)(x)))


class Stack(eqx.Module):
    embed: eqx.nn.Linear
    positions: jax.Array
    blocks: Block
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, t, key):
        k1, k2, k3, k4 = jr.split(key, 4)
        self.embed = eqx.nn.Linear(3, 4, key=k1)
        self.positions = jr.normal(k2, (t, 4))
        self.blocks = eqx.filter_vmap(Block)(jr.split(k3, 3))
        self.norm = eqx.nn.LayerNorm(4)
        self.head = eqx.nn.Linear(4, 2, key=k4)

    def __call__(self, x):  # (T, 3) -> (T, 2)
        h = jax.vmap(self.embed)(x) + self.positions
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def step(h, p):
            return eqx.combine(p, static)(h), None

        h, _ = jax.lax.scan(step, h, params)
        return jax.vmap(self.head)(jax.vmap(self.norm)(h))


def _stack(t=3, n=5, time_major=False):
    model = perturbed(_f64(Stack(t, jr.key(4))), jr.key(5))
    x = jr.normal(jr.key(6), (n, t, 3), F64)
    y = jr.randint(jr.key(7), (n, t), 0, 2)
    if time_major:  # (T, N, F): the model maps over the second axis
        x, y = jnp.swapaxes(x, 0, 1), jnp.swapaxes(y, 0, 1)

        def logits(m, x):
            return jax.vmap(m, in_axes=1, out_axes=1)(x)
    else:

        def logits(m, x):
            return jax.vmap(m)(x)

    def loss_fn(m, b):
        return ef.softmax_cross_entropy(logits(m, b[0]), b[1])

    return loss_fn, model, (x, y), lambda m: logits(m, x), _ce(y)


def _leaf_numbers(model, paths) -> np.ndarray:
    """The ravelled positions of the parameter leaves at `paths` (keystr)."""
    found = jax.tree_util.tree_flatten_with_path(
        eqx.filter(model, eqx.is_inexact_array)
    )
    keys = [jax.tree_util.keystr(p) for p, _ in found[0]]
    slices = block_slices(model)
    assert set(paths) <= set(keys), keys
    return np.concatenate(
        [
            np.arange(slices[i].start, slices[i].stop)
            for i, k in enumerate(keys)
            if k in paths
        ]
    )


GRU_SHIFT = [".cell.bias_n"]
STACK_SHIFTS = [
    ".positions",
    ".blocks.norm.weight",
    ".blocks.norm.bias",
    ".norm.weight",
    ".norm.bias",
]
SETUPS = {
    "gru": (_gru, GRU_SHIFT),
    "stacked_layernorm": (_stack, STACK_SHIFTS),
    "time_major": (lambda: _stack(time_major=True), STACK_SHIFTS),
    # T == N: two location axes of the batch's size, so the per-example pass.
    "ambiguous_axis": (lambda: _stack(t=5, n=5), STACK_SHIFTS),
}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("estimator", [ef.GGN(), ef.FisherExact()], ids=repr)
def test_kfac_shift_diagonals_equal_the_dense_ggn(setup, estimator):
    make, shifts = SETUPS[setup]
    loss_fn, model, batch, outputs, loss_of_outputs = make()
    examples = ef.IndependentExamples(axis=1) if setup == "time_major" else None
    kwargs = {} if examples is None else {"examples": examples}
    ref = dense_ggn(outputs, loss_of_outputs, model)
    curv = ef.curvature(
        loss_fn, model, batch, estimator=estimator, structure=ef.KFAC(), **kwargs
    )
    idx = _leaf_numbers(model, shifts)
    flat = np.asarray(ravel_pytree(curv.diagonal())[0])
    np.testing.assert_allclose(flat[idx], np.diag(ref)[idx], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("setup", ["gru", "stacked_layernorm"])
def test_diagonal_structure_equals_the_dense_empirical_fisher(setup):
    loss_fn, model, batch, _, _ = SETUPS[setup][0]()

    def one(m, example):
        x, y = example
        return loss_fn(m, (x[None], y[None]))

    # With positions, an example's gradient is its loss's over its positions, and
    # the empirical Fisher weighs it as T of the N·T terms of the mean (as the
    # per-example pass does: `ef.Dense()` gives the same).
    n, t = batch[1].shape[0], batch[1].shape[1] if batch[1].ndim > 1 else 1
    ref = dense_empirical_fisher(one, model, batch, weights=jnp.full(n, t / n))
    curv = ef.curvature(
        loss_fn, model, batch, estimator=ef.EmpiricalFisher(), structure=ef.Diagonal()
    )
    flat = np.asarray(ravel_pytree(curv.diagonal())[0])
    np.testing.assert_allclose(flat, np.diag(ref), rtol=1e-10, atol=1e-14)


def _scans(fn, *args) -> int:
    """The `scan`s in the jaxpr of `fn`, counted inside calls but not inside scans."""

    def count(jaxpr) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                total += 1
                continue
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    total += count(inner)
        return total

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


def test_shift_rows_need_no_pass_per_example():
    # The GRU's statistics have the scans they have without its shift: its
    # examples provably do not interact (`eqfisher/_example_axes.py`), so no
    # forward per example checks them, and the per-example pass, which would add
    # a forward and a backward scan, is not run. (The jaxpr holds 4 scans: the
    # forward, two pullbacks and a forward of the loss coefficients whose result
    # is unused, which XLA removes.)
    loss_fn, model, batch, _, _ = _gru()
    with_shift, plain = _scan_counts(loss_fn, model, batch)
    assert with_shift == plain == 4, (with_shift, plain)


def _scan_counts(loss_fn, model, batch) -> tuple[int, int]:
    def scans(**kwargs):
        vgc = ef.value_grad_and_curvature(
            loss_fn, estimator=ef.FisherMC(), structure=ef.KFAC(), **kwargs
        )
        return _scans(lambda m, b: vgc(m, b, key=jr.key(0)), model, batch)

    return scans(), scans(where=~ef.filters.by_path("*bias_n*"))


class TopKGRU(GRUClassifier):
    """A GRU whose step also reads `lax.top_k`, which the example-axis analysis
    has no rule for: it cannot prove the examples independent."""

    def __call__(self, xs):
        def step(h, x):
            h = self.cell(x, h)
            return h + 0.0 * jax.lax.top_k(h, 1)[0], None

        h, _ = jax.lax.scan(step, jnp.zeros(3, F64), xs)
        return self.head(h)


def test_unproven_independence_is_checked_by_a_forward_per_example():
    loss_fn, model, batch, _, _ = _gru()
    model = perturbed(_f64(TopKGRU(jr.key(0))), jr.key(1))
    x, y = batch
    with_shift, plain = _scan_counts(loss_fn, model, batch)
    assert with_shift == plain + 1, (with_shift, plain)  # the check's forward
    ref = dense_ggn(lambda m: jax.vmap(m)(x), _ce(y), model)
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    idx = _leaf_numbers(model, GRU_SHIFT)
    flat = np.asarray(ravel_pytree(curv.diagonal())[0])
    np.testing.assert_allclose(flat[idx], np.diag(ref)[idx], rtol=1e-10, atol=1e-14)
