"""Spectral densities by stochastic Lanczos quadrature (Papyan, 2020)."""

import math

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array, Float, PRNGKeyArray

from .._refusal import check_count, check_key
from ._flat import checked_symmetric, flatten, require_factorisable
from ._lanczos import lanczos_basis, lanczos_recurrence, tridiagonal_eigh


def _bumps(grid, nodes, weights, sigma):
    """Σ_r Σ_j w_rj N(grid; node_rj, σ²) / repeats."""
    z = (grid[:, None, None] - nodes[None]) / sigma
    g = jnp.exp(-0.5 * z**2) / (sigma * math.sqrt(2 * math.pi))
    return jnp.sum(weights[None] * g, axis=(1, 2)) / nodes.shape[0]


def _check_shape(
    caller: str, points: int, kappa: float | int, margin: float | int
) -> None:
    check_count(points, "points", caller, minimum=2)
    if not kappa > 1:
        raise ValueError(f"`{caller}(kappa=...)` must be greater than 1, got {kappa}.")
    if not margin >= 0:
        raise ValueError(f"`{caller}(margin=...)` must be >= 0, got {margin}.")


class Quadrature(eqx.Module):
    r"""Gauss quadrature rules from Lanczos runs, one per random starting vector $v$:
    $\sum_j \text{weights}[r, j] \cdot f(\text{nodes}[r, j]) = v_r^\top f(A)\, v_r$ for
    polynomials $f$ of degree below $2 \cdot \text{iterations}$, and
    $\approx \operatorname{tr} f(A) / \text{size}$ on average over the runs.

    **Fields:**

    - `nodes`: `(repeats, iterations)`, the Ritz values of each run.
    - `weights`: `(repeats, iterations)`, non-negative, each row summing to one.

    !!! Example

        ```python
        # The rule of one run on an operator with eigenvalues 1, 2, ..., 10 from a
        # vector with equal weight on each eigenvector, as
        # `ef.spectral.lanczos_quadrature(..., iterations=10)` would return it.
        q = ef.spectral.Quadrature(
            nodes=jnp.arange(1.0, 11.0)[None], weights=jnp.full((1, 10), 0.1)
        )
        print(jnp.mean(jnp.sum(q.weights * q.nodes, axis=1)))  # 5.5 = tr(A)/size
        grid, density = q.density(points=400, margin=0.2)
        print(jnp.sum(density) * (grid[1] - grid[0]))  # ≈ 1: a probability density
        ```
    """

    nodes: Float[Array, "repeats m"]
    weights: Float[Array, "repeats m"]

    def __check_init__(self):
        shapes = (jnp.shape(self.nodes), jnp.shape(self.weights))
        if len(shapes[0]) != 2 or shapes[0] != shapes[1]:
            raise ValueError(
                "`eqfisher.spectral.Quadrature(nodes, weights)`: `nodes` and "
                "`weights` must both have shape `(repeats, iterations)`, got "
                f"{shapes[0]} and {shapes[1]}."
            )

    def density(
        self,
        *,
        points: int = 1024,
        kappa: float | int = 3.0,
        margin: float | int = 0.05,
        boundaries: tuple[float, float] | None = None,
    ) -> tuple[Float[Array, " points"], Float[Array, " points"]]:
        r"""The spectral density
        $p(\lambda) = \frac{1}{\text{size}} \sum_i \delta(\lambda - \lambda_i)$,
        smoothed (Papyan's algorithm 2): each node becomes a Gaussian bump whose
        width is set by `kappa` on the spectrum mapped to $[-1, 1]$.

        **Arguments:**

        - `points`: the grid's resolution.
        - `kappa`: the bumps' width parameter, $> 1$ (larger: narrower bumps).
        - `margin`: the grid extends this fraction of the spectrum's width beyond
          `boundaries`.
        - `boundaries`: `(λ_min, λ_max)`; default the extreme nodes.

        **Returns:**

        `(grid, density)`, both of shape `(points,)`. The density integrates to
        one over the real line; over the grid, to less where the bumps of the
        extreme nodes reach past it. They are wide with few Lanczos steps (a
        bump's standard deviation is $2 / \bigl((m - 1) \sqrt{8 \ln \kappa}\bigr)$
        of the grid's half-width for $m$ steps): the density of a rank-deficient
        GGN, much of its mass at the grid's edge, kept 0.61 of it over the grid
        at 3 steps and 0.995 at 20, with the defaults. A larger `margin` keeps
        more.
        """
        _check_shape("eqfisher.spectral.Quadrature.density", points, kappa, margin)
        low, high = _widened(*self._boundaries(self.nodes, boundaries, "density"))
        pad = margin * (high - low)
        low, high = low - pad, high + pad
        centre, half = (high + low) / 2, (high - low) / 2
        sigma = 2 / (self.nodes.shape[1] - 1) / math.sqrt(8 * math.log(kappa))
        grid = jnp.linspace(-1, 1, points, dtype=self.nodes.dtype)
        normalised = (self.nodes - centre) / half
        return grid * half + centre, _bumps(
            grid, normalised, self.weights, sigma
        ) / half

    def log_density(
        self,
        *,
        points: int = 1024,
        kappa: float | int = 1.04,
        margin: float | int = 0.05,
        boundaries: tuple[float, float] | None = None,
        epsilon: float | int = 1e-5,
    ) -> tuple[Float[Array, " points"], Float[Array, " points"]]:
        r"""The density of the spectrum on a logarithmic scale (Papyan's section C.7):
        the bumps are placed at $\log(\lvert \lambda \rvert + \varepsilon)$, so
        eigenvalues spread over orders of magnitude are resolved alike.

        **Arguments:**

        - `points`, `kappa`, `margin`: as in `density`, on the log scale.
        - `boundaries`: `(min |λ|, max |λ|)`; default the extreme |nodes|.
        - `epsilon`: the shift $\varepsilon > 0$ keeping log finite at zero eigenvalues.

        **Returns:**

        `(grid, density)`: `grid` log-spaced values of
        $\lvert \lambda \rvert + \varepsilon$; `density` the density of
        $\lvert \lambda \rvert + \varepsilon$ per unit of $\lambda$ (plot it with a
        logarithmic x-axis).
        """
        _check_shape("eqfisher.spectral.Quadrature.log_density", points, kappa, margin)
        if not epsilon > 0:
            raise ValueError(
                "`eqfisher.spectral.Quadrature.log_density(epsilon=...)` must be "
                f"positive, got {epsilon}."
            )
        magnitudes = jnp.abs(self.nodes)
        low, high = self._boundaries(magnitudes, boundaries, "log_density")
        low, high = _widened(jnp.log(low + epsilon), jnp.log(high + epsilon), log=True)
        pad = margin * (high - low)
        low, high = low - pad, high + pad
        centre, half = (high + low) / 2, (high - low) / 2
        sigma = 2 / (self.nodes.shape[1] - 1) / math.sqrt(8 * math.log(kappa))
        grid = jnp.linspace(-1, 1, points, dtype=self.nodes.dtype)
        normalised = (jnp.log(magnitudes + epsilon) - centre) / half
        values = jnp.exp(grid * half + centre)
        return values, _bumps(grid, normalised, self.weights, sigma) / (half * values)

    @staticmethod
    def _boundaries(nodes, boundaries, method: str):
        if boundaries is None:
            return jnp.min(nodes), jnp.max(nodes)
        low, high = boundaries
        if not isinstance(low, jax.core.Tracer) and not isinstance(
            high, jax.core.Tracer
        ):
            if not (math.isfinite(float(low)) and float(low) < float(high) < math.inf):
                raise ValueError(
                    f"`eqfisher.spectral.Quadrature.{method}(boundaries=(low, "
                    f"high))`: finite, with low < high, got {boundaries!r}."
                )
            if method == "log_density" and float(low) < 0:
                raise ValueError(
                    "`eqfisher.spectral.Quadrature.log_density(boundaries=(low, "
                    "high))`: the log scale is of |λ|, so the boundaries are (min "
                    f"|λ|, max |λ|) with 0 <= low, got {boundaries!r}; for an "
                    "indefinite operator, e.g. `(0.0, max(-λ_min, λ_max))`."
                )
        return jnp.asarray(low, nodes.dtype), jnp.asarray(high, nodes.dtype)


def _widened(low: Array, high: Array, *, log: bool = False) -> tuple[Array, Array]:
    """`(low, high)` at least a hundredth of their magnitude apart (1 apart about
    zero; 0.01 apart on the log scale, `log`): the spectrum of a multiple of the
    identity (or of zero) has one node, and a grid of no width gave NaN
    densities."""
    scale = jnp.maximum(jnp.abs(low), jnp.abs(high))
    floor = 1e-2 if log else jnp.where(scale > 0, 1e-2 * scale, 1.0)
    pad = jnp.maximum(floor - (high - low), 0) / 2
    return low - pad, high + pad


@eqx.filter_jit
def lanczos_quadrature(
    operator: lx.AbstractLinearOperator,
    *,
    iterations: int,
    key: PRNGKeyArray,
    repeats: int = 1,
    reorthogonalise: bool = True,
) -> Quadrature:
    """Stochastic Lanczos quadrature: one Lanczos run per random unit vector.

    `repeats` runs, batched with `jax.vmap`, each of `iterations` products.

    **Arguments:**

    - `operator`: a symmetric lineax operator over parameter PyTrees.
    - `iterations`: Lanczos steps per run (the number of nodes).
    - `key`: a PRNG key for the starting vectors.
    - `repeats`: the number of runs (random vectors) averaged.
    - `reorthogonalise`: full reorthogonalisation (default; memory `iterations` ×
      the number of parameters per run) or the plain three-term recurrence of
      Papyan's algorithm (memory of a few vectors; spurious copies of converged
      Ritz values, which share their weight).

    **Returns:**

    A [`eqfisher.spectral.Quadrature`][]; call its `density()` or `log_density()`.

    !!! Example

        ```python
        q = ef.spectral.lanczos_quadrature(hessian, iterations=40, key=key, repeats=4)
        grid, density = q.density()
        ```
    """
    caller = "eqfisher.spectral.lanczos_quadrature"
    check_count(iterations, "iterations", caller, minimum=2)
    check_count(repeats, "repeats", caller)
    check_key(caller, key)
    flat = flatten(operator, caller)
    require_factorisable(flat, caller)
    if reorthogonalise and iterations > flat.size:
        raise ValueError(
            f"`{caller}(iterations={iterations})` must be at most the operator's size "
            f"{flat.size} with `reorthogonalise=True`."
        )

    def run(k):
        if reorthogonalise:
            alpha, beta, _ = lanczos_basis(flat, iterations, k)
        else:
            alpha, beta = lanczos_recurrence(flat, iterations, k)
        theta, y = tridiagonal_eigh(alpha, beta)
        return theta, y[0] ** 2

    nodes, weights = jax.vmap(run)(jax.random.split(key, repeats))
    nodes, weights = checked_symmetric(flat, key, caller, (nodes, weights))
    return Quadrature(nodes, weights)


@eqx.filter_jit
def spectral_density(
    operator: lx.AbstractLinearOperator,
    *,
    iterations: int,
    key: PRNGKeyArray,
    repeats: int = 1,
    points: int = 1024,
    kappa: float | int | None = None,
    margin: float | int = 0.05,
    boundaries: tuple[float, float] | None = None,
    log: bool = False,
    epsilon: float | int = 1e-5,
) -> tuple[Float[Array, " points"], Float[Array, " points"]]:
    r"""The smoothed spectral density of a symmetric operator, by stochastic Lanczos
    quadrature (Papyan, 2020): `lanczos_quadrature(...)` then its `density(...)`, or
    `log_density(...)` with `log=True`.

    **Arguments:**

    - `operator`, `iterations`, `key`, `repeats`: as in
      [`eqfisher.spectral.lanczos_quadrature`][] (with reorthogonalisation).
    - `points`, `kappa`, `margin`, `boundaries`: as in
      [`eqfisher.spectral.Quadrature.density`][]; `kappa` defaults to 3 (1.04 with
      `log=True`, the values of Papyan and curvlinops).
    - `log`: the density of $\log(\lvert \lambda \rvert + \varepsilon)$ instead, with
      $\varepsilon$ = `epsilon` (see [`eqfisher.spectral.Quadrature.log_density`][]).

    **Returns:**

    `(grid, density)`, both of shape `(points,)`, ready to plot.

    !!! Example

        ```python
        grid, density = ef.spectral.spectral_density(ggn, iterations=40, key=key)
        # plt.semilogy(grid, density) with matplotlib
        ```
    """
    q = lanczos_quadrature(operator, iterations=iterations, key=key, repeats=repeats)
    if kappa is None:
        kappa = 1.04 if log else 3.0
    if log:
        return q.log_density(
            points=points,
            kappa=kappa,
            margin=margin,
            boundaries=boundaries,
            epsilon=epsilon,
        )
    return q.density(points=points, kappa=kappa, margin=margin, boundaries=boundaries)
