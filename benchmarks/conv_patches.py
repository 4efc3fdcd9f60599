"""Conv K-FAC input factors with and without the explicit patch matrix.

A small CNN (32x32 3-channel input; conv 3x3 3->32, conv 3x3 32->64 stride 2, conv
3x3 64->64; global mean pool; dense head), batch 128. For each conv layer, the
input factor A = mean ã ãᵀ is compiled two ways from the layer's recorded input:
forming the whole patch matrix (examples·locations x C·k·k, `_patches`), and
in chunks of examples (`_chunked_patches`, a `lax.scan` forming at most `--limit`
patch elements at a time; eqfisher does this when a layer's patch matrix would
exceed `eqfisher.Config.max_patch_elements` = 2**20). Printed per layer: the
compiled program's temporary memory (XLA's `memory_analysis`), the median time of a call
(interleaved), and the largest difference between the two.

    python benchmarks/conv_patches.py [--repeats 20] [--batch 128] [--limit 2**20]
"""

import argparse
import platform
import time

import equinox as eqx
import jax
import numpy as np

import eqfisher as ef
from eqfisher._curvature.statistics import convolution as stats
from eqfisher.internal import StagedLoss, split


class CNN(eqx.Module):
    convs: tuple
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.convs = (
            eqx.nn.Conv2d(3, 32, 3, padding=1, key=k[0]),
            eqx.nn.Conv2d(32, 64, 3, stride=2, padding=1, key=k[1]),
            eqx.nn.Conv2d(64, 64, 3, padding=1, key=k[2]),
        )
        self.head = eqx.nn.Linear(64, 10, key=k[3])

    def __call__(self, x):
        for conv in self.convs:
            x = jax.nn.relu(conv(x))
        return self.head(x.mean(axis=(1, 2)))


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def explicit(record):
    def fn(x):
        a = stats._patches(record, x)
        return a.T @ a / a.shape[0]

    return fn


def chunked(record):
    def fn(x):
        aa, _, n = stats._chunked_patches(record, x, None)
        return aa / n

    return fn


def timed(fns: dict, args, repeats: int) -> dict:
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return {name: np.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--limit", type=int, default=2**20)
    args = parser.parse_args()
    # For the whole run: the setting is read when the statistics are traced.
    ef.configure(max_patch_elements=args.limit).__enter__()
    model = CNN(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (args.batch, 3, 32, 32))
    y = jax.random.randint(jax.random.key(2), (args.batch,), 0, 10)
    batch = (x, y)
    print(
        f"machine: {platform.machine()}, {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}; batch {args.batch}"
    )

    s = split(model, batch)
    processed = StagedLoss(loss_fn, "benchmark").stage(s)
    ev = processed.run(s.inputs)
    convs = [record for record in processed.layers if record.kind.name == "conv"]
    if not convs:  # a stale comparison here once measured nothing, silently
        raise SystemExit(f"no convolution among {[r.name for r in processed.layers]}")
    for record in convs:
        inputs = ev.read(record.inputs)
        exes, mems = {}, {}
        for name, make in (("patches", explicit), ("chunked", chunked)):
            exes[name] = jax.jit(make(record)).lower(inputs).compile()
            mems[name] = exes[name].memory_analysis().temp_size_in_bytes / 2**20
        diff = np.max(np.abs(exes["patches"](inputs) - exes["chunked"](inputs)))
        ms = timed(exes, (inputs,), args.repeats)
        patch_mib = (
            stats._patch_elements(record) * inputs.shape[0] * inputs.itemsize / 2**20
        )
        print(
            f"{record.name}: input {inputs.nbytes / 2**20:.1f} MiB, patch matrix "
            f"{patch_mib:.1f} MiB | whole: temp {mems['patches']:.1f} MiB, "
            f"{ms['patches']:.1f} ms | chunked: temp {mems['chunked']:.1f} MiB, "
            f"{ms['chunked']:.1f} ms | max |diff| {diff:.1e}"
        )


if __name__ == "__main__":
    main()
