"""K-FAC as optax transformations, and a one-call training step.

```python
vgc = ef.value_grad_and_curvature(loss_fn, estimator=ef.FisherMC(), structure=ef.KFAC())
like = ef.optim.curvature_like(vgc, model, batch, key=key)  # shapes only
opt = ef.optim.kfac(1e-2, like=like)
state = opt.init(eqx.filter(model, eqx.is_inexact_array))
loss, grads, curv = vgc(model, batch, key=key)
updates, state = opt.update(grads, state, params, curvature=curv)
```

The state holds the averaged curvature and the cached damped inverse from `init`
on, so it has one PyTree structure throughout: a jitted step compiles once and can
be the body of a `lax.scan`, and a fresh `init` is a template for
`eqx.tree_deserialise_leaves`.
"""

from ._adaptive_kfac import (
    AdaptiveKFACState as AdaptiveKFACState,
    kfac_adaptive as kfac_adaptive,
)
from ._compile import fast_compile_options as fast_compile_options
from ._damping import (
    AbstractDamping as AbstractDamping,
    FactoredTikhonov as FactoredTikhonov,
    Tikhonov as Tikhonov,
    tikhonov_inverse as tikhonov_inverse,
)
from ._flat import flatten_if_small as flatten_if_small
from ._graft import GraftState as GraftState, graft as graft
from ._kfac import kfac as kfac, kfac_preconditioner as kfac_preconditioner
from ._quadratic_model import (
    AdaptiveState as AdaptiveState,
    QuadraticModel as QuadraticModel,
    quadratic_model as quadratic_model,
)
from ._state import (
    CURVATURE_UPDATE_PERIOD as CURVATURE_UPDATE_PERIOD,
    DAMPING as DAMPING,
    GRAFTED_DAMPING as GRAFTED_DAMPING,
    GRAFTED_INVERSE_EVERY as GRAFTED_INVERSE_EVERY,
    INVERSE_EVERY as INVERSE_EVERY,
    MOMENTUM as MOMENTUM,
    NORM_CONSTRAINT as NORM_CONSTRAINT,
    PI_DAMPING as PI_DAMPING,
    KFACState as KFACState,
    ScalarOrSchedule as ScalarOrSchedule,
    curvature_like as curvature_like,
    curvature_ok as curvature_ok,
    find_kfac_state as find_kfac_state,
)
from ._step import kfac_step as kfac_step


__all__ = [
    "AbstractDamping",
    "AdaptiveKFACState",
    "FactoredTikhonov",
    "GraftState",
    "KFACState",
    "QuadraticModel",
    "Tikhonov",
    "curvature_like",
    "curvature_ok",
    "fast_compile_options",
    "find_kfac_state",
    "flatten_if_small",
    "graft",
    "kfac",
    "kfac_adaptive",
    "kfac_preconditioner",
    "kfac_step",
    "quadratic_model",
    "tikhonov_inverse",
]
