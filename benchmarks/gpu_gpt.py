"""The scanned GPT's K-FAC statistics and training step against a gradient and an
Adam step, on the device JAX uses (issue 26, item 5: run it on a GPU through the
device tool, `benchmarks/gpu_issue26.sh`; on a CPU `--small` is a smoke run).

The GPT is `transformer_scale.py`'s (N blocks built with `eqx.filter_vmap`, applied
with `lax.scan`). For each function: the first call (trace, compile and one run,
JAX's caches cleared before) and the steady state (median of 20 calls after 5
warm-ups), then the ratios the issue asks for:

- `value-and-grad`: `eqx.filter_value_and_grad` of the loss, jitted;
- `Adam step`: the gradient and `optax.adam(1e-3)`;
- `statistics`: `ef.value_grad_and_curvature(loss, FisherMC(), KFAC())`;
- `kfac_step, period 1`: `ef.optim.kfac_step` with statistics every step;
- `kfac_step, default`: at its defaults (statistics every 4th step).

    python benchmarks/gpu_gpt.py                 # 12 blocks, d 256, T 128, batch 32
    python benchmarks/gpu_gpt.py --small         # 12 blocks, d 64, T 32, batch 8
"""

import argparse
import os
import platform
import statistics
import time

import equinox as eqx
import jax
import optax
from transformer_scale import gpt_loss, gpt_problem

import eqfisher as ef


def _steps(model, batch):
    """`{name: (call, carry)}`: `call(carry, key) -> carry`, jitted once."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    estimator, structure = ef.FisherMC(), ef.KFAC()
    vgc = ef.value_grad_and_curvature(
        gpt_loss, estimator=estimator, structure=structure
    )
    like = ef.optim.curvature_like(vgc, model, batch, key=jax.random.key(0))
    adam = optax.adam(1e-3)

    @eqx.filter_jit
    def value_and_grad(carry, key):
        del key
        return eqx.filter_value_and_grad(gpt_loss)(eqx.combine(carry, static), batch)

    @eqx.filter_jit
    def adam_step(carry, key):
        del key
        p, s = carry
        grads = eqx.filter_grad(gpt_loss)(eqx.combine(p, static), batch)
        updates, s = adam.update(grads, s, p)
        return eqx.apply_updates(p, updates), s

    @eqx.filter_jit
    def stats(carry, key):
        return vgc(eqx.combine(carry, static), batch, key=key)

    def kfac(period):
        opt = ef.optim.kfac(0.1, like=like)
        step = ef.optim.kfac_step(
            gpt_loss,
            opt,
            estimator=estimator,
            structure=structure,
            **({} if period is None else {"curvature_update_period": period}),
        )

        @eqx.filter_jit
        def call(carry, key):
            p, s = carry
            m, s, _ = step(eqx.combine(p, static), s, batch, key)
            return eqx.filter(m, eqx.is_inexact_array), s

        return call, (params, opt.init(params))

    return {
        "value-and-grad": (value_and_grad, params, False),
        "Adam step": (adam_step, (params, adam.init(params)), True),
        "statistics": (stats, params, False),
        "kfac_step, period 1": (*kfac(1), True),
        "kfac_step, default": (*kfac(None), True),
    }


def _timed(call, carry, carries: bool, warmup=5, calls=20):
    """(first-call seconds, steady-state milliseconds): `carries` when `call`
    returns the next carry (a training step), else `carry` is reused."""
    jax.clear_caches()
    keys = jax.random.split(jax.random.key(1), warmup + calls + 1)
    t0 = time.perf_counter()
    out = jax.block_until_ready(call(carry, keys[0]))
    first = time.perf_counter() - t0
    carry = out if carries else carry
    for i in range(warmup):
        out = call(carry, keys[1 + i])
        carry = out if carries else carry
    jax.block_until_ready(out)
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        out = jax.block_until_ready(call(carry, keys[1 + warmup + i]))
        times.append(time.perf_counter() - t0)
        carry = out if carries else carry
    return first, 1e3 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="the CPU-sized GPT")
    parser.add_argument("--blocks", type=int, default=12)
    args = parser.parse_args()
    size = (
        dict(d=64, vocabulary=512, t=32, batch=8)
        if args.small
        else dict(d=256, vocabulary=4096, t=128, batch=32)
    )
    device = jax.devices()[0]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, device "
        f"{device.platform} {device.device_kind}, jax {jax.__version__}; GPT "
        f"{args.blocks} blocks, {size}"
    )
    model, batch = gpt_problem(args.blocks, **size)
    rows = {}
    print("\n| function | first call s | steady ms |")
    print("|---|---|---|")
    for name, (call, carry, carries) in _steps(model, batch).items():
        rows[name] = _timed(call, carry, carries)
        print(f"| {name} | {rows[name][0]:.2f} | {rows[name][1]:.2f} |", flush=True)
    vg, adam = rows["value-and-grad"], rows["Adam step"]
    for name, base, base_name in (
        ("statistics", vg, "value-and-grad"),
        ("kfac_step, period 1", vg, "value-and-grad"),
        ("kfac_step, default", adam, "Adam step"),
    ):
        first, steady = rows[name]
        print(
            f"{name} / {base_name}: first call {first / base[0]:.2f}x, "
            f"steady {steady / base[1]:.2f}x"
        )


if __name__ == "__main__":
    main()
