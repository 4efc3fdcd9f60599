"""K-FAC vs. tuned Adam: steps to reach a full-data training loss of 0.05.

scikit-learn's bundled digits (1797 images, 8x8, X/16, float32), MLP 64-128-128-10
(relu), random minibatches of 256 drawn with a fixed seed (the same sequence for
every run). The full-data training loss is evaluated after every step; a run stops
when it reaches the target, diverges, or hits `--max-steps`. Each optimiser's
learning rate (and K-FAC's damping) is picked from a small grid; the best of each
is compared by steps.

    python benchmarks/kfac_vs_adam.py            # full grid (~minutes on 2 cores)
    python benchmarks/kfac_vs_adam.py --quick    # tiny grid, a smoke test

Training runs in jitted chunks of `EVAL_EVERY` steps (`jax.lax.scan`) followed by the
full-data loss, so Python dispatch does not dominate; the learning rate and the
damping are traced arguments, so each optimiser compiles once for its whole grid.
Seconds exclude compilation; ms/step is seconds / steps run (including the
full-data evaluations).
"""

import argparse
import platform
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import eqfisher as ef
import eqfisher.optim  # noqa: F401  (`ef.optim`, whether or not __init__ imports it)


EVAL_EVERY = 1
# The same learning-rate grid for both optimisers.
LEARNING_RATES = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def make_runner(
    kind: str,
    x_all,
    y_all,
    static,
    inverse_every: int = 10,
    damping_mode="exact",
    momentum: float = 0.9,
    norm_constraint: float | None = None,
    like=None,
):
    """Returns `first(params, idx, key, hp)` and `chunk(params, state, idx, key, hp)`.

    `hp` is `(learning_rate, damping)` as arrays; `idx` holds minibatch indices.
    """
    if kind == "adam":

        def make_opt(hp):
            return optax.adam(hp[0])

        def step(params, state, idx, key, hp):
            del key
            model = eqx.combine(params, static)
            loss, grads = eqx.filter_value_and_grad(loss_fn)(
                model, (x_all[idx], y_all[idx])
            )
            updates, state = make_opt(hp).update(grads, state, params)
            return eqx.apply_updates(params, updates), state

    else:
        vgc = ef.value_grad_and_curvature(
            loss_fn, estimator=ef.FisherMC(samples=1), structure=ef.KFAC()
        )

        def make_opt(hp):
            variants = {
                "exact": ef.optim.Tikhonov(),
                "factored": ef.optim.FactoredTikhonov(),
            }
            return ef.optim.kfac(
                hp[0],
                like=like,
                damping=hp[1],
                momentum=momentum,
                decay=0.95,
                inverse_every=inverse_every,
                damping_variant=variants[damping_mode],
                graft=None,  # the plain damped step these results were measured with
                norm_constraint=norm_constraint,
            )

        def step(params, state, idx, key, hp):
            model = eqx.combine(params, static)
            loss, grads, curv = vgc(model, (x_all[idx], y_all[idx]), key=key)
            updates, state = make_opt(hp).update(grads, state, params, curvature=curv)
            return eqx.apply_updates(params, updates), state

    def full_loss(params):
        return loss_fn(eqx.combine(params, static), (x_all, y_all))

    @eqx.filter_jit
    def first(params, idx, key, hp):
        # The first step also builds the optimiser state.
        state = make_opt(hp).init(params)
        return step(params, state, idx, key, hp)

    @eqx.filter_jit
    def chunk(params, state, idx, keys, hp):
        def body(carry, xs):
            p, s = carry
            return step(p, s, *xs, hp), None

        (params, state), _ = jax.lax.scan(body, (params, state), (idx, keys))
        return params, state, full_loss(params)

    return first, chunk


def train(first, chunk, params, indices, keys, hp, target, max_steps):
    """Returns (steps to target or None, steps run, seconds)."""
    t0 = time.perf_counter()
    params, state = first(params, indices[0], keys[0], hp)
    steps = 1
    reached = None
    while steps + EVAL_EVERY <= max_steps:
        sl = slice(steps, steps + EVAL_EVERY)
        params, state, loss = chunk(params, state, indices[sl], keys[sl], hp)
        steps += EVAL_EVERY
        loss = float(loss)
        if loss <= target:
            reached = steps
            break
        if not np.isfinite(loss) or loss > 1e3:
            break
    return reached, steps, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a tiny grid")
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--target", type=float, default=0.05)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--inverse-every", type=int, default=10, help="K-FAC's")
    parser.add_argument(
        "--damping-mode",
        choices=("exact", "factored"),
        default="factored",
        help="K-FAC's",
    )
    parser.add_argument("--momentum", type=float, default=0.9, help="K-FAC's")
    parser.add_argument("--seed", type=int, default=0, help="data order and init")
    parser.add_argument("--norm-constraint", type=float, default=None, help="K-FAC's")
    args = parser.parse_args()

    digits = load_digits()
    x_all = jnp.asarray(digits.data / 16.0, jnp.float32)
    y_all = jnp.asarray(digits.target, jnp.int32)
    n = x_all.shape[0]
    max_steps = 300 if args.quick else args.max_steps

    rng = np.random.default_rng(args.seed)
    indices = jnp.asarray(
        np.stack(
            [rng.choice(n, args.batch, replace=False) for _ in range(max_steps + 1)]
        )
    )
    keys = jax.random.split(jax.random.key(args.seed + 1), max_steps + 1)

    model = eqx.nn.MLP(
        64, 10, 128, 2, activation=jax.nn.relu, key=jax.random.key(args.seed)
    )
    params, static = eqx.partition(model, eqx.is_inexact_array)

    if args.quick:
        grids = {"adam": [(1e-2, 0.0)], "kfac": [(1e-2, 1e-2)]}
    else:
        grids = {
            "adam": [(lr, 0.0) for lr in LEARNING_RATES],
            "kfac": [(lr, d) for d in (1e-3, 1e-2, 1e-1) for lr in LEARNING_RATES],
        }

    like = ef.optim.curvature_like(
        ef.value_grad_and_curvature(
            loss_fn, estimator=ef.FisherMC(samples=1), structure=ef.KFAC()
        ),
        model,
        (x_all[indices[0]], y_all[indices[0]]),
        key=keys[0],
    )
    rows = []
    for kind, grid in grids.items():
        first, chunk = make_runner(
            kind,
            x_all,
            y_all,
            static,
            args.inverse_every,
            args.damping_mode,
            args.momentum,
            args.norm_constraint,
            like,
        )
        hp0 = jnp.asarray(grid[0], jnp.float32)
        # Compile both functions (traced hyperparameters: once for the whole grid).
        p, s = first(params, indices[0], keys[0], hp0)
        jax.block_until_ready(
            chunk(p, s, indices[1 : 1 + EVAL_EVERY], keys[1 : 1 + EVAL_EVERY], hp0)
        )
        for lr, damping in grid:
            hp = jnp.asarray((lr, damping), jnp.float32)
            reached, steps, secs = train(
                first, chunk, params, indices, keys, hp, args.target, max_steps
            )
            rows.append((kind, lr, damping, reached, steps, secs))
            shown = "-" if reached is None else str(reached)
            print(
                f"  {kind:4s} lr={lr:<6g} damping={damping if kind == 'kfac' else '-':<6} "
                f"steps={shown:>5s} ({steps} run) {secs:6.2f} s "
                f"{secs / steps * 1e3:6.2f} ms/step",
                flush=True,
            )

    print()
    print(
        f"machine: {platform.machine()}, {jax.devices()[0].device_kind}, jax {jax.__version__}"
    )
    print(
        f"target: full-data training loss <= {args.target}, max {max_steps} steps, "
        f"batch {args.batch}, evaluated every {EVAL_EVERY} steps, "
        f"K-FAC momentum {args.momentum}, decay 0.95, inverse_every "
        f"{args.inverse_every}, norm_constraint {args.norm_constraint}, "
        f"damping_mode {args.damping_mode}"
    )
    print(
        f"{'optimizer':10s} {'lr':>7s} {'damping':>8s} {'steps':>6s} {'seconds':>8s} {'ms/step':>8s}"
    )
    for kind, lr, damping, reached, steps, secs in rows:
        name = "adam" if kind == "adam" else "kfac"
        d = f"{damping:g}" if kind == "kfac" else "-"
        shown = "-" if reached is None else str(reached)
        print(
            f"{name:10s} {lr:7g} {d:>8s} {shown:>6s} {secs:8.2f} {secs / steps * 1e3:8.2f}"
        )

    def best(kind):
        ok = [r for r in rows if r[0] == kind and r[3] is not None]
        return min(ok, key=lambda r: (r[3], r[5])) if ok else None

    b_adam, b_kfac = best("adam"), best("kfac")
    print()
    for label, b in (("adam", b_adam), ("kfac", b_kfac)):
        if b is None:
            print(f"best {label}: did not reach the target")
        else:
            print(
                f"best {label}: lr={b[1]:g}"
                + (f" damping={b[2]:g}" if label == "kfac" else "")
                + f": {b[3]} steps, {b[5]:.2f} s, {b[5] / b[4] * 1e3:.2f} ms/step"
            )
    if b_adam and b_kfac:
        print(
            f"steps ratio best_kfac / best_adam: {b_kfac[3] / b_adam[3]:.2f} (target <= 0.5)"
        )
        print(f"wall-clock ratio best_kfac / best_adam: {b_kfac[5] / b_adam[5]:.2f}")


if __name__ == "__main__":
    main()
