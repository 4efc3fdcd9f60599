"""Each public package's `__all__` lists exactly its public names (what `help()`
shows and `from ... import *` binds): a name added to a package's face without
`__all__`, or left in `__all__` after it moved, fails here. (`eqfisher.optim`'s
`__all__` is the documented API: its default constants and `AdaptiveState` are
importable but left out, and `tests/test_docs.py` reads it.)"""

import importlib
import types

import pytest


PACKAGES = [
    "eqfisher",
    "eqfisher.blocks",
    "eqfisher.laplace",
    "eqfisher.spectral",
    "eqfisher.tracing",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_lists_the_public_names(name):
    module = importlib.import_module(name)
    public = {
        n
        for n in vars(module)
        if not n.startswith("_")
        and not isinstance(getattr(module, n), types.ModuleType)
    }
    assert sorted(module.__all__) == sorted(public)


@pytest.mark.parametrize("name", ["eqfisher.filters", "eqfisher.influence"])
def test_all_of_a_module_lists_what_it_defines(name):
    # A module (not a package) imports helpers (`jax`, `Callable`, `Curvature`):
    # its `__all__` is what it defines, plus `filters.combine` (Equinox's).
    module = importlib.import_module(name)
    defined = {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == name
    }
    reexported = {"combine"} if name == "eqfisher.filters" else set()
    assert sorted(module.__all__) == sorted(defined | reexported)
    namespace: dict = {}
    exec(f"from {name} import *", namespace)
    assert "jax" not in namespace and "eqx" not in namespace


def test_star_import_binds_the_api_not_the_submodules():
    namespace: dict = {}
    exec("from eqfisher import *", namespace)
    assert "curvature" in namespace and "KFAC" in namespace
    assert "filters" not in namespace and "losses" not in namespace
