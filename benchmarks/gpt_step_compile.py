"""First-call compile of one training step on the scanned GPT of
`transformer_scale.py` (N blocks built with `eqx.filter_vmap`, applied with
`lax.scan`): a value-and-gradient, an Adam step and `eqfisher.optim.kfac_step` at
its defaults (Monte-Carlo Fisher, `KFAC()`), each from an empty compilation cache,
by stage (trace, lowering, XLA), with the number of fused kernels XLA compiled.

    python benchmarks/gpt_step_compile.py [--blocks 4 12] [--repeats 2]
    python benchmarks/gpt_step_compile.py --max-inverse-dim none   # factors whole
    python benchmarks/gpt_step_compile.py --xla-defaults   # K-FAC without fast_compile

The K-FAC step is compiled with `kfac_step`'s default compiler options
(`ef.optim.fast_compile_options()`: its own jit is inlined into the one here).
"""

import argparse
import os
import platform

import equinox as eqx
import jax
import optax
from kfac_defaults import (
    add_inverse_dim_argument,
    compile_stages,
    inverse_dim_options,
    kfac_compiler_options,
)
from transformer_scale import gpt_loss, gpt_problem

import eqfisher as ef


def steps(n_blocks: int, options: dict):
    """`{name: (function, arguments, compiler options)}` for the three training
    steps; `options` go to `ef.optim.kfac` (`xla_defaults`, popped: the K-FAC
    step's compiler options, `kfac_compiler_options`)."""
    compiler = kfac_compiler_options(options)
    model, batch = gpt_problem(n_blocks)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    key = jax.random.key(0)
    estimator, structure = ef.FisherMC(), ef.KFAC()
    vgc = ef.value_grad_and_curvature(
        gpt_loss, estimator=estimator, structure=structure
    )
    like = ef.optim.curvature_like(vgc, model, batch, key=key)
    opt = ef.optim.kfac(0.1, like=like, **options)
    kfac = ef.optim.kfac_step(gpt_loss, opt, estimator=estimator, structure=structure)
    adam = optax.adam(1e-3)

    def value_and_grad(p, b):
        return eqx.filter_value_and_grad(gpt_loss)(eqx.combine(p, static), b)

    def adam_step(p, s, b):
        grads = eqx.filter_grad(gpt_loss)(eqx.combine(p, static), b)
        updates, s = adam.update(grads, s, p)
        return eqx.apply_updates(p, updates), s

    def kfac_step(p, s, b, k):
        model, s, _ = kfac(eqx.combine(p, static), s, b, k)
        return eqx.filter(model, eqx.is_inexact_array), s

    return {
        "value-and-grad": (value_and_grad, (params, batch), None),
        "Adam step": (adam_step, (params, adam.init(params), batch), None),
        "kfac_step": (kfac_step, (params, opt.init(params), batch, key), compiler),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, nargs="*", default=[4, 12])
    parser.add_argument("--repeats", type=int, default=2)
    add_inverse_dim_argument(parser)
    parser.add_argument(
        "--xla-defaults",
        action="store_true",
        help="compile the K-FAC step with XLA's defaults",
    )
    args = parser.parse_args()
    options = inverse_dim_options(args.max_inverse_dim)
    if args.xla_defaults:
        options["xla_defaults"] = True
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "\n| GPT blocks | step | compile s (trace / lower / XLA) | fused kernels | "
        "/ value-and-grad |"
    )
    print("|---|---|---|---|---|")
    for n in args.blocks:
        base = None
        for name, (fn, fn_args, compiler) in steps(n, dict(options)).items():
            runs = [
                compile_stages(fn, *fn_args, compiler_options=compiler)
                for _ in range(args.repeats)
            ]
            t, lo, x, fusions = min(runs, key=lambda r: sum(r[:3]))
            total = t + lo + x
            base = base or total
            print(
                f"| {n} | {name} | {total:.2f} ({t:.2f} / {lo:.2f} / {x:.2f}) | "
                f"{fusions} | {total / base:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
