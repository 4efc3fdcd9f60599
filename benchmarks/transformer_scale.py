"""K-FAC statistics on scanned models: first-call (compile) and steady-state time
against `eqx.filter_value_and_grad`, and the peak memory of a 32k-vocabulary model.

The "before" numbers of issue 14 (statistics through `lax.scan`):

- a GPT-style model: token embedding + positions, N blocks (LayerNorm, causal
  `eqx.nn.MultiheadAttention`, LayerNorm, MLP 4d) built with `eqx.filter_vmap` and
  applied with `lax.scan`, final LayerNorm, head; d = 64, T = 32, batch 8,
  vocabulary 512; N = 4 and 12;
- a GRU (`eqx.nn.GRUCell`, 4 units) over T = 32, 100, 200 steps, a linear head on
  the last state;
- statistics: `ef.value_grad_and_curvature` with `FisherMC()` and
  `KFAC(weight_sharing="reduce")` / `"expand"`, jitted; the reference is
  `eqx.filter_value_and_grad` of the same loss, jitted.

"first" is the first call (tracing, compilation and one run), "steady" the median
of later calls. `--rounds R` then repeats both in R rounds that run the three
functions one after another (fresh functions, JAX's caches cleared), and reports
the median of the rounds' ratios: on a shared machine, whose speed drifts by tens
of percent within a minute, this is the comparison that holds still. Both are
wall-clock seconds, with the process's CPU seconds alongside ("cpu"), which are
what a busy machine distorts least.

`--memory` runs a GPT with a 32,000-token vocabulary, d = 256 (4 blocks, T = 32,
batch 8): `ef.memory_estimate` (from shapes) with and without
`KFAC(max_factor_dim=...)`, then K-FAC statistics and optimiser steps with
`max_factor_dim`, and the peak resident memory (`resource.getrusage`). Run it in
its own process so that the peak is its own:

    OPENBLAS_NUM_THREADS=1 taskset -c 1 python benchmarks/transformer_scale.py
    OPENBLAS_NUM_THREADS=1 taskset -c 1 python benchmarks/transformer_scale.py --memory
"""

import argparse
import functools
import os
import platform
import resource
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import eqfisher as ef


# --- models ---------------------------------------------------------------------


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d: int, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(d)
        self.attention = eqx.nn.MultiheadAttention(4, d, key=k1)
        self.norm2 = eqx.nn.LayerNorm(d)
        self.up = eqx.nn.Linear(d, 4 * d, key=k2)
        self.down = eqx.nn.Linear(4 * d, d, key=k3)

    def __call__(self, x):  # (T, d)
        t = x.shape[0]
        h = jax.vmap(self.norm1)(x)
        causal = jnp.tril(jnp.ones((t, t), bool))
        x = x + self.attention(h, h, h, mask=causal)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


class GPT(eqx.Module):
    embedding: eqx.nn.Embedding
    positions: jax.Array
    blocks: Block  # stacked: every leaf has a leading axis of size N
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, n: int, d: int, vocabulary: int, t: int, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embedding = eqx.nn.Embedding(vocabulary, d, key=k1)
        self.positions = 0.02 * jax.random.normal(k2, (t, d))
        self.blocks = eqx.filter_vmap(lambda k: Block(d, k))(jax.random.split(k3, n))
        self.norm = eqx.nn.LayerNorm(d)
        self.head = eqx.nn.Linear(d, vocabulary, key=k4)

    def __call__(self, tokens):  # (T,) -> (T, vocabulary)
        x = jax.vmap(self.embedding)(tokens) + self.positions
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def step(x, block):
            return eqx.combine(block, static)(x), None

        x, _ = jax.lax.scan(step, x, dynamic)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def gpt_problem(n, d=64, vocabulary=512, t=32, batch=8):
    model = GPT(n, d, vocabulary, t, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (batch, t + 1), 0, vocabulary)
    return model, (tokens[:, :-1], tokens[:, 1:])


def gpt_loss(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


class GRU(eqx.Module):
    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, inputs: int, units: int, classes: int, key):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(inputs, units, key=k1)
        self.head = eqx.nn.Linear(units, classes, key=k2)

    def __call__(self, xs):  # (T, inputs)
        def step(h, x):
            return self.cell(x, h), None

        h, _ = jax.lax.scan(step, jnp.zeros(self.cell.hidden_size), xs)
        return self.head(h)


def gru_problem(t, batch=8, inputs=3, units=4, classes=2):
    model = GRU(inputs, units, classes, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (batch, t, inputs))
    y = jax.random.randint(jax.random.key(2), (batch,), 0, classes)
    return model, (x, y)


gru_loss = gpt_loss  # softmax cross-entropy of vmap(model)(x) against y


# --- timing ---------------------------------------------------------------------


def _timed(fn, repeats=5):
    """`(first wall, first cpu, steady wall, steady cpu)` in seconds of `fn()`."""
    w, c = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    first = time.perf_counter() - w, time.process_time() - c
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn())
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return (*first, statistics.median(walls), statistics.median(cpus))


def _functions(loss_fn):
    """The jitted reference and the K-FAC statistics, by name."""
    fns = {"value_and_grad": eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))}
    for sharing in ("reduce", "expand"):
        fns[sharing] = eqx.filter_jit(
            ef.value_grad_and_curvature(
                loss_fn,
                estimator=ef.FisherMC(),
                structure=ef.KFAC(weight_sharing=sharing),
            )
        )
    return fns


def _call(name, fn, model, batch):
    if name == "value_and_grad":
        return fn(model, batch)
    return fn(model, batch, key=jax.random.key(0))


def compare(name, loss_fn, model, batch):
    fns = _functions(loss_fn)
    base = None
    for label, fn in fns.items():
        t = _timed(functools.partial(_call, label, fn, model, batch))
        line = (
            f"{name:<14} {label:<18} first {t[0]:7.2f} s (cpu {t[1]:6.2f})"
            f"  steady {1e3 * t[2]:8.2f} ms (cpu {1e3 * t[3]:8.2f})"
        )
        if base is None:
            base = t
        else:
            line += (
                f"   ratios: first {t[0] / base[0]:5.2f}x (cpu {t[1] / base[1]:5.2f}x),"
                f" steady {t[2] / base[2]:5.2f}x (cpu {t[3] / base[3]:5.2f}x)"
            )
        print(line, flush=True)


def interleaved(name, loss_fn, model, batch, rounds):
    """First-call and steady-state ratios from `rounds` rounds that time the three
    functions one after another, so that a slow spell of a shared machine falls on
    all three: each round builds the functions afresh and clears JAX's caches, so
    that the first call traces and compiles again; steady is the median of 9 later
    calls. Reported: the median over rounds of each round's ratio to
    `value_and_grad`."""
    ratios = {"reduce": ([], []), "expand": ([], [])}
    for _ in range(rounds):
        times = {}
        for label, fn in _functions(loss_fn).items():
            jax.clear_caches()
            t = _timed(functools.partial(_call, label, fn, model, batch), repeats=9)
            times[label] = (t[0], t[2])
        for label, (first_r, steady_r) in ratios.items():
            first_r.append(times[label][0] / times["value_and_grad"][0])
            steady_r.append(times[label][1] / times["value_and_grad"][1])
    for label, (first_r, steady_r) in ratios.items():
        print(
            f"{name:<14} K-FAC {label:<7} over {rounds} interleaved rounds: first "
            f"{statistics.median(first_r):5.2f}x "
            f"(rounds {', '.join(f'{r:.2f}' for r in first_r)}), steady "
            f"{statistics.median(steady_r):5.2f}x "
            f"(rounds {', '.join(f'{r:.2f}' for r in steady_r)})",
            flush=True,
        )


def memory(max_factor_dim=4096, steps=3):
    model, batch = gpt_problem(4, d=256, vocabulary=32_000)
    estimator = ef.FisherMC()
    for m in (None, max_factor_dim):
        structure = ef.KFAC(weight_sharing="reduce", max_factor_dim=m)
        vgc = ef.value_grad_and_curvature(
            gpt_loss, estimator=estimator, structure=structure
        )
        like = ef.optim.curvature_like(vgc, model, batch, key=jax.random.key(0))
        opt = ef.optim.kfac(1e-2, like=like)
        estimate = ef.memory_estimate(
            gpt_loss,
            model,
            batch,
            estimator=estimator,
            structure=structure,
            key=jax.random.key(0),
            optimiser=opt,
        )
        print(f"\nmemory_estimate, KFAC(max_factor_dim={m}):\n{estimate}", flush=True)
    step = ef.optim.kfac_step(gpt_loss, opt, estimator=estimator, structure=structure)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    w = time.perf_counter()
    for i in range(steps):
        model, state, loss = step(model, state, batch, jax.random.key(i))
        jax.block_until_ready(loss)
        if i == 0:
            first = time.perf_counter() - w
    rest = (time.perf_counter() - w - first) / max(steps - 1, 1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(
        f"\nK-FAC steps (statistics every step, max_factor_dim={max_factor_dim}): "
        f"first {first:.1f} s, then {rest:.2f} s/step, loss {float(loss):.3f}; "
        f"peak RSS {peak:.2f} GiB",
        flush=True,
    )


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory", action="store_true", help="the 32k-vocab run")
    parser.add_argument("--gpt", type=int, nargs="*", default=[4, 12])
    parser.add_argument("--gru", type=int, nargs="*", default=[32, 100, 200])
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="then this many interleaved compile/steady rounds per model",
    )
    args = parser.parse_args()
    print(
        f"jax {jax.__version__}, eqfisher {ef.__version__}, {_cpu()}, "
        f"affinity {sorted(os.sched_getaffinity(0))}, "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}, "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    if args.memory:
        memory()
        return
    problems = [(f"GPT N={n}", gpt_loss, *gpt_problem(n)) for n in args.gpt]
    problems += [(f"GRU T={t}", gru_loss, *gru_problem(t)) for t in args.gru]
    for problem in problems:
        compare(*problem)
        if args.rounds:
            interleaved(*problem, args.rounds)


if __name__ == "__main__":
    main()
