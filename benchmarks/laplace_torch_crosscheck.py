"""Cross-check of `eqfisher.laplace` against laplace-torch, on the same weights.

laplace-torch is not a dependency: this script runs in two environments.

1. In eqfisher's environment, float64: train a small tanh MLP on digits, compute
   the log marginal likelihood and the GLM predictive covariances with eqfisher for
   full (`Dense()`), diagonal (`Diagonal()`) and Kronecker (`KFAC()`) posteriors,
   over all weights and over the last layer, and write weights, data and results to
   an .npz:

       .venv/bin/python benchmarks/laplace_torch_crosscheck.py export /tmp/lt.npz

2. In a separate virtual environment with PyTorch and laplace-torch
   (`python -m venv /tmp/lt-venv && /tmp/lt-venv/bin/pip install torch==2.13.0
   laplace-torch`), load the .npz, build the same network in torch (float64), fit
   laplace-torch's `Laplace` with the same prior precision and compare:

       /tmp/lt-venv/bin/python benchmarks/laplace_torch_crosscheck.py compare /tmp/lt.npz

Conventions (see docs/laplace.md): laplace-torch's curvature is that of the summed
loss (our N·C) and its prior precision has our units. Its Kronecker blocks treat a
layer's weight and bias as two blocks (curvlinops' `separate_weight_and_bias=True`),
while eqfisher's K-FAC block couples them through the homogeneous input coordinate;
the Kronecker comparison therefore uses bias-free layers, where both are the same
matrix. Last-layer Laplace in laplace-torch covers the last `nn.Linear`; eqfisher's
`where=by_path("layers[1].*")` selects the same weights.
"""

import sys


PRIOR = 0.7
STRUCTURES = ("full", "diag", "kron")
SUBSETS = ("all", "last_layer")


def export(path: str) -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from sklearn.datasets import load_digits

    import eqfisher as ef

    jax.config.update("jax_enable_x64", True)
    x, y = load_digits(return_X_y=True)
    x = jnp.asarray(x[:200] / 16.0)
    y = jnp.asarray(y[:200], jnp.int32)
    out = {"x": np.asarray(x), "y": np.asarray(y), "prior": PRIOR}

    def loss_fn(model, batch):
        xb, yb = batch
        return ef.softmax_cross_entropy(jax.vmap(model)(xb), yb)

    opt = optax.adam(1e-2)
    for bias in (True, False):
        model = eqx.nn.MLP(
            64,
            10,
            12,
            1,
            activation=jnp.tanh,
            use_bias=bias,
            use_final_bias=bias,
            dtype=jnp.float64,
            key=jax.random.key(0),
        )
        state = opt.init(eqx.filter(model, eqx.is_inexact_array))

        @eqx.filter_jit
        def step(model, state):
            grads = eqx.filter_grad(loss_fn)(model, (x, y))
            updates, state = opt.update(grads, state)
            return eqx.apply_updates(model, updates), state

        for _ in range(300):
            model, state = step(model, state)
        tag = "bias" if bias else "nobias"
        for i, layer in enumerate(model.layers):
            out[f"{tag}_w{i}"] = np.asarray(layer.weight)
            if bias:
                out[f"{tag}_b{i}"] = np.asarray(layer.bias)
        structures = {"full": ef.Dense(), "diag": ef.Diagonal(), "kron": ef.KFAC()}
        for sname, structure in structures.items():
            for subset in SUBSETS:
                where = None if subset == "all" else ef.filters.by_path("layers[1].*")
                post = ef.laplace.fit(
                    loss_fn,
                    model,
                    (x, y),
                    likelihood="classification",
                    structure=structure,
                    where=where,
                    prior_precision=PRIOR,
                )
                key = f"{tag}_{sname}_{subset}"
                out[f"{key}_lml"] = float(post.log_marginal_likelihood())
                _, cov = ef.laplace.glm_predictive(post, x[:20])
                out[f"{key}_var"] = np.asarray(cov)
    np.savez(path, **out)
    print(f"wrote {path}")


def compare(path: str) -> None:
    import numpy as np
    import torch
    from laplace import Laplace

    torch.set_default_dtype(torch.float64)
    data = np.load(path)
    x = torch.as_tensor(data["x"])
    y = torch.as_tensor(data["y"]).long()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=len(y)
    )
    print(
        f"{'model':<8}{'structure':<10}{'weights':<12}{'lml rel. err':>14}"
        f"{'var rel. err':>14}"
    )
    for tag in ("bias", "nobias"):
        bias = tag == "bias"
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 12, bias=bias),
            torch.nn.Tanh(),
            torch.nn.Linear(12, 10, bias=bias),
        )
        with torch.no_grad():
            for i, layer in enumerate((model[0], model[2])):
                layer.weight.copy_(torch.as_tensor(data[f"{tag}_w{i}"]))
                if bias:
                    layer.bias.copy_(torch.as_tensor(data[f"{tag}_b{i}"]))
        for sname in STRUCTURES:
            for subset in SUBSETS:
                la = Laplace(
                    model,
                    "classification",
                    subset_of_weights=subset,
                    hessian_structure=sname,
                    prior_precision=float(data["prior"]),
                )
                la.fit(loader)
                lml = float(la.log_marginal_likelihood())
                _, f_var = la._glm_predictive_distribution(x[:20])
                key = f"{tag}_{sname}_{subset}"
                ours_lml = float(data[f"{key}_lml"])
                ours_var = data[f"{key}_var"]
                lml_err = abs(lml - ours_lml) / abs(ours_lml)
                var_err = np.max(np.abs(f_var.detach().numpy() - ours_var)) / np.max(
                    np.abs(ours_var)
                )
                print(
                    f"{tag:<8}{sname:<10}{subset:<12}{lml_err:>14.2e}{var_err:>14.2e}"
                )


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("export", "compare"):
        sys.exit(__doc__)
    (export if sys.argv[1] == "export" else compare)(sys.argv[2])
