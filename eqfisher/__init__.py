"""eqfisher: curvature for Equinox models."""
