"""Seconds per hyperparameter step of a Dense (full) Laplace posterior: eqfisher
against laplace-torch, on the same weights, in one process.

The model is a 10-32-32-1 tanh MLP (P = 1,441) fitted to scikit-learn's diabetes
data (442 examples, standardised), float64. Both libraries build the full GGN
posterior over all weights and tune one scalar prior precision by Adam on the log
marginal likelihood (laplace-torch's `optimize_prior_precision(method="marglik")`,
eqfisher's `ef.laplace.optimize_hyperparameters`), learning rate 0.1, from 1. The
script prints the seconds per step (steady state; eqfisher's compile apart), their
ratio, and both libraries' tuned prior precision and log marginal likelihood, which
follow the same Adam path and must agree.

laplace-torch is not a dependency of eqfisher: run this in a separate environment
that has both (PyPI's torchvision does not import beside the CPU torch file, and
torchmetrics imports it when present, so it is removed):

    python3 -m venv /tmp/lt-venv
    /tmp/lt-venv/bin/pip install torch==2.13.0 laplace-torch
    /tmp/lt-venv/bin/pip uninstall -y torchvision
    /tmp/lt-venv/bin/pip install -e . scikit-learn
    OPENBLAS_NUM_THREADS=1 /tmp/lt-venv/bin/python benchmarks/laplace_tuning.py --threads 1
    /tmp/lt-venv/bin/python benchmarks/laplace_tuning.py

`--threads 1` runs both libraries on one thread (torch's intra-op threads, XLA's
Eigen pool and BLAS); without it each uses its default threading.
"""

import argparse
import os
import sys
import time


def _one_thread() -> None:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    )
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = "1"


def _train(steps: int):
    """The diabetes MLP trained by full-batch Adam (eqfisher's side, float64)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from sklearn.datasets import load_diabetes

    import eqfisher as ef

    x, y = load_diabetes(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    y = (y - y.mean()) / y.std()
    batch = (jnp.asarray(x), jnp.asarray(y)[:, None])
    model = eqx.nn.MLP(10, 1, 32, 2, activation=jnp.tanh, key=jax.random.key(0))
    model = jax.tree_util.tree_map(
        lambda p: p.astype(jnp.float64) if eqx.is_inexact_array(p) else p, model
    )

    def loss_fn(model, batch):
        xb, yb = batch
        return ef.squared_error(jax.vmap(model)(xb), yb)

    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state):
        grads = eqx.filter_grad(loss_fn)(model, batch)
        updates, state = opt.update(grads, state)
        return eqx.apply_updates(model, updates), state

    for _ in range(steps):
        model, state = step(model, state)
    return model, batch, loss_fn


def _eqfisher(model, batch, loss_fn, steps: int, repeats: int) -> dict:
    import jax

    import eqfisher as ef

    start = time.perf_counter()
    la = ef.laplace.fit(
        loss_fn, model, batch, likelihood="regression", structure=ef.Dense()
    )
    jax.block_until_ready(la)
    fit_s = time.perf_counter() - start
    start = time.perf_counter()
    tuned, _ = ef.laplace.optimize_hyperparameters(la, steps=steps)
    jax.block_until_ready(tuned)
    first_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tuned, _ = ef.laplace.optimize_hyperparameters(la, steps=steps)
        jax.block_until_ready(tuned)
        times.append(time.perf_counter() - start)
    (prior,) = tuned.prior_precision.values()
    return {
        "fit_s": fit_s,
        "compile_s": first_s - min(times),
        "step_s": min(times) / steps,
        "prior": float(prior),
        "lml": float(tuned.log_marginal_likelihood()),
    }


def _laplace_torch(model, batch, steps: int, repeats: int) -> dict:
    import numpy as np
    import torch
    from laplace import Laplace

    torch.set_default_dtype(torch.float64)
    linears = [m for m in model.layers]
    net = torch.nn.Sequential(
        torch.nn.Linear(10, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 1),
    )  # fmt: skip
    with torch.no_grad():
        for layer, ours in zip(net[::2], linears):
            layer.weight.copy_(torch.from_numpy(np.asarray(ours.weight)))
            layer.bias.copy_(torch.from_numpy(np.asarray(ours.bias)))
    x, y = (torch.from_numpy(np.asarray(a)) for a in batch)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=len(x)
    )
    start = time.perf_counter()
    la = Laplace(net, "regression", subset_of_weights="all", hessian_structure="full")
    la.fit(loader)
    fit_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        la.prior_precision = 1.0
        start = time.perf_counter()
        la.optimize_prior_precision(method="marglik", n_steps=steps, lr=0.1)
        times.append(time.perf_counter() - start)
    return {
        "fit_s": fit_s,
        "compile_s": 0.0,
        "step_s": min(times) / steps,
        "prior": float(la.prior_precision),
        "lml": float(la.log_marginal_likelihood()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="1: one thread")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.threads == 1:
        _one_thread()
    import jax

    jax.config.update("jax_enable_x64", True)
    if args.threads == 1:
        import torch

        torch.set_num_threads(1)
    model, batch, loss_fn = _train(500)
    ours = _eqfisher(model, batch, loss_fn, args.steps, args.repeats)
    theirs = _laplace_torch(model, batch, args.steps, args.repeats)
    threads = "one thread" if args.threads == 1 else "default threading"
    print(f"Dense Laplace, P = 1,441, {args.steps} marglik Adam steps, {threads}")
    print(f"{'':>14} {'fit s':>8} {'compile s':>10} {'s/step':>10} {'prior':>12}")
    for name, r in (("eqfisher", ours), ("laplace-torch", theirs)):
        print(
            f"{name:>14} {r['fit_s']:8.3f} {r['compile_s']:10.2f} "
            f"{r['step_s']:10.2e} {r['prior']:12.6f}"
        )
    print(
        f"eqfisher / laplace-torch seconds per step: {ours['step_s'] / theirs['step_s']:.2e}"
    )
    print(
        f"tuned prior rel. diff {abs(ours['prior'] - theirs['prior']) / theirs['prior']:.1e}, "
        f"lml rel. diff {abs(ours['lml'] - theirs['lml']) / abs(theirs['lml']):.1e}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
