"""What each estimator × structure costs: time to build, time to solve, memory.

For the docs' "Which curvature do I want?" guide. One MLP on digits-sized data
(64 inputs, two hidden layers of 32, 10 classes: 3,466 parameters, small enough for
`Dense()`), a batch of 256, float32 on CPU. For every pair, `ef.curvature` is jitted
once and timed over repeated calls (the fastest, steady state), then `solve(g, 1e-3)` on
the gradient; the memory is the number of floats the curvature stores. A
`value_and_grad` of the same loss is the unit of time.

Run it alone on one core, e.g. `taskset -c 1 python benchmarks/curvature_cost.py`;
it prints a Markdown table (the one in docs/choosing.md and
benchmarks/curvature_cost.md).
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import eqfisher as ef


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def best_seconds(fn, *args, repeats: int, budget_s: float = 5.0) -> float:
    """The fastest of `repeats` calls after two untimed ones (compilation, warm-up),
    or of as many as fit in `budget_s`. The minimum, not the median: on a shared
    core, other processes only add time."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s and len(times) >= 3:
            break
    return min(times)


def main(repeats: int = 20, batch_size: int = 256, width: int = 32) -> list[dict]:
    key = jax.random.key(0)
    model = eqx.nn.MLP(64, 10, width, 2, activation=jnp.tanh, key=key)
    x = jax.random.uniform(jax.random.key(1), (batch_size, 64))
    y = jax.random.randint(jax.random.key(2), (batch_size,), 0, 10)
    batch = (x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    n_params = sum(p.size for p in jax.tree_util.tree_leaves(params))

    grad_fn = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))
    unit = best_seconds(grad_fn, model, batch, repeats=repeats)
    grads = grad_fn(model, batch)[1]

    estimators = {
        "GGN": ef.GGN(),
        "FisherExact": ef.FisherExact(),
        "FisherMC(samples=1)": ef.FisherMC(samples=1),
        "EmpiricalFisher": ef.EmpiricalFisher(),
    }
    structures = {
        "Dense": ef.Dense(),
        "BlockDiagonal": ef.BlockDiagonal(),
        "Diagonal": ef.Diagonal(),
        "KFAC": ef.KFAC(),
        "EKFAC": ef.EKFAC(),
    }
    rows = []
    for s_name, structure in structures.items():
        for e_name, estimator in estimators.items():

            @eqx.filter_jit
            def build(model, batch, key, estimator=estimator, structure=structure):
                return ef.curvature(
                    loss_fn,
                    model,
                    batch,
                    estimator=estimator,
                    structure=structure,
                    key=key,
                )

            curv = build(model, batch, key)
            build_s = best_seconds(build, model, batch, key, repeats=repeats)
            solve = eqx.filter_jit(lambda c, g: c.solve(g, 1e-3))
            solve_s = best_seconds(solve, curv, grads, repeats=repeats)
            floats = sum(
                a.size
                for a in jax.tree_util.tree_leaves(eqx.filter(curv, eqx.is_array))
            )
            rows.append(
                dict(
                    structure=s_name,
                    estimator=e_name,
                    build_ms=1e3 * build_s,
                    build_rel=build_s / unit,
                    solve_ms=1e3 * solve_s,
                    floats=floats,
                )
            )
            print(
                f"{s_name:14s} {e_name:20s} build {1e3 * build_s:8.2f} ms "
                f"({build_s / unit:6.1f}× grad)  solve {1e3 * solve_s:8.3f} ms  "
                f"{floats:,} floats",
                flush=True,
            )

    print()
    print(
        f"MLP 64-{width}-{width}-10, {n_params:,} parameters, batch {batch_size}, "
        f"float32, {jax.default_backend().upper()}, jax {jax.__version__}; "
        f"value_and_grad: {1e3 * unit:.2f} ms (fastest of {repeats})."
    )
    print()
    print(
        "| structure | estimator | build (ms) | build ÷ value_and_grad "
        "| solve (ms) | floats stored |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| `{r['structure']}()` | `{r['estimator']}` | {r['build_ms']:.2f} "
            f"| {r['build_rel']:.1f} | {r['solve_ms']:.3f} | {r['floats']:,} |"
        )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args()
    main(args.repeats, args.batch_size, args.width)
