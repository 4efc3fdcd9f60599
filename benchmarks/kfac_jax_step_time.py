"""kfac_jax's K-FAC step on the problem of benchmarks/kfac_step_time.py.

kfac_jax is not a dependency of eqfisher, and this script does not import eqfisher.
Run it in its own virtual environment:

    python3 -m venv /tmp/kfacjax-venv
    /tmp/kfacjax-venv/bin/pip install "jax==0.9.0" "jaxlib==0.9.0" kfac-jax==0.0.8 equinox optax
    OPENBLAS_NUM_THREADS=1 /tmp/kfacjax-venv/bin/python benchmarks/kfac_jax_step_time.py [--steps 50] [--exact-inverses]

(`OPENBLAS_NUM_THREADS=1` as for benchmarks/kfac_step_time.py, whose numbers this
is compared with: LAPACK calls go through scipy's OpenBLAS.)

MLP 64-512-512-10 (relu), batch 1024, written as a params dict and `x @ w + b`
(kfac_jax's automatic registration finds dense layers in the jaxpr; it cannot see
Equinox layers as such), initialised like `eqx.nn.Linear`. The loss is registered
with `kfac_jax.register_softmax_cross_entropy_loss`. Optimiser settings match
eqfisher's `ef.optim.kfac(1e-2, damping=1e-3, momentum=0.9, decay=0.95,
inverse_every=10)` with `FisherMC(samples=1)`:

- learning rate 1e-2, momentum 0.9, damping 1e-3, all fixed (no adaptation);
- `estimation_mode="fisher_gradients"`: Fisher from one sampled target per example
  (kfac_jax's default is "ggn_curvature_prop");
- `curvature_ema=0.95`: in kfac_jax 0.0.8 this is the weight of the *old* estimate
  (`ema_old=curvature_ema`), i.e. eqfisher's `decay=0.95`;
- `inverse_update_period=10`, `multi_device=False`, `num_burnin_steps=0`.

By default kfac_jax inverts each Kronecker factor with factored ("pi-adjusted")
Tikhonov damping; `--exact-inverses` sets `use_exact_inverses=True`, which uses
eigendecompositions and the exact damped inverse, as eqfisher's `solve` does.

`Optimizer.step` jits itself; the first steps are untimed warm-up (one full
inverse period), then `--steps` steps (a multiple of 10) are timed one by one.
"""

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import kfac_jax
import numpy as np


INVERSE_EVERY = 10
SIZES = (64, 512, 512, 10)


def init_params(key):
    """Like `eqx.nn.Linear`: weight and bias uniform in ±1/sqrt(fan_in)."""
    params = {}
    for i, (d_in, d_out) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        key, kw, kb = jax.random.split(key, 3)
        lim = 1 / np.sqrt(d_in)
        params[f"layer{i}"] = {
            "w": jax.random.uniform(kw, (d_in, d_out), minval=-lim, maxval=lim),
            "b": jax.random.uniform(kb, (d_out,), minval=-lim, maxval=lim),
        }
    return params


def forward(params, x):
    n = len(SIZES) - 1
    for i in range(n):
        layer = params[f"layer{i}"]
        x = jnp.dot(x, layer["w"]) + layer["b"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


def loss_fn(params, batch):
    x, y = batch
    logits = forward(params, x)
    kfac_jax.register_softmax_cross_entropy_loss(logits, y)
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, y[:, None], axis=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--exact-inverses", action="store_true")
    args = parser.parse_args()
    if args.steps % INVERSE_EVERY:
        parser.error(f"--steps must be a multiple of {INVERSE_EVERY}")

    params = init_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (args.batch, 64))
    y = jax.random.randint(jax.random.key(2), (args.batch,), 0, 10)
    batch = (x, y)

    optimizer = kfac_jax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss_fn),
        l2_reg=0.0,
        use_adaptive_learning_rate=False,
        use_adaptive_momentum=False,
        use_adaptive_damping=False,
        initial_damping=1e-3,
        estimation_mode="fisher_gradients",
        curvature_ema=0.95,
        inverse_update_period=INVERSE_EVERY,
        use_exact_inverses=args.exact_inverses,
        num_burnin_steps=0,
        multi_device=False,
    )
    rng = jax.random.key(3)
    rng, sub = jax.random.split(rng)
    state = optimizer.init(params, sub, batch)
    hyper = dict(
        learning_rate=jnp.asarray(1e-2),
        momentum=jnp.asarray(0.9),
        damping=jnp.asarray(1e-3),
    )

    def step(params, state, rng):
        rng, sub = jax.random.split(rng)
        params, state, stats = optimizer.step(params, state, sub, batch=batch, **hyper)
        jax.block_until_ready((params, state, stats))
        return params, state, rng, stats

    for _ in range(INVERSE_EVERY):  # compile and warm up
        params, state, rng, stats = step(params, state, rng)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        params, state, rng, stats = step(params, state, rng)
        times.append(time.perf_counter() - t0)
    times = np.array(times) * 1e3

    print(
        f"machine: {platform.machine()}, {jax.devices()[0].device_kind}, jax {jax.__version__}, kfac_jax {kfac_jax.__version__}"
    )
    mode = (
        "exact inverses (eigh)" if args.exact_inverses else "factored damping (default)"
    )
    print(
        f"MLP 64-512-512-10 relu, batch {args.batch}, {args.steps} steps after warm-up, {mode}"
    )
    print(
        f"kfac_jax step: mean {times.mean():.2f} ms, median {np.median(times):.2f} ms "
        f"(max {times.max():.2f} ms, min {times.min():.2f} ms); final loss "
        f"{float(stats['loss']):.4f}"
    )


if __name__ == "__main__":
    main()
