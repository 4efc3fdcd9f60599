"""K-FAC at its defaults (only the learning rate swept) against Adam and Muon.

Five small problems on scikit-learn's bundled data, batch 256, random minibatches with
a fixed seed (the same sequence for every run), the full-data training loss after
every step (outside the clock):

- `digits-std`: MLP 64-128-128-10 (relu), standardised inputs, to loss 0.05.
- `digits-16`: the same with inputs / 16, to 0.05.
- `autoencoder`: deep tanh autoencoder 64-128-64-32-8-32-64-128-64 on digits / 16,
  squared error (½‖x̂ − x‖² per example), to 0.8.
- `cnn`: conv 3x3 (8) - conv 3x3 (16) - dense 10 (relu) on the 8x8 digits / 16, to 0.05.
- `diabetes`: MLP 10-64-64-1 (tanh) regression on standardised diabetes data, to 0.15.

Adam is `optax.adam(lr)`, Muon `optax.contrib.muon(lr)` (Adam for its non-matrix
parameters), each with its learning rate swept; the comparison is against the
better of the two in seconds.
K-FAC is `ef.optim.kfac(lr, like=...)` with every other option at its default,
through `ef.optim.kfac_step` with FisherMC(1) + KFAC. Seconds are the steady-state
seconds of the training steps to the target (compilation excluded, reported apart),
the least of three timings of the same run (`--repeats`), taken in three rounds in
which the three optimisers take turns, so that a slow spell of a shared host does
not fall on one of them only.
A run is non-finite when the loss or a parameter becomes NaN/inf.

    python benchmarks/kfac_defaults.py                   # the comparison
    OPENBLAS_NUM_THREADS=1 python benchmarks/kfac_defaults.py
    python benchmarks/kfac_defaults.py --per-step        # ms per step (min of 3 × 40)
    python benchmarks/kfac_defaults.py --compile         # first-call compile, by stage
    python benchmarks/kfac_defaults.py --max-inverse-dim none   # wide factors whole
    python benchmarks/kfac_defaults.py --xla-defaults   # K-FAC without fast_compile
    python benchmarks/kfac_defaults.py --problems cnn --max-inverse-dim 256 \
        --curvature-batch-size 64     # statistics from 64 of the 256 examples

The defaults themselves were chosen by `benchmarks/kfac_grid.py` (every configuration
of damping, norm constraint, momentum, inverse_every and curvature_update_period on
these problems, steps to the target and non-finite runs).
"""

import argparse
import os
import platform
import re
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_diabetes, load_digits

import eqfisher as ef


KFAC_LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
GRID_LRS = (3e-3, 3e-2, 3e-1, 1.0)
ADAM_LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
MUON_LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
BASELINES = {"adam": optax.adam, "muon": optax.contrib.muon}


def _ce(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def _se(model, batch):
    x, y = batch
    return ef.squared_error(jax.vmap(model)(x), y)


class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 8, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(8, 16, 3, padding=1, key=k2)
        self.out = eqx.nn.Linear(16 * 8 * 8, 10, key=k3)

    def __call__(self, x):
        h = jax.nn.relu(self.conv1(x.reshape(1, 8, 8)))
        h = jax.nn.relu(self.conv2(h))
        return self.out(h.reshape(-1))


class Autoencoder(eqx.Module):
    layers: tuple

    def __init__(self, key):
        sizes = (64, 128, 64, 32, 8, 32, 64, 128, 64)
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = tuple(
            eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jnp.tanh(layer(x))
        return self.layers[-1](x)


def problem(name: str, key):
    """(model, x, y, loss_fn, target) as float32 arrays."""
    if name == "diabetes":
        x, y = load_diabetes(return_X_y=True)
        x = (x - x.mean(0)) / x.std(0)
        y = ((y - y.mean()) / y.std())[:, None]
        model = eqx.nn.MLP(10, 1, 64, 2, activation=jnp.tanh, key=key)
        return (
            model,
            jnp.asarray(x, jnp.float32),
            jnp.asarray(y, jnp.float32),
            _se,
            0.15,
        )
    x, labels = load_digits(return_X_y=True)
    x16 = jnp.asarray(x / 16.0, jnp.float32)
    labels = jnp.asarray(labels, jnp.int32)
    if name == "digits-std":
        xs = (x - x.mean(0)) / np.maximum(x.std(0), 1e-6)
        model = eqx.nn.MLP(64, 10, 128, 2, activation=jax.nn.relu, key=key)
        return model, jnp.asarray(xs, jnp.float32), labels, _ce, 0.05
    if name == "digits-16":
        model = eqx.nn.MLP(64, 10, 128, 2, activation=jax.nn.relu, key=key)
        return model, x16, labels, _ce, 0.05
    if name == "autoencoder":
        return Autoencoder(key), x16, x16, _se, 0.8
    if name == "cnn":
        return CNN(key), x16, labels, _ce, 0.05
    raise ValueError(name)


PROBLEMS = ("digits-std", "digits-16", "autoencoder", "cnn", "diabetes")


def minibatches(n: int, max_steps: int, seed: int):
    """The minibatch sequence every run of a problem shares: `(indices, keys)`,
    `max_steps` rows of min(256, n) example indices drawn without replacement, and
    a key per step."""
    rng = np.random.default_rng(seed)
    indices = jnp.asarray(
        np.stack([rng.choice(n, min(256, n), replace=False) for _ in range(max_steps)])
    )
    return indices, jax.random.split(jax.random.key(seed + 1), max_steps)


def make_steps(kind, model, x, y, loss_fn, sample, key, options):
    """`(init_state, step)`; `step(params, state, idx, key, lr)` is jitted once."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    if kind in BASELINES:
        make = BASELINES[kind]

        @eqx.filter_jit
        def step(params, state, idx, key, lr):
            del key
            grads = eqx.filter_grad(loss_fn)(
                eqx.combine(params, static), (x[idx], y[idx])
            )
            updates, state = make(lr).update(grads, state, params)
            return eqx.apply_updates(params, updates), state

        return make(1e-3).init(params), step

    estimator, structure = ef.FisherMC(samples=1), ef.KFAC()
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=estimator, structure=structure)
    like = ef.optim.curvature_like(vgc, model, sample, key=key)
    amortise = {
        name: options.pop(name)
        for name in ("curvature_update_period", "curvature_batch_size")
        if name in options
    }

    # kfac_step's own jit is inlined into this one: compiled as its default would.
    @eqx.filter_jit(compiler_options=kfac_compiler_options(options))
    def step(params, state, idx, key, lr):
        opt = ef.optim.kfac(lr, like=like, **options)
        one = ef.optim.kfac_step(
            loss_fn,
            opt,
            estimator=estimator,
            structure=structure,
            **amortise,
        )
        model, state, _ = one(eqx.combine(params, static), state, (x[idx], y[idx]), key)
        return eqx.filter(model, eqx.is_inexact_array), state

    return ef.optim.kfac(1.0, like=like, **options).init(params), step


def kfac_compiler_options(options: dict) -> dict | None:
    """The compiler options of the K-FAC step: `kfac_step`'s default
    (`ef.optim.fast_compile_options()`), or XLA's defaults when `options` (popped)
    says `xla_defaults`."""
    fast = not options.pop("xla_defaults", False)
    return (ef.optim.fast_compile_options() if fast else {}) or None


def train(step, state0, params, full_loss, indices, keys, lr, target, max_steps):
    """(steps to target or None, seconds to there/end, non-finite?)."""
    lr = jnp.asarray(lr, jnp.float32)
    state, elapsed = state0, 0.0
    first = float(full_loss(params))
    for i in range(max_steps):
        t0 = time.perf_counter()
        params, state = step(params, state, indices[i], keys[i], lr)
        jax.block_until_ready(params)
        elapsed += time.perf_counter() - t0
        loss = float(full_loss(params))
        finite = np.isfinite(loss) and all(
            bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params)
        )
        if not finite:
            return None, elapsed, True
        if loss <= target:
            return i + 1, elapsed, False
        if loss > 100 * first:  # diverged but finite so far
            return None, elapsed, False
    return None, elapsed, False


class Runs:
    """One optimiser on one problem, compiled and warmed up: `sweep` times each
    learning rate's run once from the same state, `retime` times again the runs
    that reached the target (the same steps: the minibatches, keys and state are
    the same) and keeps each one's least seconds."""

    def __init__(self, name, kind, lrs, options, max_steps, seed):
        self.name, self.kind, self.lrs, self.max_steps = name, kind, lrs, max_steps
        model, x, y, loss_fn, self.target = problem(name, jax.random.key(seed))
        self.params, static = eqx.partition(model, eqx.is_inexact_array)
        self.indices, self.keys = minibatches(x.shape[0], max_steps, seed)
        self.full_loss = eqx.filter_jit(
            lambda p: loss_fn(eqx.combine(p, static), (x, y))
        )
        sample = (x[self.indices[0]], y[self.indices[0]])
        self.state0, self.step = make_steps(
            kind, model, x, y, loss_fn, sample, self.keys[0], dict(options)
        )
        lr0 = jnp.asarray(lrs[0], jnp.float32)
        t0 = time.perf_counter()
        jax.block_until_ready(
            self.step(self.params, self.state0, self.indices[0], self.keys[0], lr0)
        )
        self.compile_s = time.perf_counter() - t0
        self.full_loss(self.params)
        # The first executions of a compiled step are slow on XLA:CPU (K-FAC's
        # inverse refresh most): ten untimed warm-up steps, so that every timed
        # run is steady.
        p, s = self.params, self.state0
        for i in range(10):
            p, s = self.step(p, s, self.indices[i], self.keys[i], lr0)
        jax.block_until_ready(p)
        self.rows: list = []

    def _train(self, lr, max_steps):
        return train(
            self.step,
            self.state0,
            self.params,
            self.full_loss,
            self.indices,
            self.keys,
            lr,
            self.target,
            max_steps,
        )

    def sweep(self, verbose=True):
        """`rows`: `(lr, steps or None, seconds, non-finite?)` for each rate (a
        second sweep replaces the first's)."""
        self.rows = []
        for lr in self.lrs:
            reached, secs, nonfinite = self._train(lr, self.max_steps)
            self.rows.append((lr, reached, secs, nonfinite))
            if verbose:
                shown = "-" if reached is None else reached
                print(
                    f"    {self.name:12s} {self.kind:5s} lr={lr:<7g} "
                    f"steps={shown!s:>5} {secs:7.3f} s"
                    f"{'  NON-FINITE' if nonfinite else ''}",
                    flush=True,
                )

    def retime(self):
        for i, (lr, reached, secs, nonfinite) in enumerate(self.rows):
            if reached is None:
                continue
            again = self._train(lr, reached)
            if again[0] == reached:
                self.rows[i] = (lr, reached, min(secs, again[1]), nonfinite)


def best(rows):
    ok = [r for r in rows if r[1] is not None]
    return min(ok, key=lambda r: (r[2], r[1])) if ok else None


def compare(max_steps, seed, problems, options, repeats=1):
    """K-FAC at its defaults against the better of Adam and Muon (each with its
    learning rate swept) in steady-state seconds to the target: the least of
    `repeats` timings of each run that reaches it, the optimisers taking turns (a
    round of every run of each, `repeats` rounds), so that a slow spell of the
    host falls on all three alike."""
    print(_machine(), f"repeats {repeats}")
    table = []
    for name in problems:
        runs = {
            kind: Runs(
                name, kind, lrs, options if kind == "kfac" else {}, max_steps, seed
            )
            for kind, lrs in (
                ("kfac", KFAC_LRS),
                ("adam", ADAM_LRS),
                ("muon", MUON_LRS),
            )
        }
        for r in runs.values():
            r.sweep()
        for _ in range(repeats - 1):
            for r in runs.values():
                r.retime()
        table.append((name, {k: (r.rows, r.compile_s) for k, r in runs.items()}))
    print()
    print(
        "| problem | Adam best lr: steps, s | Muon best lr: steps, s | K-FAC best lr: "
        "steps, s | steps ratio | seconds ratio | K-FAC non-finite | "
        "compile s (K-FAC / Adam / Muon) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    wins = 0
    for name, results in table:
        (k_rows, k_c), (a_rows, a_c), (m_rows, m_c) = (
            results["kfac"],
            results["adam"],
            results["muon"],
        )
        k, a, m = best(k_rows), best(a_rows), best(m_rows)
        nonfinite = sum(r[3] for r in k_rows)

        def cell(b):
            return "never" if b is None else f"{b[0]:g}: {b[1]}, {b[2]:.3f}"

        rivals = [b for b in (a, m) if b is not None]
        if k and rivals:
            # The better rival: the fewer seconds (its steps for the steps ratio).
            rival = min(rivals, key=lambda b: (b[2], b[1]))
            sr, tr = k[1] / rival[1], k[2] / rival[2]
            wins += sr <= 0.5 and tr <= 0.8 and nonfinite == 0
            ratios = f"{sr:.2f} | {tr:.2f}"
        else:
            ratios = "- | -"
        print(
            f"| {name} | {cell(a)} | {cell(m)} | {cell(k)} | {ratios} | "
            f"{nonfinite}/{len(k_rows)} | {k_c:.1f} / {a_c:.1f} / {m_c:.1f} |"
        )
    print(
        "\nproblems meeting the goal against the better of Adam and Muon "
        f"(≤0.5× steps, ≤0.8× s, 0 non-finite): {wins}/{len(table)}"
    )


def add_inverse_dim_argument(parser: argparse.ArgumentParser) -> None:
    """`--max-inverse-dim N|none`, read by `inverse_dim_options`."""
    parser.add_argument(
        "--max-inverse-dim",
        default=None,
        help="eqfisher's FactoredTikhonov max_inverse_dim: an integer or 'none' "
        "(default: its default)",
    )


def inverse_dim_options(value: str | None) -> dict:
    """`ef.optim.kfac` options for a `--max-inverse-dim` argument: none for its
    default, else the damping variant with that `max_inverse_dim` ('none': None)."""
    if value is None:
        return {}
    dim = None if value.lower() == "none" else int(value)
    return {"damping_variant": ef.optim.FactoredTikhonov(max_inverse_dim=dim)}


def _machine() -> str:
    return (
        f"machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'default')}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )


def compile_stages(
    fn, *args, compiler_options: dict | None = None
) -> tuple[float, float, float, int]:
    """Seconds to trace, lower and XLA-compile `jax.jit(fn)` on `args`, from an
    empty compilation cache, and the number of fused kernels XLA compiled."""
    jax.clear_caches()
    t0 = time.perf_counter()
    traced = jax.jit(fn, compiler_options=compiler_options).trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    fusions = len(re.findall(r" fusion\(", compiled.as_text()))
    return t1 - t0, t2 - t1, t3 - t2, fusions


def compile_times(problems, options: dict, repeats: int = 3):
    """First-call compile of one training step, by stage (best of `repeats`): a
    value-and-gradient, Adam, Muon, K-FAC (`kfac_step` at its defaults), and the
    K-FAC optimiser's `init` run eagerly, as a user calls it."""
    print(_machine())
    print(
        "\n| problem | value-and-grad s | Adam s | Muon s | K-FAC s (trace / lower / "
        "XLA) | K-FAC / Adam | eager `init` s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in problems:
        key = jax.random.key(0)
        model, x, y, loss_fn, _ = problem(name, key)
        params, static = eqx.partition(model, eqx.is_inexact_array)
        idx, lr = jnp.arange(min(256, x.shape[0])), jnp.asarray(0.1, jnp.float32)
        sample = (x[idx], y[idx])

        def value_and_grad(params, idx, static=static, loss_fn=loss_fn, x=x, y=y):
            model = eqx.combine(params, static)
            return eqx.filter_value_and_grad(loss_fn)(model, (x[idx], y[idx]))

        times = {"vg": (value_and_grad, (params, idx), None)}
        for kind in ("adam", "muon", "kfac"):
            extra = dict(options) if kind == "kfac" else {}
            compiler_options = (
                kfac_compiler_options(dict(extra)) if kind == "kfac" else None
            )
            state, step = make_steps(kind, model, x, y, loss_fn, sample, key, extra)
            # The jitted step's Python function: compiled here by stage.
            args = (params, state, idx, key, lr)
            times[kind] = (step.__wrapped__, args, compiler_options)
        best = {}
        for kind, (fn, args, compiler_options) in times.items():
            runs = [
                compile_stages(fn, *args, compiler_options=compiler_options)[:3]
                for _ in range(repeats)
            ]
            best[kind] = min(runs, key=sum)
        vgc = ef.value_grad_and_curvature(
            loss_fn, estimator=ef.FisherMC(samples=1), structure=ef.KFAC()
        )
        like = ef.optim.curvature_like(vgc, model, sample, key=key)
        jax.clear_caches()
        t0 = time.perf_counter()
        jax.block_until_ready(ef.optim.kfac(0.1, like=like).init(params))
        init_s = time.perf_counter() - t0
        k = best["kfac"]
        print(
            f"| {name} | {sum(best['vg']):.2f} | {sum(best['adam']):.2f} | "
            f"{sum(best['muon']):.2f} | {sum(k):.2f} ({k[0]:.2f} / {k[1]:.2f} / "
            f"{k[2]:.2f}) | {sum(k) / sum(best['adam']):.1f} | {init_s:.2f} |",
            flush=True,
        )


def _ms_per_step(step, state, params, idx, keys, lr) -> float:
    """Best of three: steady-state milliseconds per call of `step` over 40 batches,
    after 12 calls of compilation and warm-up."""
    p = params
    for i in range(12):
        p, state = step(p, state, idx[i], keys[i], lr)
    jax.block_until_ready(p)
    best_ms = np.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(40):
            p, state = step(p, state, idx[i], keys[i], lr)
        jax.block_until_ready(p)
        best_ms = min(best_ms, (time.perf_counter() - t0) / 40 * 1e3)
    return best_ms


# `curvature_update_period` for steps without statistics (after the first).
NO_STATISTICS = 10**9


def per_step(problems, options: dict, periods=(1, 2, 4)):
    """Steady-state milliseconds per training step: a value-and-gradient, Adam,
    Muon, K-FAC at each period, and K-FAC's step without statistics (measured: a
    period of 10**9, statistics at the first step only, the same compiled `cond`);
    and the two ratios of the per-step targets: that step against Adam's, and a
    statistics step (period 1) against a value-and-gradient."""
    print(_machine())
    print(
        "| problem | value-and-grad ms | Adam ms | Muon ms | "
        + " | ".join(f"K-FAC ms (period {k})" for k in periods)
        + " | K-FAC ms, no statistics | no-statistics step / Adam"
        + " | statistics step / value-and-grad |"
    )
    print("|---|---|---|---|" + "---|" * len(periods) + "---|---|---|")
    for name in problems:
        model, x, y, loss_fn, _ = problem(name, jax.random.key(0))
        params, static = eqx.partition(model, eqx.is_inexact_array)
        n = x.shape[0]
        rng = np.random.default_rng(0)
        idx = jnp.asarray(
            np.stack([rng.choice(n, min(256, n), replace=False) for _ in range(40)])
        )
        keys = jax.random.split(jax.random.key(1), 40)
        lr = jnp.asarray(0.01, jnp.float32)
        sample = (x[idx[0]], y[idx[0]])

        @eqx.filter_jit
        def value_and_grad(
            params, state, i, key, lr, static=static, data=(x, y), loss_fn=loss_fn
        ):
            del key
            model = eqx.combine(params, static)
            batch = (data[0][i], data[1][i])
            _, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
            # A plain gradient step, so that the carry stays the parameters.
            return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads), state

        ms = {"vg": _ms_per_step(value_and_grad, 0, params, idx, keys, lr)}
        runs = [("adam", None), ("muon", None)]
        runs += [("kfac", k) for k in (*periods, NO_STATISTICS)]
        for kind, period in runs:
            extra = (
                {} if period is None else {**options, "curvature_update_period": period}
            )
            state, step = make_steps(kind, model, x, y, loss_fn, sample, keys[0], extra)
            ms[(kind, period)] = _ms_per_step(step, state, params, idx, keys, lr)
        t1, t_none = ms[("kfac", 1)], ms[("kfac", NO_STATISTICS)]
        cells = [ms["vg"], ms[("adam", None)], ms[("muon", None)]]
        cells += [ms[("kfac", k)] for k in (*periods, NO_STATISTICS)]
        print(
            f"| {name} | "
            + " | ".join(f"{c:.2f}" for c in cells)
            + f" | {t_none / ms[('adam', None)]:.2f} | {t1 / ms['vg']:.2f} |",
            flush=True,
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--problems", nargs="*", default=PROBLEMS)
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="time each run that reaches the target this many times and keep the "
        "least seconds (default 3; the runs of the small problems take 20-300 ms, "
        "where one timing is noisy on a shared host)",
    )
    parser.add_argument(
        "--curvature-update-period",
        type=int,
        default=None,
        help="kfac_step's (default: its default)",
    )
    parser.add_argument(
        "--curvature-batch-size",
        type=int,
        default=None,
        help="kfac_step's: statistics from the first N examples (default: all)",
    )
    add_inverse_dim_argument(parser)
    parser.add_argument(
        "--xla-defaults",
        action="store_true",
        help="compile the K-FAC step with XLA's defaults, not kfac_step's "
        "fast_compile options",
    )
    parser.add_argument(
        "--per-step", action="store_true", help="milliseconds per step only"
    )
    parser.add_argument(
        "--compile", action="store_true", help="first-call compile times only"
    )
    args = parser.parse_args()
    options = inverse_dim_options(args.max_inverse_dim)
    if args.xla_defaults:
        options["xla_defaults"] = True
    if args.per_step:
        per_step(args.problems, options)
        return
    if args.compile:
        compile_times(args.problems, options)
        return
    for name in ("curvature_update_period", "curvature_batch_size"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    compare(args.max_steps, args.seed, args.problems, options, args.repeats)


if __name__ == "__main__":
    main()
