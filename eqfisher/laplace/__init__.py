"""Laplace approximations of the posterior from any eqfisher curvature.

See the docs page "Laplace approximations" for the conventions (the curvature of
the mean loss times N, prior precision per block, noise and temperature).
"""

from ._blockwise import sqrt_inverse_mv as sqrt_inverse_mv
from ._calibration import (
    brier_score as brier_score,
    expected_calibration_error as expected_calibration_error,
    negative_log_likelihood as negative_log_likelihood,
)
from ._diagnosis import (
    PredictiveDiagnosis as PredictiveDiagnosis,
    predictive_diagnosis as predictive_diagnosis,
)
from ._marglik import (
    marglik_training as marglik_training,
    optimize_hyperparameters as optimize_hyperparameters,
)
from ._posterior import Laplace as Laplace, fit as fit
from ._predictive import (
    glm_predictive as glm_predictive,
    laplace_bridge as laplace_bridge,
    predictive_samples as predictive_samples,
    probit as probit,
    softmax_average as softmax_average,
)


# What `from eqfisher.laplace import *` binds, and what `help(eqfisher.laplace)` lists.
__all__ = [
    "Laplace",
    "PredictiveDiagnosis",
    "brier_score",
    "expected_calibration_error",
    "fit",
    "glm_predictive",
    "laplace_bridge",
    "marglik_training",
    "negative_log_likelihood",
    "optimize_hyperparameters",
    "predictive_diagnosis",
    "predictive_samples",
    "probit",
    "softmax_average",
    "sqrt_inverse_mv",
]
