"""eqfisher.spectral against curvlinops: error and time at equal numbers of products.

curvlinops (PyTorch) is not a dependency of eqfisher. Install it in its own virtual
environment, then run this script with eqfisher's Python and point it at the other:

    python3 -m venv /tmp/cl-venv
    /tmp/cl-venv/bin/pip install torch==2.13.0 curvlinops-for-pytorch numpy
    .venv/bin/python benchmarks/spectral_vs_curvlinops.py \\
        --curvlinops-python /tmp/cl-venv/bin/python [--repeats 10] [--matvecs 30 120 480]

Without `--curvlinops-python` only eqfisher's side runs. The script writes the MLP's
weights, the data and probe vectors to an .npz (`--data`), and runs itself with
`--side curvlinops` in the other environment on that file (that side imports only
torch, numpy, scipy and curvlinops), so both sides use identical inputs.

Problem: an MLP 64-32-32-10 (tanh) on the first 256 digits (scikit-learn), mean
softmax cross-entropy, float32 on both sides; the operator is the exact GGN
(`ef.ggn_operator`; curvlinops's `GGNLinearOperator`), 3,466 parameters. The
reference is the dense GGN in float64 (`as_matrix()` of the float64 operator), and
its eigendecomposition. Both sides are first checked to be the same operator (GGN
products with 4 probe vectors).

For each number m of products and each estimator, `--repeats` estimates with
different seeds; the table gives the root-mean-square relative error over the
repeats and the median time per estimate (eqfisher: jitted, the operator rebuilt
inside the jitted function from model and data, compilation excluded and reported;
curvlinops: eager PyTorch on CPU). Estimators (eqfisher | curvlinops):

- trace: `Hutchinson` | `hutchinson_trace`, `HutchPlusPlus` | `hutchpp_trace`,
  `XTrace` | `xtrace`; diagonal: `Hutchinson` | `hutchinson_diag`, `XTrace` | `xdiag`
  (relative error ‖d̂ − d‖/‖d‖); squared Frobenius norm: both Hutchinson.
- top-5 eigenvalues: `top_eigenpairs(k=5, iterations=m)` | SciPy `eigsh(k=5,
  which="LA")` on `to_scipy()` (its number of products is counted, not set);
  error: the largest relative error of the five.
- spectral density with m Lanczos nodes, one run, grid boundaries the true extreme
  eigenvalues on both sides, kappa 3: `lanczos_quadrature(...).density()` with and
  without reorthogonalisation | `lanczos_approximate_spectrum`; error: ∫|p̂ − p| dλ
  (in [0, 2]) against the same Gaussian smoothing (same width) of the true
  eigenvalues.
"""

import argparse
import json
import math
import pathlib
import platform
import subprocess
import sys
import time


SIZES = (64, 32, 32, 10)
EXAMPLES = 256
TOP_K = 5
KAPPA = 3.0
POINTS = 1024


# ----------------------------------------------------------------------------------
# curvlinops side (PyTorch only)


def curvlinops_side(args) -> None:
    import numpy as np
    import scipy.sparse.linalg as sla
    import torch
    from curvlinops import (
        GGNLinearOperator,
        hutchinson_diag,
        hutchinson_squared_fro,
        hutchinson_trace,
        hutchpp_trace,
        lanczos_approximate_spectrum,
        xdiag,
        xtrace,
    )

    data = np.load(args.data)
    layers = []
    for i in range(len(SIZES) - 1):
        lin = torch.nn.Linear(SIZES[i], SIZES[i + 1])
        lin.weight.data = torch.from_numpy(data[f"w{i}"])
        lin.bias.data = torch.from_numpy(data[f"b{i}"])
        layers += [lin, torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"]).long()
    params = [p for p in model.parameters() if p.requires_grad]
    op = GGNLinearOperator(
        model, torch.nn.CrossEntropyLoss(reduction="mean"), params, [(x, y)]
    )
    out = {"probe": (op @ torch.from_numpy(data["probe"])).numpy().tolist()}
    low, high = float(data["eig_min"]), float(data["eig_max"])

    def timed(fn):
        start = time.perf_counter()
        value = fn()
        return value, time.perf_counter() - start

    estimators = {
        "trace hutchinson": lambda m: hutchinson_trace(op, m),
        "trace hutch++": lambda m: hutchpp_trace(op, m),
        "trace xtrace": lambda m: xtrace(op, m),
        "diagonal hutchinson": lambda m: hutchinson_diag(op, m),
        "diagonal xdiag": lambda m: xdiag(op, m),
        "frobenius hutchinson": lambda m: hutchinson_squared_fro(op, m),
        "density papyan": lambda m: lanczos_approximate_spectrum(
            op, m, num_points=POINTS, kappa=KAPPA, boundaries=(low, high)
        )[1],
    }
    for name, fn in estimators.items():
        for m in args.matvecs:
            values, times = [], []
            for seed in range(args.repeats):
                torch.manual_seed(seed)
                np.random.seed(seed)  # Papyan's Lanczos start vector is torch's
                value, t = timed(lambda fn=fn, m=m: fn(m))
                values.append(np.asarray(value, np.float64).tolist())
                times.append(t)
            out[f"{name} {m}"] = {"values": values, "times": times}

    scipy_op = op.to_scipy()
    counted = {"n": 0}

    def matvec(v):
        counted["n"] += 1 if v.ndim == 1 else v.shape[1]
        return scipy_op @ v

    wrapped = sla.LinearOperator(scipy_op.shape, matvec=matvec, dtype=scipy_op.dtype)
    values, times, counts = [], [], []
    for seed in range(args.repeats):
        counted["n"] = 0
        v0 = np.random.default_rng(seed).normal(size=scipy_op.shape[0])
        value, t = timed(
            lambda v0=v0: sla.eigsh(
                wrapped, k=TOP_K, which="LA", v0=v0, return_eigenvectors=False
            )
        )
        values.append(np.sort(value)[::-1].tolist())
        times.append(t)
        counts.append(counted["n"])
    out["eigsh"] = {"values": values, "times": times, "matvecs": counts}
    out["versions"] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    pathlib.Path(args.result).write_text(json.dumps(out))


# ----------------------------------------------------------------------------------
# eqfisher side


def eqfisher_side(args) -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.flatten_util import ravel_pytree
    from sklearn.datasets import load_digits

    import eqfisher as ef
    from eqfisher import spectral as sp

    jax.config.update("jax_enable_x64", True)

    xs, ys = load_digits(return_X_y=True)
    x = (xs[:EXAMPLES] / 16.0).astype(np.float32)
    y = ys[:EXAMPLES].astype(np.int32)
    model = eqx.nn.MLP(
        SIZES[0],
        SIZES[-1],
        SIZES[1],
        len(SIZES) - 2,
        activation=jnp.tanh,
        dtype=jnp.float32,
        key=jax.random.key(0),
    )

    def loss_fn(model, batch):
        x, y = batch
        return ef.softmax_cross_entropy(jax.vmap(model)(x), y)

    batch = (jnp.asarray(x), jnp.asarray(y))
    flat, _ = ravel_pytree(eqx.filter(model, eqx.is_inexact_array))
    size = flat.size

    # The float64 reference.
    model64 = jax.tree.map(
        lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, model
    )
    batch64 = (batch[0].astype(jnp.float64), batch[1])
    dense = np.asarray(
        eqx.filter_jit(lambda m, b: ef.ggn_operator(loss_fn, m, b).as_matrix())(
            model64, batch64
        )
    )
    eig = np.linalg.eigvalsh(dense)
    ref = {
        "trace": np.trace(dense),
        "diagonal": np.diag(dense),
        "frobenius": np.sum(dense**2),
        "top": eig[::-1][:TOP_K],
    }
    probe = np.random.default_rng(0).normal(size=(size, 4)).astype(np.float32)

    arrays = {"x": x, "y": y, "probe": probe, "eig_min": eig[0], "eig_max": eig[-1]}
    for i, layer in enumerate(model.layers):
        arrays[f"w{i}"] = np.asarray(layer.weight)
        arrays[f"b{i}"] = np.asarray(layer.bias)
    np.savez(args.data, **arrays)

    def reference_density(m):
        # The grid of both libraries: the boundaries padded by 5% of the width.
        pad = 0.05 * (eig[-1] - eig[0])
        low, high = eig[0] - pad, eig[-1] + pad
        centre, half = (high + low) / 2, (high - low) / 2
        sigma = 2 / (m - 1) / math.sqrt(8 * math.log(KAPPA))
        grid = np.linspace(-1, 1, POINTS)
        z = (grid[:, None] - (eig[None] - centre) / half) / sigma
        p = np.exp(-0.5 * z**2).sum(1) / (size * sigma * math.sqrt(2 * math.pi) * half)
        return grid * half + centre, p

    def errors(kind, values, m):
        values = np.asarray(values, np.float64)
        if kind == "diagonal":
            e = np.linalg.norm(values - ref["diagonal"], axis=1)
            return e / np.linalg.norm(ref["diagonal"])
        if kind == "top":
            return np.max(np.abs(values - ref["top"]) / ref["top"], axis=1)
        if kind == "density":
            grid, p = reference_density(m)
            return np.trapezoid(np.abs(values - p[None]), grid, axis=1)
        return np.abs(values - ref[kind]) / abs(ref[kind])

    bounds = (float(eig[0]), float(eig[-1]))
    estimators = {
        "trace hutchinson": lambda m: (
            lambda op, k: sp.trace(op, sp.Hutchinson(matvecs=m), key=k)
        ),
        "trace hutch++": lambda m: (
            lambda op, k: sp.trace(op, sp.HutchPlusPlus(matvecs=m), key=k)
        ),
        "trace xtrace": lambda m: (
            lambda op, k: sp.trace(op, sp.XTrace(matvecs=m), key=k)
        ),
        "diagonal hutchinson": lambda m: (
            lambda op, k: ravel_pytree(
                sp.diagonal(op, sp.Hutchinson(matvecs=m), key=k)
            )[0]
        ),
        "diagonal xdiag": lambda m: (
            lambda op, k: ravel_pytree(sp.diagonal(op, sp.XTrace(matvecs=m), key=k))[0]
        ),
        "frobenius hutchinson": lambda m: (
            lambda op, k: sp.squared_frobenius_norm(op, matvecs=m, key=k)
        ),
        "top lanczos": lambda m: (
            lambda op, k: sp.top_eigenpairs(op, TOP_K, key=k, iterations=m)[0]
        ),
        "density reorthogonalised": lambda m: (
            lambda op, k: sp.lanczos_quadrature(op, iterations=m, key=k).density(
                points=POINTS, kappa=KAPPA, boundaries=bounds
            )[1]
        ),
        "density papyan": lambda m: (
            lambda op, k: sp.lanczos_quadrature(
                op, iterations=m, key=k, reorthogonalise=False
            ).density(points=POINTS, kappa=KAPPA, boundaries=bounds)[1]
        ),
    }
    results = {}
    for name, make in estimators.items():
        for m in args.matvecs:
            est = make(m)
            fn = eqx.filter_jit(
                lambda model, batch, k, est=est: est(
                    ef.ggn_operator(loss_fn, model, batch), k
                )
            )
            start = time.perf_counter()
            jax.block_until_ready(fn(model, batch, jax.random.key(10_000)))
            compile_time = time.perf_counter() - start
            values, times = [], []
            for seed in range(args.repeats):
                start = time.perf_counter()
                value = jax.block_until_ready(fn(model, batch, jax.random.key(seed)))
                times.append(time.perf_counter() - start)
                values.append(np.asarray(value, np.float64))
            results[name, m] = (errors(name.split()[0], values, m), times, compile_time)

    other = None
    if args.curvlinops_python:
        result = pathlib.Path(args.data).with_suffix(".curvlinops.json")
        subprocess.run(
            [
                args.curvlinops_python,
                __file__,
                "--side",
                "curvlinops",
                "--data",
                args.data,
                "--result",
                str(result),
                "--repeats",
                str(args.repeats),
                "--matvecs",
                *map(str, args.matvecs),
            ],
            check=True,
        )
        other = json.loads(result.read_text())
        unravel = ravel_pytree(eqx.filter(model, eqx.is_inexact_array))[1]
        ggn = ef.ggn_operator(loss_fn, model, batch)
        ours = np.asarray(
            jax.vmap(lambda c: ravel_pytree(ggn.mv(unravel(c)))[0], 1, 1)(probe)
        )
        theirs = np.asarray(other["probe"])
        agreement = np.max(np.abs(ours - theirs)) / np.max(np.abs(ours))
        print(f"same operator: max |eqfisher − curvlinops| / max = {agreement:.1e}")

    print(
        f"\nGGN of MLP {'-'.join(map(str, SIZES))} tanh, {EXAMPLES} digits, {size} "
        f"parameters, float32; rank {np.sum(eig > 1e-10 * eig[-1])}; trace "
        f"{ref['trace']:.4g}, λ_max {eig[-1]:.4g}; {args.repeats} repeats; "
        f"jax {jax.__version__}, {platform.processor() or platform.machine()}"
    )
    print(
        "\n| quantity | m | eqfisher | error | time | compile | curvlinops | error | time |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    pairs = {
        "trace hutchinson": "trace hutchinson",
        "trace hutch++": "trace hutch++",
        "trace xtrace": "trace xtrace",
        "diagonal hutchinson": "diagonal hutchinson",
        "diagonal xdiag": "diagonal xdiag",
        "frobenius hutchinson": "frobenius hutchinson",
        "density reorthogonalised": None,
        "density papyan": "density papyan",
        "top lanczos": None,
    }
    for name, theirs in pairs.items():
        for m in args.matvecs:
            err, times, compile_time = results[name, m]
            row = (
                f"| {name.split()[0]} | {m} | {name.split()[1]} | "
                f"{np.sqrt(np.mean(err**2)):.2e} | {np.median(times) * 1e3:.1f} ms | "
                f"{compile_time:.1f} s |"
            )
            if other and theirs:
                o = other[f"{theirs} {m}"]
                oerr = errors(name.split()[0], o["values"], m)
                row += (
                    f" {theirs.split()[1]} | {np.sqrt(np.mean(oerr**2)):.2e} | "
                    f"{np.median(o['times']) * 1e3:.1f} ms |"
                )
            else:
                row += " | | |"
            print(row)
    if other:
        e = other["eigsh"]
        err = errors("top", e["values"], None)
        print(
            f"| top | {int(np.median(e['matvecs']))} (median) | | | | | SciPy eigsh | "
            f"{np.sqrt(np.mean(err**2)):.2e} | {np.median(e['times']) * 1e3:.1f} ms |"
        )
        print(f"\ncurvlinops side: {other['versions']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--side", choices=("eqfisher", "curvlinops"), default="eqfisher"
    )
    parser.add_argument("--curvlinops-python", default=None)
    parser.add_argument("--data", default="/tmp/spectral_mlp.npz")
    parser.add_argument("--result", default="/tmp/spectral_mlp.curvlinops.json")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--matvecs", type=int, nargs="+", default=[30, 120, 480])
    args = parser.parse_args()
    if any(m % 6 for m in args.matvecs):
        sys.exit("--matvecs: multiples of 6 (Hutch++ needs 3 | m, XTrace 2 | m).")
    (curvlinops_side if args.side == "curvlinops" else eqfisher_side)(args)


if __name__ == "__main__":
    main()
