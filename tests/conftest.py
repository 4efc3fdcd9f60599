import os
import subprocess
import sys


# The suite compiles thousands of small XLA programs and runs each a few times, so
# compilation dominates its time. LLVM's cheaper pipeline cuts the suite's time by
# about a third; it changes how fast the code runs, not what it computes (XLA:CPU
# never reassociates floating-point arithmetic). Must be set before JAX initialises
# its backend; flags already in the environment are kept. Benchmarks run without it.
_FAST_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)
# jaxlib 0.9 and 0.10 compile each fusion through XLA:CPU's MLIR fusion emitters,
# which take longer to compile than its older emitters: with the older ones the
# README's pass took 590 s instead of 896 s, every test passing (benchmarks/
# RESULTS.md, "Issue 26, thirty-second session"). jaxlib 0.12 has only the new
# emitters and aborts the process on the flag, so a child process asks this jaxlib
# first, once per run (the workers inherit the answer through the environment).
_OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_EMITTERS_VARIABLE = "EQFISHER_TESTS_OLDER_EMITTERS"


def _jaxlib_takes(flag: str) -> bool:
    probe = "import jax, jax.numpy as jnp; jax.jit(jnp.sin)(1.0)"
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, timeout=300
    )
    return done.returncode == 0


if _EMITTERS_VARIABLE not in os.environ:
    os.environ[_EMITTERS_VARIABLE] = "1" if _jaxlib_takes(_OLDER_EMITTERS) else ""
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        *_FAST_COMPILE,
        *([_OLDER_EMITTERS] if os.environ[_EMITTERS_VARIABLE] else []),
    ]
).strip()

import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jaxtyping  # noqa: E402
import pytest  # noqa: E402


# JAX's persistent compilation cache, one directory for the run, shared by its
# pytest-xdist workers: programs recur across modules (eager operations, shared
# references and models; `_release_compiled_programs` drops them after each module)
# and across workers, and a cached one is read back instead of compiled again. It
# changes no result (an entry is the same executable, keyed by the program, the
# compiler options and the jax version) and cuts the suite's time by about a tenth
# (benchmarks/RESULTS.md, "Issue 26, fifteenth session"). The process that pytest
# starts first makes the directory and removes it at the end (`pytest_unconfigure`);
# the workers it starts inherit its path through the environment.
_CACHE_VARIABLE = "EQFISHER_TESTS_JAX_CACHE"
_OWN_CACHE = _CACHE_VARIABLE not in os.environ
if _OWN_CACHE:
    os.environ[_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="eqfisher-tests-jax-cache-")
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VARIABLE])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_configure(config):
    # jax writes a cache entry in place, not atomically, so a worker can read an
    # entry that another is still writing: jax then warns ("Error reading persistent
    # compilation cache entry ... incomplete or truncated stream", seen once on jax
    # 0.9) and compiles the program itself, as without a cache. Nothing else
    # changes, so the warning is not shown. One cache per worker avoids the race but
    # shares nothing: four modules took 175-180 s against 158-159 s
    # (benchmarks/RESULTS.md, "Issue 26, seventeenth session").
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Error reading persistent compilation cache entry:UserWarning",
    )


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(os.environ.pop(_CACHE_VARIABLE), ignore_errors=True)


# Eight CPU devices, for the data-parallel tests (tests/test_sharding.py); must be set
# before JAX initialises its backend. Every other test runs on the default device,
# the first of them, as on one device: a program sees several devices only when its
# inputs are sharded over a `Mesh`. Processes that tests start (the workers of
# test_multiprocess.py and test_no_hang.py) do not inherit this setting.
jax.config.update("jax_num_cpu_devices", 8)


# Reference comparisons are made in float64; rank and dtype promotion are strict so
# that shape or dtype slips in eqfisher fail loudly instead of broadcasting silently.
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture
def unchecked():
    """Turns jaxtyping's runtime checking off, as for users: the annotations reject
    some bad inputs first (with a `TypeCheckError`) when it is on, before eqfisher's
    own `ValueError`/`TypeError` that users see."""
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module. Each XLA:CPU
    executable holds memory mappings of its own; a worker that keeps the whole
    suite's thousands of programs passes the kernel's `vm.max_map_count` (65,530)
    and LLVM's next allocation crashes it (a segmentation fault in
    `backend_compile_and_load`). Programs are rarely shared between modules."""
    yield
    jax.clear_caches()
