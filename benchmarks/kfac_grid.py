"""The K-FAC defaults grid: steps to the target and non-finite runs, all runs at once.

Every configuration of a problem trains in one compiled program: a `lax.scan` over
the steps (the K-FAC state has one PyTree structure from `init` on) inside a `vmap`
over learning rate × damping × norm constraint × momentum, on the minibatch
sequence of `kfac_defaults.py`. `curvature_update_period` and `inverse_every` are
static, one compilation each. No timing here: seconds per step are measured by
`kfac_defaults.py --per-step`; steps × seconds per step choose the defaults.

`--graft adam` (default) is `ef.optim.kfac`'s method, the K-FAC direction grafted
onto Adam's step lengths, which takes no norm constraint (its grid is damping ×
momentum × periods); `--graft none` the plain damped step with a norm constraint
(the grid that chose `kfac_preconditioner`'s defaults).

    python benchmarks/kfac_grid.py                      # the grafted grid
    python benchmarks/kfac_grid.py --graft none         # the plain grid (all five)
    python benchmarks/kfac_grid.py --problems cnn --max-steps 60
    python benchmarks/kfac_grid.py --problems digits-std --max-steps 60 --static 4,5 \
        --dampings 1e-3 --constraints 1e-2 2e-2 3e-2 5e-2 --momenta 0 \
        --decays 0.5 0.8 0.95
"""

import argparse
import itertools
import os
import platform

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from kfac_defaults import KFAC_LRS, PROBLEMS, minibatches, problem

import eqfisher as ef


DAMPINGS = (1e-3, 1e-2, 1e-1)
CONSTRAINTS = (1e-3, 1e-2, 1e-1)
MOMENTA = (0.0, 0.9)
STATIC = ((1, 5), (1, 20), (2, 5), (4, 5))  # (curvature_update_period, inverse_every)
# The grafted method: no norm constraint (0.0 stands for none in the table).
GRAFTED = ((1e-3, 1e-4, 1e-5), (0.0,), (0.0,))
GRAFTED_STATIC = ((2, 10), (4, 10), (2, 5), (1, 10), (4, 5))
MAX_STEPS = {"autoencoder": 200, "cnn": 50}


def trajectories(name, period, inverse_every, configs, max_steps, seed, grafted=True):
    """Full-data loss after each step (NaN once non-finite), per configuration."""
    key = jax.random.key(seed)
    model, x, y, loss_fn, target = problem(name, key)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    indices, keys = minibatches(x.shape[0], max_steps, seed)
    estimator, structure = ef.FisherMC(samples=1), ef.KFAC()
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=estimator, structure=structure)
    like = ef.optim.curvature_like(vgc, model, (x[indices[0]], y[indices[0]]), key=key)

    def run(lr, damping, constraint, momentum, decay):
        method = {} if grafted else dict(graft=None, norm_constraint=constraint)
        opt = ef.optim.kfac(
            lr,
            like=like,
            damping=damping,
            momentum=momentum,
            decay=decay,
            inverse_every=inverse_every,
            **method,
        )
        step = ef.optim.kfac_step(
            loss_fn,
            opt,
            estimator=estimator,
            structure=structure,
            curvature_update_period=period,
        )

        def body(carry, inputs):
            p, state = carry
            idx, k = inputs
            m, state, _ = step(eqx.combine(p, static), state, (x[idx], y[idx]), k)
            p = eqx.filter(m, eqx.is_inexact_array)
            loss = loss_fn(m, (x, y))
            finite = jnp.isfinite(loss) & jnp.all(
                jnp.stack([jnp.all(jnp.isfinite(v)) for v in jax.tree.leaves(p)])
            )
            return (p, state), jnp.where(finite, loss, jnp.nan)

        _, losses = jax.lax.scan(body, (params, opt.init(params)), (indices, keys))
        return losses

    columns = [jnp.asarray(c, jnp.float32) for c in zip(*configs)]
    losses = jax.jit(jax.vmap(run))(*columns)
    first = float(loss_fn(model, (x, y)))
    return np.asarray(losses), target, first


def outcome(losses, target, first):
    """(steps to target or None, non-finite?) for one trajectory, as kfac_defaults."""
    for i, loss in enumerate(losses):
        if not np.isfinite(loss):
            return None, True
        if loss <= target:
            return i + 1, False
        if loss > 100 * first:
            return None, False
    return None, False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--problems", nargs="*", default=PROBLEMS)
    parser.add_argument(
        "--max-steps",
        type=int,
        help="steps per run (default 100; 50 for cnn, 200 for autoencoder)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--graft",
        choices=("adam", "none"),
        default="adam",
        help="kfac's grafted method (default) or the plain step with a norm constraint",
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="with --graft none: damping 1e-3, norm constraint 1e-3/1e-2, "
        "momentum 0, periods 1, 2, 4",
    )
    parser.add_argument("--dampings", type=float, nargs="*")
    parser.add_argument("--constraints", type=float, nargs="*")
    parser.add_argument("--momenta", type=float, nargs="*")
    parser.add_argument(
        "--decays", type=float, nargs="*", default=[0.95], help="curvature EMA decay"
    )
    parser.add_argument(
        "--static",
        nargs="*",
        help="curvature_update_period,inverse_every pairs, e.g. 4,5 1,5",
    )
    args = parser.parse_args()
    if args.small and args.graft == "adam":
        parser.error("--small is the plain grid's: pass it with --graft none")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}"
    )
    grafted = args.graft == "adam"
    if grafted:
        grid = GRAFTED
    elif args.small:
        grid = ((1e-3,), (1e-3, 1e-2), (0.0,))
    else:
        grid = (DAMPINGS, CONSTRAINTS, MOMENTA)
    grid = tuple(
        given or default
        for given, default in zip((args.dampings, args.constraints, args.momenta), grid)
    ) + (tuple(args.decays),)
    static = GRAFTED_STATIC if grafted else STATIC
    if args.small and not grafted:
        static = ((1, 5), (2, 5), (4, 5))
    if args.static:
        static = tuple(tuple(int(v) for v in pair.split(",")) for pair in args.static)
    configs = list(itertools.product(KFAC_LRS, *grid))
    # (period, inverse_every, damping, constraint, momentum) -> per problem
    table: dict = {}
    for name in args.problems:
        for period, every in static:
            max_steps = args.max_steps or MAX_STEPS.get(name, 100)
            losses, target, first = trajectories(
                name, period, every, configs, max_steps, args.seed, grafted
            )
            for (lr, *rest), traj in zip(configs, losses):
                reached, nonfinite = outcome(traj, target, first)
                cell = table.setdefault((period, every, *rest), {}).setdefault(name, [])
                cell.append((lr, reached, nonfinite))
            print(f"  done {name} period={period} inverse_every={every}", flush=True)
    print(
        "\n| period | inverse_every | damping | norm_constraint | momentum | decay | "
        "non-finite | best steps (lr) per problem |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for key, per_problem in table.items():
        nonfinite = sum(nf for rows in per_problem.values() for _, _, nf in rows)
        cells = []
        for name in args.problems:
            ok = [(r, lr) for lr, r, _ in per_problem[name] if r is not None]
            cells.append(f"{min(ok)[0]} ({min(ok)[1]:g})" if ok else "-")
        period, every, damping, constraint, momentum, decay = key
        print(
            f"| {period} | {every} | {damping:g} | {constraint:g} | {momentum:g} | "
            f"{decay:g} | {nonfinite} | " + ", ".join(cells) + " |"
        )


if __name__ == "__main__":
    main()
