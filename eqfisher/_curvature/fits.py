"""Refusing a curvature whose blocks cannot fit in memory, before XLA tries to
allocate them (a `RESOURCE_EXHAUSTED` error, or the host's out-of-memory killer)."""

import contextlib
import contextvars
import math
import os
from collections.abc import Iterator

import equinox as eqx
import jax

from .operator import Curvature


# Set by `memory_estimate`, which traces a curvature to measure it, whatever size.
_MEASURING = contextvars.ContextVar("_MEASURING", default=False)


@contextlib.contextmanager
def measuring() -> Iterator[None]:
    """Within it, `check_fits` lets every size through."""
    token = _MEASURING.set(True)
    try:
        yield
    finally:
        _MEASURING.reset(token)


def measuring_now() -> bool:
    """Whether inside `measuring`."""
    return _MEASURING.get()


def _available() -> tuple[int, str] | None:
    """The bytes of this process's devices together, and what they are: each
    device's `bytes_limit` where its platform reports one (GPUs, TPUs), else the
    host's physical memory (which the CPU devices share); None if neither."""
    limits = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # a platform without memory statistics
            stats = None
        if not stats or "bytes_limit" not in stats:
            break
        limits.append(int(stats["bytes_limit"]))
    else:
        return sum(limits), f"the {len(limits)} local device(s)"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the host"
    except (AttributeError, ValueError, OSError):  # no `sysconf` (Windows)
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_fits(caller: str, curv: Curvature) -> None:
    """Refuses `curv` (traced: its arrays' shapes) when its blocks alone take more
    memory than the devices have, naming the largest and the fixes."""
    if measuring_now():
        return
    available = _available()
    if available is None:
        return
    sizes = {
        name: sum(
            math.prod(x.shape) * x.dtype.itemsize
            for x in jax.tree_util.tree_leaves(block)
            if eqx.is_array(x)
        )
        for name, block in curv.stored.items()
    }
    total, (limit, where) = sum(sizes.values()), available
    if total <= limit:
        return
    largest = sorted(sizes, key=lambda n: -sizes[n])[:3]
    shown = ", ".join(
        f"`{n}`: {type(curv.stored[n]).__name__} of {_gib(sizes[n])}" for n in largest
    )
    raise ValueError(
        f"`{caller}`: the curvature's blocks would take {_gib(total)}, more than "
        f"{where} has ({_gib(limit)}); the largest are {shown}. For a layer with "
        "a large factor (an embedding's input factor is vocabulary × vocabulary), "
        "pass `structure=eqfisher.KFAC(max_factor_dim=...)` (a larger factor is "
        "kept as its diagonal) or `eqfisher.Diagonal()`, give that layer another "
        "structure with `eqfisher.PerLayer`, or cover fewer parameters with "
        "`where=`. `eqfisher.memory_estimate` gives each structure's size without "
        "computing it."
    )
