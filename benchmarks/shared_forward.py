"""Shared forward: loss + gradient + K-FAC statistics vs. loss + gradient alone.

MLP 64-512-512-10 (relu), batch 1024, FisherMC(samples=1) + KFAC, both jitted; the
two are timed interleaved in one process and the ratio of medians is printed.

    python benchmarks/shared_forward.py [--repeats 50]
"""

import argparse
import platform
import time

import equinox as eqx
import jax
import numpy as np

import eqfisher as ef


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--batch", type=int, default=1024)
    args = parser.parse_args()

    key = jax.random.key(0)
    model = eqx.nn.MLP(64, 10, 512, 2, activation=jax.nn.relu, key=key)
    x = jax.random.normal(jax.random.key(1), (args.batch, 64))
    y = jax.random.randint(jax.random.key(2), (args.batch,), 0, 10)

    def loss_fn(m, b):
        return ef.softmax_cross_entropy(jax.vmap(m)(b[0]), b[1])

    shared = eqx.filter_jit(
        ef.value_grad_and_curvature(
            loss_fn, estimator=ef.FisherMC(samples=1), structure=ef.KFAC()
        )
    )
    plain = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))

    def run_shared(k):
        loss, grads, curv = shared(model, (x, y), key=k)
        jax.block_until_ready((loss, grads, curv))

    def run_plain(_):
        jax.block_until_ready(plain(model, (x, y)))

    for fn in (run_shared, run_plain):  # compile and warm up
        fn(key)
        fn(key)
    t_shared, t_plain = [], []
    for i in range(args.repeats):
        k = jax.random.key(i)
        for fn, out in ((run_shared, t_shared), (run_plain, t_plain)):
            t0 = time.perf_counter()
            fn(k)
            out.append(time.perf_counter() - t0)
    ms, mp = np.median(t_shared) * 1e3, np.median(t_plain) * 1e3
    print(
        f"machine: {platform.machine()}, {jax.devices()[0].device_kind}, jax {jax.__version__}"
    )
    print(f"eqfisher value_grad_and_curvature (FisherMC(1) + KFAC): {ms:.2f} ms")
    print(f"eqx.filter_value_and_grad:                              {mp:.2f} ms")
    print(f"ratio: {ms / mp:.2f} (target <= 2.0)")


if __name__ == "__main__":
    main()
