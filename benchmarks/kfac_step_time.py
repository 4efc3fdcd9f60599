"""What curvature costs: one eqfisher K-FAC step vs. one Adam step.

MLP 64-512-512-10 (relu), batch 1024. K-FAC: `value_grad_and_curvature` with
FisherMC(samples=1) + KFAC, then `ef.optim.kfac(1e-2, damping=1e-3, momentum=0.9,
decay=0.95, inverse_every=10)`; Adam: `optax.adam(1e-3)` on
`eqx.filter_value_and_grad`. Both steps are jitted whole (gradient, optimiser
update, `apply_updates`), warmed up (each compiles once), then timed interleaved, one K-FAC step and
one Adam step at a time, over `--steps` steps (a multiple of `inverse_every`, so
the eigendecomposition refreshes are counted at their real rate).

    python benchmarks/kfac_step_time.py [--steps 50] [--breakdown]
        [--damping-mode exact|factored]

On a shared machine run with `OPENBLAS_NUM_THREADS=1`: jax's CPU `eigh` calls
scipy's OpenBLAS LAPACK, whose threads, under load, made a 512x512 `eigh` ~10x
slower (305 ms vs 36 ms) and the inverse refresh dominate everything.

`--breakdown` also times the parts of a K-FAC step: loss + gradient + K-FAC
statistics alone, a step without an inverse refresh, a step with one.
benchmarks/kfac_jax_step_time.py measures kfac_jax on the same problem.
"""

import argparse
import platform
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqfisher as ef
import eqfisher.optim  # noqa: F401  (`ef.optim`, whether or not __init__ imports it)


INVERSE_EVERY = 10


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument(
        "--damping-mode", choices=("exact", "factored"), default="factored"
    )
    args = parser.parse_args()
    if args.steps % INVERSE_EVERY:
        parser.error(f"--steps must be a multiple of {INVERSE_EVERY}")

    model = eqx.nn.MLP(64, 10, 512, 2, activation=jax.nn.relu, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (args.batch, 64))
    y = jax.random.randint(jax.random.key(2), (args.batch,), 0, 10)
    batch = (x, y)
    params = eqx.filter(model, eqx.is_inexact_array)

    vgc = ef.value_grad_and_curvature(
        loss_fn, estimator=ef.FisherMC(samples=1), structure=ef.KFAC()
    )
    variants = {"exact": ef.optim.Tikhonov(), "factored": ef.optim.FactoredTikhonov()}
    kfac = ef.optim.kfac(
        1e-2,
        like=ef.optim.curvature_like(vgc, model, batch, key=jax.random.key(0)),
        damping=1e-3,
        momentum=0.9,
        decay=0.95,
        inverse_every=INVERSE_EVERY,
        damping_variant=variants[args.damping_mode],
        graft=None,  # the plain damped step these results were measured with
    )
    adam = optax.adam(1e-3)

    @eqx.filter_jit
    def kfac_step(model, state, batch, key):
        loss, grads, curv = vgc(model, batch, key=key)
        updates, state = kfac.update(grads, state, params, curvature=curv)
        return eqx.apply_updates(model, updates), state, loss

    @eqx.filter_jit
    def adam_step(model, state, batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
        updates, state = adam.update(grads, state, params)
        return eqx.apply_updates(model, updates), state, loss

    k_model, k_state = model, kfac.init(params)
    a_model, a_state = model, adam.init(params)
    keys = iter(jax.random.split(jax.random.key(3), 10 * args.steps + 100))

    # Warm up: the K-FAC step compiles at steps 1 and 2; run a full inverse period
    # so that the timed window starts right after a refresh, like any later window.
    for _ in range(INVERSE_EVERY):
        k_model, k_state, _ = jax.block_until_ready(
            kfac_step(k_model, k_state, batch, next(keys))
        )
        a_model, a_state, _ = jax.block_until_ready(adam_step(a_model, a_state, batch))

    t_kfac, t_adam = [], []
    for _ in range(args.steps):
        key = next(keys)
        t0 = time.perf_counter()
        k_model, k_state, _ = jax.block_until_ready(
            kfac_step(k_model, k_state, batch, key)
        )
        t1 = time.perf_counter()
        a_model, a_state, _ = jax.block_until_ready(adam_step(a_model, a_state, batch))
        t2 = time.perf_counter()
        t_kfac.append(t1 - t0)
        t_adam.append(t2 - t1)
    t_kfac, t_adam = np.array(t_kfac) * 1e3, np.array(t_adam) * 1e3
    # The update at count c refreshes the inverse when c % INVERSE_EVERY == 0; the
    # warm-up ran INVERSE_EVERY updates, so timed step i has c = INVERSE_EVERY + i.
    refresh = np.arange(args.steps) % INVERSE_EVERY == 0

    print(
        f"machine: {platform.machine()}, {jax.devices()[0].device_kind}, jax {jax.__version__}"
    )
    print(
        f"MLP 64-512-512-10 relu, batch {args.batch}, {args.steps} steps after warm-up"
    )
    print(
        f"eqfisher K-FAC step: mean {t_kfac.mean():.2f} ms, median "
        f"{np.median(t_kfac):.2f} ms (with inverse refresh: "
        f"{t_kfac[refresh].mean():.2f} ms, without: {t_kfac[~refresh].mean():.2f} ms)"
    )
    print(
        f"Adam step:           mean {t_adam.mean():.2f} ms, median {np.median(t_adam):.2f} ms"
    )
    print(
        f"what curvature costs: K-FAC / Adam = {t_kfac.mean() / t_adam.mean():.2f} (means)"
    )

    if args.breakdown:
        stats_only = eqx.filter_jit(vgc)
        eigh = jax.jit(lambda m: jnp.linalg.eigh(m))

        def timed(fn, n=20):
            fn()
            fn()
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return np.median(out) * 1e3

        def only_stats():
            jax.block_until_ready(stats_only(model, batch, key=jax.random.key(5)))

        spd = [jnp.eye(n) + 0.01 * jnp.ones((n, n)) for n in (65, 513, 512, 10)]
        print("breakdown (medians):")
        print(f"  value_grad_and_curvature alone: {timed(only_stats):.2f} ms")
        for m in spd:
            t = timed(lambda m=m: jax.block_until_ready(eigh(m)))
            print(f"  jnp.linalg.eigh {m.shape[0]}x{m.shape[0]}: {t:.2f} ms")


if __name__ == "__main__":
    main()
