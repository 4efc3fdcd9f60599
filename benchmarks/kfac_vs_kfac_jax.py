"""Time to a target loss: eqfisher's K-FAC at its defaults against kfac_jax's best.

MLP 64-512-512-10 (relu) on scikit-learn's digits / 16, batch 1024 drawn at random
(the same sequence for every run), target full-data loss 0.05, evaluated after every
step outside the clock. Seconds are steady-state: each optimiser is compiled and run
for ten untimed warm-up steps first, then every run starts from the same initial
parameters and a fresh optimiser state. Both libraries run in this one process on
the same JAX, so the ratio is measured side by side.

- eqfisher: `ef.optim.kfac(lr, like=...)` and `ef.optim.kfac_step` with every other
  option at its default, FisherMC(1) + KFAC, learning rate swept.
- kfac_jax: `kfac_jax.Optimizer` with fixed hyper-parameters, estimation mode
  "fisher_gradients" (one sampled target per example, as FisherMC(1)), tuned over
  the grid below (learning rate, damping, momentum, norm constraint,
  `curvature_update_period`, `inverse_update_period`); the same parameters, written
  as a dict of `x @ w + b` layers so its automatic registration finds them.

kfac_jax is not a dependency of eqfisher; run this in its own environment (kfac_jax
0.0.8 needs jax 0.9, which eqfisher supports):

    python3 -m venv /tmp/kfacjax-venv
    /tmp/kfacjax-venv/bin/pip install "jax==0.9.0" "jaxlib==0.9.0" kfac-jax==0.0.8 \
        "lineax==0.1.0" equinox optax jaxtyping beartype scikit-learn
    /tmp/kfacjax-venv/bin/pip install --no-deps -e .
    /tmp/kfacjax-venv/bin/python benchmarks/kfac_vs_kfac_jax.py
    OPENBLAS_NUM_THREADS=1 /tmp/kfacjax-venv/bin/python benchmarks/kfac_vs_kfac_jax.py

`--kfac-jax-grid best` runs kfac_jax only near the full grid's best configuration
(8 runs instead of 240), for a rerun in a few minutes; `--max-inverse-dim 256`
splits eqfisher's 513-wide factors in three (its default, 1024, inverts them whole).
"""

import argparse
import itertools
import os
import platform
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import kfac_jax
import numpy as np
from kfac_defaults import (
    add_inverse_dim_argument,
    inverse_dim_options,
    kfac_compiler_options,
)
from sklearn.datasets import load_digits

import eqfisher as ef


BATCH = 1024
TARGET = 0.05
WARMUP = 10
EQFISHER_LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
KFAC_JAX_LRS = (0.03, 0.1, 0.3, 1.0)
KFAC_JAX_DAMPINGS = (1e-3, 1e-2)
KFAC_JAX_MOMENTA = (0.0, 0.9)
KFAC_JAX_CONSTRAINTS = (None, 1e-3, 1e-2)
KFAC_JAX_PERIODS = ((1, 1), (1, 5), (1, 10), (5, 5), (5, 10))  # (curvature, inverse)
FULL_GRID = dict(
    lrs=KFAC_JAX_LRS,
    dampings=KFAC_JAX_DAMPINGS,
    momenta=KFAC_JAX_MOMENTA,
    constraints=KFAC_JAX_CONSTRAINTS,
    periods=KFAC_JAX_PERIODS,
)
# `--kfac-jax-grid best`: the neighbourhood of the full grid's best configuration
# (benchmarks/RESULTS.md), for a rerun in a few minutes.
BEST_GRID = dict(
    lrs=(0.1, 0.3),
    dampings=(1e-3,),
    momenta=(0.0,),
    constraints=(1e-2,),
    periods=((5, 5), (1, 5)),
)


def data():
    x, y = load_digits(return_X_y=True)
    return jnp.asarray(x / 16.0, jnp.float32), jnp.asarray(y, jnp.int32)


def eqfisher_loss(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def to_dict(model):
    """The eqx MLP's parameters as kfac_jax's `x @ w + b` layers."""
    return {
        f"layer{i}": {"w": layer.weight.T, "b": layer.bias}
        for i, layer in enumerate(model.layers)
    }


def kfac_jax_loss(params, batch):
    x, y = batch
    n = len(params)
    for i in range(n):
        x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
        if i < n - 1:
            x = jax.nn.relu(x)
    kfac_jax.register_softmax_cross_entropy_loss(x, y)
    log_p = jax.nn.log_softmax(x)
    return -jnp.mean(jnp.take_along_axis(log_p, y[:, None], axis=1))


def run(step, state0, params0, full_loss, indices, keys, max_steps):
    """(steps to the target or None, steady-state seconds, non-finite?)."""
    params, state, elapsed = params0, state0, 0.0
    for i in range(max_steps):
        t0 = time.perf_counter()
        params, state = step(params, state, indices[i], keys[i])
        jax.block_until_ready(params)
        elapsed += time.perf_counter() - t0
        loss = float(full_loss(params))
        if not np.isfinite(loss):
            return None, elapsed, True
        if loss <= TARGET:
            return i + 1, elapsed, False
    return None, elapsed, False


def warm(step, state, params, indices, keys):
    t0 = time.perf_counter()
    for i in range(WARMUP):
        params, state = step(params, state, indices[i], keys[i])
    jax.block_until_ready(params)
    return time.perf_counter() - t0


def eqfisher_runs(model, x, y, indices, keys, max_steps, periods=None, options=None):
    """eqfisher's runs: at its defaults, learning rate swept, or (with `periods`,
    `(curvature_update_period, inverse_every)` pairs) also over those; `options`
    go to `ef.optim.kfac`."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    estimator, structure = ef.FisherMC(samples=1), ef.KFAC()
    vgc = ef.value_grad_and_curvature(
        eqfisher_loss, estimator=estimator, structure=structure
    )
    like = ef.optim.curvature_like(vgc, model, (x[:BATCH], y[:BATCH]), key=keys[0])
    full_loss = eqx.filter_jit(lambda p: eqfisher_loss(eqx.combine(p, static), (x, y)))
    rows = []
    for lr, period in itertools.product(EQFISHER_LRS, periods or [None]):
        extra = dict(options or {})
        compiler_options = kfac_compiler_options(extra)
        if period is not None:
            extra["inverse_every"] = period[1]
        opt = ef.optim.kfac(lr, like=like, **extra)
        one = ef.optim.kfac_step(
            eqfisher_loss,
            opt,
            estimator=estimator,
            structure=structure,
            **({} if period is None else dict(curvature_update_period=period[0])),
        )

        # kfac_step's own jit is inlined into this one: compiled as its default would.
        @eqx.filter_jit(compiler_options=compiler_options)
        def step(p, state, idx, key, one=one):
            m, state, _ = one(eqx.combine(p, static), state, (x[idx], y[idx]), key)
            return eqx.filter(m, eqx.is_inexact_array), state

        state0 = opt.init(params)
        compile_s = warm(step, state0, params, indices, keys)
        reached, secs, nonfinite = run(
            step, state0, params, full_loss, indices, keys, max_steps
        )
        label = f"lr={lr:g}" + (
            ""
            if period is None
            else f" curvature_update_period={period[0]} inverse_every={period[1]}"
        )
        rows.append((label, reached, secs, nonfinite, compile_s))
        print(f"  eqfisher {label} {reached} steps {secs:.3f} s", flush=True)
    return rows


def kfac_jax_runs(model, x, y, indices, keys, max_steps, grid):
    params = to_dict(model)
    full_loss = jax.jit(lambda p: kfac_jax_loss(p, (x, y)))
    rows = []
    for constraint, (c_period, i_period) in itertools.product(
        grid["constraints"], grid["periods"]
    ):
        optimizer = kfac_jax.Optimizer(
            value_and_grad_func=jax.value_and_grad(kfac_jax_loss),
            l2_reg=0.0,
            use_adaptive_learning_rate=False,
            use_adaptive_momentum=False,
            use_adaptive_damping=False,
            initial_damping=1e-3,
            estimation_mode="fisher_gradients",
            curvature_ema=0.95,
            curvature_update_period=c_period,
            inverse_update_period=i_period,
            norm_constraint=constraint,
            num_burnin_steps=0,
            multi_device=False,
        )
        compiled = False
        for lr, damping, momentum in itertools.product(
            grid["lrs"], grid["dampings"], grid["momenta"]
        ):
            hyper = dict(
                learning_rate=jnp.asarray(lr, jnp.float32),
                momentum=jnp.asarray(momentum, jnp.float32),
                damping=jnp.asarray(damping, jnp.float32),
            )

            def step(p, state, idx, key, hyper=hyper, optimizer=optimizer):
                p, state, _ = optimizer.step(
                    p, state, key, batch=(x[idx], y[idx]), **hyper
                )
                return p, state

            def fresh(optimizer=optimizer):
                # kfac_jax donates parameters and state to `step`: new ones per run.
                p = jax.tree_util.tree_map(jnp.copy, params)
                return p, optimizer.init(p, keys[-1], (x[indices[0]], y[indices[0]]))

            compile_s = 0.0
            if not compiled:
                compile_s = warm(step, *fresh()[::-1], indices, keys)
                compiled = True
            p0, state0 = fresh()
            reached, secs, nonfinite = run(
                step, state0, p0, full_loss, indices, keys, max_steps
            )
            name = (
                f"lr={lr:g} damping={damping:g} momentum={momentum:g} "
                f"norm_constraint={constraint} curvature_update_period={c_period} "
                f"inverse_update_period={i_period}"
            )
            rows.append((name, reached, secs, nonfinite, compile_s))
            print(f"  kfac_jax {name}: {reached} steps {secs:.3f} s", flush=True)
    return rows


def best(rows):
    ok = [r for r in rows if r[1] is not None]
    return min(ok, key=lambda r: (r[2], r[1])) if ok else None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kfac-jax-grid", choices=("full", "best"), default="full")
    parser.add_argument(
        "--eqfisher-periods",
        nargs="*",
        help="tune eqfisher too: curvature_update_period,inverse_every pairs, "
        "e.g. 4,5 5,5 5,10 (default: eqfisher at its defaults)",
    )
    add_inverse_dim_argument(parser)
    parser.add_argument(
        "--xla-defaults",
        action="store_true",
        help="compile eqfisher's step with XLA's defaults",
    )
    args = parser.parse_args()
    options = inverse_dim_options(args.max_inverse_dim)
    if args.xla_defaults:
        options["xla_defaults"] = True
    periods = (
        [tuple(int(v) for v in p.split(",")) for p in args.eqfisher_periods]
        if args.eqfisher_periods
        else None
    )
    grid = FULL_GRID if args.kfac_jax_grid == "full" else BEST_GRID
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, "
        f"kfac_jax {kfac_jax.__version__}, OPENBLAS_NUM_THREADS="
        f"{os.environ.get('OPENBLAS_NUM_THREADS', 'default')}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    x, y = data()
    model = eqx.nn.MLP(64, 10, 512, 2, activation=jax.nn.relu, key=jax.random.key(0))
    rng = np.random.default_rng(args.seed)
    steps = args.max_steps + WARMUP
    indices = jnp.asarray(
        np.stack([rng.choice(x.shape[0], BATCH, replace=False) for _ in range(steps)])
    )
    keys = jax.random.split(jax.random.key(args.seed + 1), steps)
    ours = eqfisher_runs(model, x, y, indices, keys, args.max_steps, periods, options)
    theirs = kfac_jax_runs(model, x, y, indices, keys, args.max_steps, grid)
    o, t = best(ours), best(theirs)
    print("\n| library | best run | steps | seconds | non-finite runs | compile s |")
    print("|---|---|---|---|---|---|")
    name = "eqfisher (defaults)" if periods is None else "eqfisher (tuned)"
    for label, rows, b in ((name, ours, o), ("kfac_jax", theirs, t)):
        nonfinite = sum(r[3] for r in rows)
        compile_s = max(r[4] for r in rows)
        cells = "never | - | -" if b is None else f"{b[0]} | {b[1]} | {b[2]:.3f}"
        print(f"| {label} | {cells} | {nonfinite}/{len(rows)} | {compile_s:.1f} |")
    if o and t:
        print(f"\ntime to target, eqfisher / kfac_jax: {o[2] / t[2]:.2f}")


if __name__ == "__main__":
    main()
