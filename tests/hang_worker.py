"""Runs the two programs that hung in jaxlib 0.10's batched LAPACK kernels, many times.

`python hang_worker.py [--plain] [--repeats N]`: a scanned GPT's `kfac_step` (compiled
once, run N times, each step refreshing the inverses), then XTrace vmapped over 200
keys (run N times). Prints one line per program and exits 0; a deadlock never
returns, which `test_no_hang.py` catches with a timeout. `--plain` turns eqfisher's
one-matrix-at-a-time factorisations off, to show that the programs do hang without it.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import lineax as lx

import eqfisher as ef
import eqfisher.spectral as sp
from eqfisher import _compat


D, HEADS, T, V, B, BLOCKS = 64, 4, 32, 128, 8, 2


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jr.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
        self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k1)
        self.up = eqx.nn.Linear(D, 4 * D, key=k2)
        self.down = eqx.nn.Linear(4 * D, D, key=k3)

    def __call__(self, x):
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((T, T), bool)))
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: Block
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jr.split(key, 3)
        self.embed = eqx.nn.Embedding(V, D, key=k1)
        self.blocks = eqx.filter_vmap(Block)(jr.split(k2, BLOCKS))
        self.head = eqx.nn.Linear(D, V, use_bias=False, key=k3)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        dyn, static = eqx.partition(self.blocks, eqx.is_array)
        x, _ = jax.lax.scan(lambda x, d: (eqx.combine(d, static)(x), None), x, dyn)
        return jax.vmap(self.head)(x)


def loss_fn(model, batch):
    return ef.softmax_cross_entropy(jax.vmap(model)(batch[0]), batch[1])


def kfac_steps(repeats: int) -> None:
    model = GPT(jr.key(0))
    tokens = jr.randint(jr.key(1), (B, T), 0, V)
    batch = (tokens, jnp.roll(tokens, -1, axis=1))
    est, struct = ef.FisherMC(), ef.KFAC(weight_sharing="reduce")
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=est, structure=struct)
    like = ef.optim.curvature_like(vgc, model, batch, key=jr.key(2))
    # Every step is a statistics step that refreshes the inverses.
    opt = ef.optim.kfac(1e-2, like=like, inverse_every=1)
    step = ef.optim.kfac_step(
        loss_fn, opt, estimator=est, structure=struct, curvature_update_period=1
    )
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    start = time.perf_counter()
    for i in range(repeats):
        model, state, loss = step(model, state, batch, jr.key(3 + i))
    jax.block_until_ready(loss)
    print(f"kfac_step x{repeats}: {time.perf_counter() - start:.1f} s", flush=True)


def xtrace_over_keys(repeats: int) -> None:
    x = jr.normal(jr.key(0), (120, 120))
    op = lx.MatrixLinearOperator(x @ x.T, lx.positive_semidefinite_tag)
    estimate = jax.jit(jax.vmap(lambda k: sp.trace(op, sp.XTrace(matvecs=40), key=k)))
    keys = jr.split(jr.key(1), 200)
    start = time.perf_counter()
    for _ in range(repeats):
        out = estimate(keys)
    jax.block_until_ready(out)
    print(f"XTrace over 200 keys x{repeats}: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.plain:
        _compat.LAPACK_SPLITS_BATCHES = False
    print(f"jaxlib {_compat.JAXLIB_RELEASE}", flush=True)
    kfac_steps(args.repeats)
    xtrace_over_keys(args.repeats)
