"""Linear datamodeling score (LDS) of influence estimates on digits.

Train a small tanh MLP on N digits; for M random half-subsets S_m retrain it from
the same initialisation (all M at once, `vmap` over example masks) and record each
query's loss. Each influence method predicts the loss on subset m as
−Σ_{t∈S_m} score(q, t); the LDS is the Spearman correlation between predicted and
actual losses across the M subsets, averaged over queries (Park et al., 2023;
kronfluence's evaluation). Memory: XLA's temporary buffers for the compiled score
computation (`memory_analysis`), besides its inputs. Methods: identity, Diagonal, K-FAC, EKFAC (all through
`CurvatureInverse`), the exact GGN by CG (`ConjugateGradient` on `ggn_operator`) and
by a dense solve (`Dense()`), all with the same damping λ = 0.1·tr(G)/P.

Small by design (2 shared CPU cores): `python benchmarks/influence_lds.py` runs
N = 300, 30 queries, M = 30 subsets in a few minutes; `--subsets`, `--train`,
`--queries` change them.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from scipy.stats import spearmanr
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import eqfisher as ef


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def masked_loss(model, batch, mask):
    x, y = batch
    logits = jax.vmap(model)(x)
    per = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]
    return jnp.sum(mask * per) / jnp.sum(mask)


def train(model, batch, mask, steps: int):
    opt = optax.adam(1e-2)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def step(carry, _):
        params, state = carry
        grads = jax.grad(lambda p: masked_loss(eqx.combine(p, static), batch, mask))(
            params
        )
        updates, state = opt.update(grads, state)
        return (optax.apply_updates(params, updates), state), None

    (params, _), _ = jax.lax.scan(step, (params, opt.init(params)), length=steps)
    return eqx.combine(params, static)


def per_query_losses(model, query):
    x, y = query
    logits = jax.vmap(model)(x)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]


def main(n_train=300, n_query=30, subsets=30, steps=500, seed=0):
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0)
    train_set = (jnp.asarray(x_tr[:n_train]), jnp.asarray(y_tr[:n_train], jnp.int32))
    query = (jnp.asarray(x_te[:n_query]), jnp.asarray(y_te[:n_query], jnp.int32))
    init = eqx.nn.MLP(64, 10, 16, 1, activation=jnp.tanh, key=jax.random.key(seed))
    full = jnp.ones(n_train, jnp.float32)
    model = eqx.filter_jit(train)(init, train_set, full, steps)

    rng = np.random.default_rng(seed)
    masks = np.zeros((subsets, n_train), np.float32)
    for m in range(subsets):
        masks[m, rng.choice(n_train, n_train // 2, replace=False)] = 1
    t0 = time.perf_counter()
    retrain = eqx.filter_jit(
        eqx.filter_vmap(
            lambda mask: per_query_losses(train(init, train_set, mask, steps), query)
        )
    )
    actual = np.asarray(retrain(jnp.asarray(masks)))  # (subsets, queries)
    retrain_s = time.perf_counter() - t0

    ggn = ef.ggn_operator(loss_fn, model, train_set)
    dense = ef.curvature(
        loss_fn, model, train_set, estimator=ef.GGN(), structure=ef.Dense()
    )
    size = dense.as_matrix().shape[0]
    damping = float(0.1 * dense.trace() / size)
    curvature = lambda s: ef.curvature(
        loss_fn, model, train_set, estimator=ef.GGN(), structure=s
    )
    methods = {
        "identity": lambda: ef.influence.Identity(),
        "diagonal": lambda: ef.influence.CurvatureInverse(
            curvature(ef.Diagonal()), damping
        ),
        "kfac": lambda: ef.influence.CurvatureInverse(curvature(ef.KFAC()), damping),
        "ekfac": lambda: ef.influence.CurvatureInverse(curvature(ef.EKFAC()), damping),
        "exact (CG)": lambda: ef.influence.ConjugateGradient(
            ggn, damping, rtol=1e-5, atol=1e-5
        ),
        "exact (dense)": lambda: ef.influence.CurvatureInverse(dense, damping),
    }
    scores_fn = eqx.filter_jit(ef.influence.influence_scores)
    print(
        f"N={n_train}, P={size}, queries={n_query}, subsets={subsets}, "
        f"damping={damping:.3g}, retraining {retrain_s:.1f}s"
    )
    print(
        f"{'method':<15}{'LDS':>8}{'± s.e.':>8}{'build s':>9}{'scores s':>10}"
        f"{'temp MiB':>10}"
    )
    rows = {}
    for name, make in methods.items():
        t0 = time.perf_counter()
        inverse = make()
        jax.block_until_ready(inverse)
        build_s = time.perf_counter() - t0
        args = (loss_fn, model, train_set, query, inverse)
        compiled = scores_fn.lower(*args, chunk_size=100).compile()
        memory = compiled.compiled.memory_analysis()
        temp_mb = memory.temp_size_in_bytes / 2**20 if memory is not None else np.nan
        scores_fn(*args, chunk_size=100)
        t0 = time.perf_counter()
        scores = scores_fn(loss_fn, model, train_set, query, inverse, chunk_size=100)
        scores = np.asarray(jax.block_until_ready(scores))
        score_s = time.perf_counter() - t0
        predicted = -masks @ scores.T  # (subsets, queries)
        rho = np.array(
            [spearmanr(predicted[:, q], actual[:, q])[0] for q in range(n_query)]
        )
        lds, se = np.nanmean(rho), np.nanstd(rho) / np.sqrt(np.sum(~np.isnan(rho)))
        rows[name] = (lds, se, build_s, score_s, temp_mb)
        print(
            f"{name:<15}{lds:>8.3f}{se:>8.3f}{build_s:>9.2f}{score_s:>10.3f}"
            f"{temp_mb:>10.2f}"
        )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=300)
    parser.add_argument("--queries", type=int, default=30)
    parser.add_argument("--subsets", type=int, default=30)
    parser.add_argument("--steps", type=int, default=500)
    a = parser.parse_args()
    main(a.train, a.queries, a.subsets, a.steps)
