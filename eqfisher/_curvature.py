"""`Curvature`: the blocks of a whole model, as one lineax operator, and the
functions that build it (`curvature`, `value_grad_and_curvature`).

Where it lives: the operator in `_curvature_operator`, the builder shared by both
functions (parameter selection, grouping, statistics, assembly) in
`_curvature_builder`, the public functions in `_curvature_functions`; this module
re-exports them.
"""

from ._curvature_builder import (
    INDEPENDENT as INDEPENDENT,
    Builder as Builder,
    check_args as check_args,
)
from ._curvature_functions import (
    curvature as curvature,
    value_grad_and_curvature as value_grad_and_curvature,
)
from ._curvature_operator import Curvature as Curvature
