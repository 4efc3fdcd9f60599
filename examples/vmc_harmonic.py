r"""Natural-gradient variational Monte Carlo for the 1-D harmonic oscillator.

The Hamiltonian $H = -\tfrac12 \frac{d^2}{dx^2} + \tfrac12 x^2$ has ground-state
energy $\tfrac12$, with wavefunction $\propto e^{-x^2/2}$. The script minimises the
variational energy $E(\theta) = \langle\psi|H|\psi\rangle / \langle\psi|\psi\rangle$
over the trial wavefunctions $\psi(x) = \exp(-a x^2 + b x)$ ($a > 0$), an
`eqx.Module` with parameters $\theta = (\log a, b)$. The energy is estimated by
Monte Carlo: $x$ is drawn from $|\psi|^2$, which for this family is exactly a normal
distribution (mean $b/(2a)$, variance $1/(4a)$), and

$$
E \approx \operatorname{mean} E_L(x), \qquad
E_L = -\frac12 \frac{\psi''}{\psi} + \frac12 x^2 \quad \text{(the local energy)}.
$$

Its gradient is $\nabla E = 2\,\mathrm{Cov}(E_L, O)$ with
$O = \partial_\theta \log\psi$, the gradient of the *surrogate*
$\operatorname{mean}(\mathrm{stop\_gradient}(E_L - \bar E) \cdot 2 \log\psi(x))$;
the value reported is $E$. Stochastic reconfiguration preconditions it with
$S = \mathrm{Cov}(O)$, the metric of the family of distributions $|\psi|^2$ (its
Fisher information is $4S$).

Where eqfisher comes in: `value_grad_and_curvature(..., surrogate=True)` returns
$E$, the surrogate's gradient and the curvature of the *registered* loss in one
call. The script registers `ef.squared_error` on $f(x) = 2 \log\tilde\psi(x)$, with
$\tilde\psi = \psi / \lVert\psi\rVert$ the normalised wavefunction
($\lVert\psi\rVert$ is known in closed form here). The GGN of a squared error is
$\frac1N \sum_n J_n^\top J_n$ with $J_n = \partial_\theta f(x_n) = 2 \tilde O_n$,
i.e. $4 \operatorname{mean}(\tilde O \tilde O^\top)$; and because $\tilde\psi$ is
normalised, $\tilde O = \partial_\theta \log\tilde\psi$ is a score function with
mean zero under $|\tilde\psi|^2$, so this is an unbiased estimate of
$4\,\mathrm{Cov}(O) = 4S$ without any centring. (Centring inside the loss would
couple the examples, which the per-example pass of `ef.Dense()` does not allow.)
The targets of the squared error do not enter its GGN.

Run it with `python examples/vmc_harmonic.py` (add `--smoke` for a short run).
"""

import argparse
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

import eqfisher as ef


class Gaussian(eqx.Module):
    """ψ(x) = exp(−a x² + b x) with a = exp(log_a)."""

    log_a: Float[Array, ""]
    b: Float[Array, ""]

    def log_psi(self, x: Float[Array, " n"]) -> Float[Array, " n"]:
        return -jnp.exp(self.log_a) * x**2 + self.b * x

    def log_norm(self) -> Float[Array, ""]:
        """log ‖ψ‖ = ½ log ∫ ψ² dx = ¼ log(π / (2a)) + b² / (4a)."""
        a = jnp.exp(self.log_a)
        return 0.25 * jnp.log(math.pi / (2 * a)) + self.b**2 / (4 * a)

    def local_energy(self, x: Float[Array, " n"]) -> Float[Array, " n"]:
        # ψ''/ψ = g'' + g'² for ψ = exp(g), g = −a x² + b x.
        a = jnp.exp(self.log_a)
        slope = -2 * a * x + self.b
        return -0.5 * (-2 * a + slope**2) + 0.5 * x**2

    def sample(self, key, n: int) -> Float[Array, " n"]:
        a = jnp.exp(self.log_a)
        z = jax.random.normal(key, (n,), self.b.dtype)
        return self.b / (2 * a) + z / jnp.sqrt(4 * a)


def loss_fn(psi: Gaussian, x: Float[Array, " n"]):
    """Returns (energy, gradient surrogate) and registers the SR metric as a loss."""
    e_local = psi.local_energy(x)
    energy = jnp.mean(e_local)
    centred = jax.lax.stop_gradient(e_local - energy)
    surrogate = jnp.mean(centred * 2 * psi.log_psi(x))
    # The registered loss is only there for its curvature (see the module docstring):
    # its value, 0, is added so that nothing downstream can drop the registration.
    f = (2 * (psi.log_psi(x) - psi.log_norm()))[:, None]
    fit = ef.squared_error(f, jax.lax.stop_gradient(f))
    return energy + fit, surrogate


def main(smoke: bool = False) -> dict:
    steps = 40 if smoke else 100
    samples = 1000 if smoke else 4000
    learning_rate = 0.5  # the metric is 4S, so this is an SR step of 2.0
    damping = 1e-3
    psi = Gaussian(
        jnp.asarray(math.log(1.5), jnp.float32), jnp.asarray(0.8, jnp.float32)
    )

    # `Dense()` gives the whole 2x2 metric; with a bigger ansatz use `KFAC()`.
    vgc = ef.value_grad_and_curvature(
        loss_fn, estimator=ef.GGN(), structure=ef.Dense(), surrogate=True
    )

    @eqx.filter_jit
    def step(psi, key):
        x = psi.sample(key, samples)
        energy, grads, curv = vgc(psi, x)
        direction = curv.solve(grads, damping)  # (4S + λI)⁻¹ ∇E
        psi = eqx.apply_updates(
            psi, jax.tree_util.tree_map(lambda d: -learning_rate * d, direction)
        )
        return psi, energy

    key = jax.random.key(0)
    energies = []
    for i in range(steps):
        psi, energy = step(psi, jax.random.fold_in(key, i))
        energies.append(float(energy))
        if i % 10 == 0 or i == steps - 1:
            print(
                f"step {i:3d}  E = {energies[-1]:.5f}  "
                f"a = {float(jnp.exp(psi.log_a)):.4f}  b = {float(psi.b):+.4f}"
            )

    # A fresh estimate at the final parameters (the loop reports the energy before
    # each step).
    x = psi.sample(jax.random.key(1), samples)
    final = float(jnp.mean(psi.local_energy(x)))
    print(f"final energy {final:.5f} (exact ground state: 0.5)")

    # Check the metric against its definition: 4·mean(Õ Õᵀ), Õ = ∂ log ψ̃ / ∂θ.
    metric = vgc(psi, x)[2].as_matrix()

    def log_psi_normalised(theta):
        p = Gaussian(theta[0], theta[1])
        return p.log_psi(x) - p.log_norm()

    o = jax.jacobian(log_psi_normalised)(jnp.stack([psi.log_a, psi.b]))
    expected = 4 * o.T @ o / samples
    return {
        "energy": final,
        "metric_error": float(jnp.max(jnp.abs(metric - expected))),
        "metric_scale": float(jnp.max(jnp.abs(expected))),
        "a": float(jnp.exp(psi.log_a)),
        "b": float(psi.b),
        "energies": energies,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a short run")
    main(smoke=parser.parse_args().smoke)
