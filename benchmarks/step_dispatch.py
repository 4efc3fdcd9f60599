"""Milliseconds a training step as a user calls it, dispatch included.

`kfac_defaults.py --per-step` times every optimiser inside the same outer
`eqx.filter_jit` (it slices the batch inside the jit), so it compares the compiled
steps and charges every one equinox's dispatch. Here each step is called as a user
calls it, on a batch sliced beforehand (40 batches of 256, the same for all):

- Adam and Muon as Equinox users write them: `optax.adam(lr)` /
  `optax.contrib.muon(lr)` in an `eqx.filter_jit` step over `(model, state, batch)`;
- K-FAC: `ef.optim.kfac_step`'s step, called on `(model, state, batch, key)`;
  without statistics (a `curvature_update_period` of 10**9: statistics at the
  first step only), the same with `donate=True`, and at the default period 2;
- the same K-FAC step jitted by `eqx.filter_jit` with the same compiler options:
  what `kfac_step` dispatched with before it flattened its own calls.

The median of seven rounds that take the steps in turn, 40 steps each, after 40
untimed steps of each, on the five problems of `kfac_defaults.py`: taking the steps
in turn lets a change in the host's speed reach all of them alike (best of five
runs of each step in a row, as this script did before, put K-FAC's step without
statistics at 1.07-1.45 times Adam's on digits-std in three runs).

    python benchmarks/step_dispatch.py
    OPENBLAS_NUM_THREADS=1 python benchmarks/step_dispatch.py
"""

import argparse
import inspect
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from kfac_defaults import PROBLEMS, _machine, problem

import eqfisher as ef


NO_STATISTICS = 10**9


def _copy_array(x):
    return jnp.copy(x) if eqx.is_array(x) else x


def _run(step, carry, batches, keys) -> tuple[float, tuple]:
    """Milliseconds a step over `batches`, and the `(model, state)` carried on."""
    model, state = carry
    t0 = time.perf_counter()
    for batch, key in zip(batches, keys):
        model, state, _ = step(model, state, batch, key)
    jax.block_until_ready((model, state))
    return (time.perf_counter() - t0) / len(batches) * 1e3, (model, state)


def _interleaved(steps: dict, rounds: int, batches, keys) -> dict[str, float]:
    """Each step's median milliseconds over `rounds` rounds that take the steps in
    turn (one pass over `batches` each), after one untimed pass of each: drift of
    the host's speed during the measurement reaches every step alike."""
    carries = {}
    for tag, (step, carry) in steps.items():
        carries[tag] = _run(step, carry, batches, keys)[1]
    times: dict[str, list[float]] = {tag: [] for tag in steps}
    for _ in range(rounds):
        for tag, (step, _) in steps.items():
            ms, carries[tag] = _run(step, carries[tag], batches, keys)
            times[tag].append(ms)
    return {tag: float(np.median(t)) for tag, t in times.items()}


def measure(name: str, rounds: int) -> dict[str, float]:
    model, x, y, loss_fn, _ = problem(name, jax.random.key(0))
    params = eqx.filter(model, eqx.is_inexact_array)
    rng = np.random.default_rng(0)
    picks = [
        rng.choice(x.shape[0], min(256, x.shape[0]), replace=False) for _ in range(40)
    ]
    batches = [(x[jnp.asarray(i)], y[jnp.asarray(i)]) for i in picks]
    keys = list(jax.random.split(jax.random.key(1), 40))
    steps = {}
    for kind, make in (("adam", optax.adam), ("muon", optax.contrib.muon)):

        @eqx.filter_jit
        def step(model, state, batch, key, make=make):
            del key
            grads = eqx.filter_grad(loss_fn)(model, batch)
            updates, state = make(1e-3).update(
                grads, state, eqx.filter(model, eqx.is_inexact_array)
            )
            return eqx.apply_updates(model, updates), state, None

        steps[kind] = (step, (model, make(1e-3).init(params)))
    estimator, structure = ef.FisherMC(samples=1), ef.KFAC()
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=estimator, structure=structure)
    like = ef.optim.curvature_like(vgc, model, batches[0], key=keys[0])
    opt = ef.optim.kfac(1e-2, like=like)
    runs = (
        ("kfac", NO_STATISTICS, False),
        ("kfac donated", NO_STATISTICS, True),
        ("kfac period 2", 2, False),
    )
    for tag, period, donate in runs:
        step = ef.optim.kfac_step(
            loss_fn,
            opt,
            estimator=estimator,
            structure=structure,
            curvature_update_period=period,
            donate=donate,
        )
        # A copy: a donated step deletes the arrays it is given.
        steps[tag] = (
            step,
            jax.tree_util.tree_map(_copy_array, (model, opt.init(params))),
        )
        if tag == "kfac":
            options = ef.optim.fast_compile_options() or None
            # eqx's typed overloads leave out the `**jitkwargs` it passes to jax.jit.
            by_eqx = eqx.filter_jit(inspect.unwrap(step), compiler_options=options)  # pyright: ignore[reportCallIssue]
            steps["kfac, eqx.filter_jit"] = (by_eqx, (model, opt.init(params)))
    return _interleaved(steps, rounds, batches, keys)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS))
    parser.add_argument(
        "--rounds", type=int, default=7, help="timed rounds of every step (default 7)"
    )
    args = parser.parse_args()
    print(_machine())
    print(
        "| problem | Adam ms | Muon ms | K-FAC ms, no statistics | the same by "
        "`eqx.filter_jit` | the same, `donate=True` | K-FAC ms, period 2 "
        "| no statistics / Adam | donated / Adam |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.problems:
        ms = measure(name, args.rounds)
        print(
            f"| {name} | {ms['adam']:.2f} | {ms['muon']:.2f} | {ms['kfac']:.2f} | "
            f"{ms['kfac, eqx.filter_jit']:.2f} | {ms['kfac donated']:.2f} | "
            f"{ms['kfac period 2']:.2f} | {ms['kfac'] / ms['adam']:.2f} | "
            f"{ms['kfac donated'] / ms['adam']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
