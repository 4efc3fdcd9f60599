"""The exact diagonal and EKFAC on wide MLPs: seconds and XLA scratch memory,
against a gradient and K-FAC, in one process.

A 512-H-10 tanh MLP (one hidden layer of H), softmax cross-entropy, float32, a
batch of N. For each structure (`Diagonal()`, `EKFAC()`, `KFAC()`, all with the
GGN), `ef.curvature` is jitted; the script prints its first call (compile
included), its steady state (the median of repeated calls) and its ratio to a
`value_and_grad` of the same loss, and the XLA scratch ("temp") bytes of the
compiled program. Where a dense layer's per-example vectors were formed (N · K ·
P numbers, K = 10 for the GGN), the diagonal cost thousands of gradients and
EKFAC gigabytes; as outer products of the inputs and cotangents they cost a few
gradients (benchmarks/RESULTS.md, "Issue 26, twenty-seventh session").

    python benchmarks/exact_diagonal_cost.py
    OPENBLAS_NUM_THREADS=1 python benchmarks/exact_diagonal_cost.py
    python benchmarks/exact_diagonal_cost.py --sizes 256x64   # one configuration

Then a deep MLP whose stacked blocks are applied by `lax.scan` (`--scanned
DEPTHxWIDTHxBATCH`, default 64x64x128): every step's factors are read at once.
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import eqfisher as ef


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def timed(fn, *args, repeats: int = 7) -> tuple[float, float]:
    """`(first call, median of the next calls)` in seconds."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def scratch_gib(fn, *args) -> float:
    """The compiled program's scratch memory (XLA's `temp_size_in_bytes`)."""
    analysis = fn.lower(*args).compile().compiled.memory_analysis()
    return analysis.temp_size_in_bytes / 2**30


class ScannedMLP(eqx.Module):
    """`depth` stacked tanh layers of `width`, applied by `lax.scan`."""

    inner: eqx.nn.Linear
    blocks: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, depth: int, width: int, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.inner = eqx.nn.Linear(512, width, key=k1)
        self.blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(width, width, key=k))(
            jax.random.split(k2, depth)
        )
        self.head = eqx.nn.Linear(width, 10, key=k3)

    def __call__(self, x):
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def step(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None

        h, _ = jax.lax.scan(step, jnp.tanh(self.inner(x)), params)
        return self.head(h)


def run(model, n: int, name: str) -> None:
    x = jax.random.normal(jax.random.key(1), (n, 512))
    y = jnp.arange(n) % 10
    batch = (x, y)
    params = sum(
        a.size for a in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    )
    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))
    _, unit = timed(grad, model, batch)
    print(
        f"{name}, P = {params:,}, batch {n}: value_and_grad {1e3 * unit:.2f} ms",
        flush=True,
    )
    for name, structure in [
        ("Diagonal", ef.Diagonal()),
        ("EKFAC", ef.EKFAC()),
        ("KFAC", ef.KFAC()),
    ]:

        @eqx.filter_jit
        def build(model, batch, structure=structure):
            return ef.curvature(
                loss_fn, model, batch, estimator=ef.GGN(), structure=structure
            )

        first, steady = timed(build, model, batch)  # compiles first
        gib = scratch_gib(build, model, batch)
        print(
            f"  {name:8s} first call {first:6.2f} s | steady {1e3 * steady:9.2f} ms "
            f"({steady / unit:7.1f}x value_and_grad) | XLA scratch {gib:6.3f} GiB",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=["256x64", "256x256", "1024x256"],
        help="width x batch",
    )
    parser.add_argument("--scanned", default="64x64x128", help="depth x width x batch")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.default_backend()}")
    key = jax.random.key(0)
    for size in args.sizes:
        width, n = (int(v) for v in size.split("x"))
        model = eqx.nn.MLP(512, 10, width, 1, activation=jnp.tanh, key=key)
        run(model, n, f"512-{width}-10 MLP")
    depth, width, n = (int(v) for v in args.scanned.split("x"))
    model = ScannedMLP(depth, width, key)
    run(model, n, f"scanned MLP, {depth} blocks of {width}")


if __name__ == "__main__":
    main()
