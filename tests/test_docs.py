"""The documentation: API coverage, docstring examples, the tutorial's code.

- Every public name of `eqfisher` and its public submodules has a `:::` entry on a
  page of the API reference (docs/api/*.md, one page per topic), and every public
  method of a public class is rendered (it has a docstring; mkdocstrings leaves out
  members without one): on its class's entry, or, where that entry shows only the
  members a user calls (`members:`), on the entry of the base class that declares
  it (the protocol of an abstract base, on docs/api/extending.md).
- Every ```python block in a public docstring runs (the docstring examples); every
  public function and class has one, and the main entry points say what they raise.
- docs/getting_started.md's code runs, and what it prints says what the page says.

Docstring examples run as a user runs them: float32 and standard dtype promotion
(this suite's defaults are float64 and strict promotion), each in a fresh copy of
the setup that docs/api/index.md shows (imports, `model`, `batch`, `loss_fn`,
...).
"""

import contextlib
import importlib
import inspect
import pathlib
import re
import sys
import textwrap

import equinox as eqx
import jax
import lineax as lx
import pytest

import eqfisher as ef


ROOT = pathlib.Path(__file__).parents[1]
# The API reference: one page per topic; the setup of the docstring examples is on
# index.md, the abstract base classes with their protocol methods on extending.md.
API_PAGES = {
    p.name: p.read_text() for p in sorted((ROOT / "docs" / "api").glob("*.md"))
}
EXTENDING = "extending.md"
# The public submodules; `eqfisher.internal` is for eqfisher's own tests.
SUBMODULES = (
    "filters",
    "blocks",
    "optim",
    "losses",
    "spectral",
    "laplace",
    "influence",
    "tracing",
)


def _resolve(path: str):
    # The longest importable prefix, then attributes.
    parts = path.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for part in parts[k:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


def _entries() -> dict[str, tuple[str, str]]:
    """`::: path` entries of docs/api/*.md: path -> (page, the options text that
    follows the entry)."""
    out = {}
    for page, text in API_PAGES.items():
        for m in re.finditer(r"^::: (\S+)\n((?:[ \t]+\S.*\n)*)", text, flags=re.M):
            assert m.group(1) not in out, f"{m.group(1)}: two entries"
            out[m.group(1)] = (page, m.group(2))
    return out


def _shows(options: str, name: str) -> bool:
    """Whether an entry with these options renders the member `name`."""
    if "members: false" in options:
        return False
    return "members:" not in options or f"- {name}\n" in options


def _public(module) -> dict[str, object]:
    if hasattr(module, "__all__"):
        names = module.__all__
    else:
        names = [n for n in vars(module) if not n.startswith("_")]
    out = {}
    for n in names:
        obj = getattr(module, n)
        if inspect.ismodule(obj):
            continue
        # Defined in eqfisher (not a re-exported jax or typing name).
        if (getattr(obj, "__module__", "") or "").startswith("eqfisher"):
            out[n] = obj
    return out


def _modules():
    return [ef] + [importlib.import_module(f"eqfisher.{m}") for m in SUBMODULES]


def _public_classes() -> dict[str, type]:
    out = {}
    for module in _modules():
        for name, obj in _public(module).items():
            if inspect.isclass(obj):
                out[f"{module.__name__}.{name}"] = obj
    return out


def test_every_public_submodule_is_listed():
    found = {
        n
        for n, obj in vars(ef).items()
        if inspect.ismodule(obj)
        and not n.startswith("_")
        and obj.__name__.startswith("eqfisher.")
    }
    assert found - {"internal"} <= set(SUBMODULES), found - set(SUBMODULES)


def test_api_reference_covers_every_public_name():
    documented = {id(_resolve(p)) for p in _entries()}
    missing = [
        f"{module.__name__}.{name}"
        for module in _modules()
        for name, obj in _public(module).items()
        if id(obj) not in documented
    ]
    assert not missing, f"not in docs/api/*.md: {missing}"


def test_api_reference_renders_each_name_once():
    # One entry per object (its anchor, which cross-references resolve to, is
    # unique), and every page of the reference is in the navigation.
    by_id: dict[int, list[str]] = {}
    for path in _entries():
        by_id.setdefault(id(_resolve(path)), []).append(path)
    twice = [paths for paths in by_id.values() if len(paths) > 1]
    assert not twice, f"one object, several entries: {twice}"
    config = (ROOT / "mkdocs.yml").read_text()
    for page in API_PAGES:
        assert f"api/{page}" in config, f"docs/api/{page} is not in mkdocs.yml's nav"


def test_api_reference_explains_type_aliases():
    # Aliases in public signatures, which have no `__module__` to find them by.
    for path in ("eqfisher.optim.ScalarOrSchedule",):
        assert path in _entries(), path


def _public_methods(cls: type) -> dict[str, object]:
    out = {}
    for name, attr in vars(cls).items():
        if name.startswith("_"):
            continue
        fn = attr.fget if isinstance(attr, property) else attr
        fn = getattr(fn, "__func__", fn)  # staticmethod, classmethod
        if inspect.isfunction(fn):
            out[name] = fn
    return out


# Bases outside eqfisher whose methods their own documentation describes: a block's
# `mv`, `as_matrix` and `in_structure` are lineax's operator interface.
DOCUMENTED_BY_THEIR_PACKAGE = (lx.AbstractLinearOperator,)


def _rendered(cls: type, name: str, entries, by_id) -> bool:
    """Whether the method `name` of `cls` is rendered: on `cls`'s entry, or (hidden
    there by `members:`, as a method only eqfisher calls is) on the entry of a base
    class that declares it."""
    # As Python's `inspect.getdoc`, the API reference (through
    # docs/hooks/inherit_docstrings.py) takes a missing docstring from the bases.
    if not inspect.getdoc(getattr(cls, name)):
        return False
    if _shows(entries[by_id[id(cls)]][1], name):
        return True
    for base in cls.__mro__[1:]:
        if name not in vars(base):
            continue
        if base in DOCUMENTED_BY_THEIR_PACKAGE:
            return True
        entry = by_id.get(id(base))
        if entry is not None and _shows(entries[entry][1], name):
            return True
    return False


def test_api_reference_covers_every_public_method():
    # A class's entry renders its own members that have a docstring (members
    # inherited, not overridden, are rendered on the base class's entry).
    entries = _entries()
    by_id = {id(_resolve(p)): p for p in entries}
    problems = [
        f"{path}.{name}"
        for path, cls in _public_classes().items()
        if id(cls) in by_id  # else reported by ..._covers_every_public_name
        for name in _public_methods(cls)
        if not _rendered(cls, name, entries, by_id)
    ]
    assert not problems, f"public methods with no API entry: {problems}"


# Abstract bases whose methods are those a user calls (every block has them): on
# their topic page, not on extending.md.
USER_FACING_BASES = ("eqfisher.blocks.AbstractBlock", "eqfisher.MatrixFreeOperator")


def test_extending_page_documents_the_protocols():
    # An abstract base class with public methods (what a subclass implements) is on
    # extending.md, with all its members.
    entries = _entries()
    problems = []
    for path, cls in _public_classes().items():
        entry = next((p for p in entries if _resolve(p) is cls), None)
        if entry is None or entry in USER_FACING_BASES:
            continue
        if inspect.isabstract(cls) and _public_methods(cls):
            page, options = entries[entry]
            if page != EXTENDING or "members:" in options:
                problems.append(f"{path}: on {page} ({options.strip() or 'all'})")
    assert not problems, f"not on {EXTENDING} with all its members: {problems}"


def test_curvature_methods_are_documented():
    # The home page advertises these.
    for name in ("mv", "solve", "as_matrix", "diagonal", "logdet", "trace", "ema"):
        assert inspect.getdoc(getattr(ef.Curvature, name)), name


# --- signatures, as the API reference renders them --------------------------------


@pytest.fixture(scope="module")
def documented():
    """eqfisher as mkdocstrings reads it: griffe, with the extensions of mkdocs.yml
    (docs/hooks/), which write the constructors of Modules and NamedTuples."""
    griffe = pytest.importorskip("griffe")  # in the docs extra
    config = (ROOT / "mkdocs.yml").read_text()
    found = re.findall(r"^\s+- (docs/hooks/\S+\.py):(\w+)$", config, flags=re.M)
    assert found, "no griffe extension in mkdocs.yml"
    extensions = griffe.load_extensions(*(f"{ROOT / f}:{c}" for f, c in found))
    loader = griffe.GriffeLoader(
        extensions=extensions, search_paths=[str(ROOT), *sys.path]
    )
    package = loader.load("eqfisher")
    loader.resolve_aliases(implicit=False, external=True)

    def get(path: str):
        obj = package[path.removeprefix("eqfisher.")]
        return obj.final_target if obj.is_alias else obj

    return get


def _constructed_from_fields(cls: type) -> bool:
    """An `eqx.Module` or `NamedTuple` one constructs (not an abstract base)."""
    if issubclass(cls, tuple):
        return hasattr(cls, "_fields")
    return (
        issubclass(cls, eqx.Module)
        and not inspect.isabstract(cls)
        and not cls.__name__.startswith("Abstract")
    )


def test_class_headings_show_the_constructor(documented):
    # `merge_init_into_class` renders the `__init__` on the class's heading: the
    # one written by hand, or the one the dataclass or NamedTuple makes, which
    # docs/hooks/module_signatures.py writes for griffe (`FisherMC(samples=1)`).
    problems = []
    for path, cls in _public_classes().items():
        if not _constructed_from_fields(cls):
            continue
        init = documented(path).all_members.get("__init__")
        if init is None:
            problems.append(f"{path}: no signature")
            continue
        shown = {p.name: p for p in init.parameters if p.name != "self"}
        actual = inspect.signature(cls).parameters
        if list(shown) != list(actual):
            problems.append(f"{path}: shows {list(shown)}, takes {list(actual)}")
        for name, p in actual.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            has_default = p.default is not inspect.Parameter.empty
            if name in shown and has_default != (shown[name].default is not None):
                problems.append(f"{path}({name}=...): the default")
    assert not problems, problems
    shown = {
        path: {p.name: str(p.default) for p in documented(path).parameters}
        for path in ("eqfisher.FisherMC.__init__", "eqfisher.KFAC.__init__")
    }
    assert shown["eqfisher.FisherMC.__init__"]["samples"] == "1"
    assert shown["eqfisher.KFAC.__init__"]["weight_sharing"] == '"expand"'


# Defaults written with a private name, to replace with a public expression.
PRIVATE_DEFAULTS: set[str] = set()


def _private_names(expression) -> list[str]:
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "", str(expression))  # not in strings
    return re.findall(r"(?<![\w])_[A-Za-z]\w*|object at 0x", text)


def _undocumented_names(expression, documented, entries: set[str]) -> list[str]:
    """The names of eqfisher's in a default that have no API entry (`PI_DAMPING`):
    a reader cannot look them up."""
    import griffe

    if not isinstance(expression, griffe.Expr):
        return []
    out = []
    for part in expression.iterate(flat=True):
        if isinstance(part, griffe.ExprName):
            path = part.canonical_path
            if path.startswith("eqfisher.") and documented(path).path not in entries:
                out.append(str(part))
    return out


def test_signatures_name_no_private_objects(documented):
    # What a user reads and can type: `examples=IndependentExamples()`, not
    # `examples=INDEPENDENT` or `apply=_call` (names they cannot import), nor an
    # object's repr.
    entries = {documented(p).path for p in _entries()}
    found = {}
    for path, obj in _public_names().items():
        functions = [path]
        if inspect.isclass(obj):
            functions = [f"{path}.{m}" for m in _public_methods(obj)]
            if "__init__" in documented(path).all_members:
                functions.append(f"{path}.__init__")
        for f in functions:
            fn = documented(f)
            if not fn.is_function:
                continue  # a property
            names = [
                n
                for p in fn.parameters
                for n in (
                    _private_names(p.default)
                    + _private_names(p.annotation)
                    + _undocumented_names(p.default, documented, entries)
                )
            ] + _private_names(fn.returns)
            if names:
                found[f] = names
    assert not found.keys() - PRIVATE_DEFAULTS, {
        k: v for k, v in found.items() if k not in PRIVATE_DEFAULTS
    }
    assert PRIVATE_DEFAULTS <= found.keys(), (
        f"fixed, remove from PRIVATE_DEFAULTS: {PRIVATE_DEFAULTS - found.keys()}"
    )


# --- docstring examples -----------------------------------------------------------


@contextlib.contextmanager
def as_a_user():
    """JAX's default float32 and promotion rules, as a user runs examples."""
    if hasattr(jax, "enable_x64"):
        enable_x64 = jax.enable_x64
    else:  # older jax
        from jax.experimental import enable_x64
    with (
        jax.numpy_dtype_promotion("standard"),
        jax.numpy_rank_promotion("allow"),
        enable_x64(False),
    ):
        yield


def _documented_objects():
    """(qualified name, object) for every public function, class and method."""
    seen, out = set(), []
    for module in _modules():
        items = [(module.__name__, module)]
        for name, obj in _public(module).items():
            items.append((f"{module.__name__}.{name}", obj))
            if inspect.isclass(obj):
                for m, fn in _public_methods(obj).items():
                    items.append((f"{module.__name__}.{name}.{m}", fn))
        for qual, obj in items:
            if id(obj) not in seen:
                seen.add(id(obj))
                out.append((qual, obj))
    return out


def _examples(obj) -> list[str]:
    doc = inspect.getdoc(obj) or ""
    return [
        textwrap.dedent(code)
        for code in re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    ]


EXAMPLES = [(q, o) for q, o in _documented_objects() if _examples(o)]


@pytest.fixture(scope="module")
def setup() -> dict:
    """The scope docstring examples assume: the setup block of docs/api/index.md."""
    (code,) = re.findall(
        r"<!-- example setup -->\n```python\n(.*?)```",
        API_PAGES["index.md"],
        flags=re.S,
    )
    scope: dict = {}
    with as_a_user():
        exec(compile(code, "docs/api/index.md (example setup)", "exec"), scope)
    return scope


@pytest.mark.parametrize("obj", [o for _, o in EXAMPLES], ids=[q for q, _ in EXAMPLES])
def test_docstring_example_runs(obj, setup):
    scope = dict(setup)
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", "?"))
    codes = _examples(obj)
    assert codes, f"{name}: no example to run"
    with as_a_user():
        for code in codes:
            before = dict(scope)
            exec(compile(code, f"<docstring of {name}>", "exec"), scope)
            # An example shows a result: it (re)binds a name, prints or asserts.
            bound = [k for k, v in scope.items() if before.get(k) is not v]
            assert bound or "print(" in code or "assert " in code, (
                f"{name}: an example that shows nothing"
            )


def _public_names() -> dict[str, object]:
    """Every public function and class (not methods), by its first public path."""
    seen, out = set(), {}
    for module in _modules():
        for name, obj in _public(module).items():
            if id(obj) not in seen:
                seen.add(id(obj))
                out[f"{module.__name__}.{name}"] = obj
    return out


def test_every_public_name_has_an_example():
    # Each example is run by test_docstring_example_runs; this test keeps one from
    # going missing (a new public name, or an example deleted).
    missing = sorted(q for q, obj in _public_names().items() if not _examples(obj))
    assert not missing, f"no ```python example in the docstring: {missing}"


# The main entry points: each carries a runnable example and says what it raises.
MAIN = [
    ef.curvature,
    ef.value_grad_and_curvature,
    ef.find_layers,
    ef.ggn_operator,
    ef.hessian_operator,
    ef.empirical_fisher_operator,
    ef.stop_hessian,
    ef.softmax_cross_entropy,
    ef.squared_error,
    ef.Curvature.solve,
    ef.optim.kfac,
    ef.optim.kfac_step,
    ef.optim.curvature_like,
    ef.filters.by_path,
    ef.spectral.trace,
    ef.laplace.fit,
    ef.influence.influence_scores,
]


@pytest.mark.parametrize("fn", MAIN, ids=[f.__qualname__ for f in MAIN])
def test_main_entry_points_have_an_example_and_raises(fn):
    doc = inspect.getdoc(fn) or ""
    assert _examples(fn), f"{fn.__qualname__}: no ```python example"
    assert "**Raises:**" in doc, f"{fn.__qualname__}: no **Raises:** section"


# --- the pages --------------------------------------------------------------------


def _page_code(name: str) -> list[str]:
    text = (ROOT / "docs" / name).read_text()
    return re.findall(r'```python exec="on"[^\n]*\n(.*?)```', text, flags=re.S)


def test_getting_started_runs(capsys):
    blocks = _page_code("getting_started.md")
    assert len(blocks) >= 4
    scope: dict = {}
    with as_a_user():
        for code in blocks:
            exec(compile(code, "docs/getting_started.md", "exec"), scope)
    out = capsys.readouterr().out
    # What the page's text says about the numbers.
    assert "parameters: 371" in out
    assert scope["C"].shape == (371, 371)
    error = scope["error"]
    # "Here the first is large and the second small."
    assert error(scope["K"], scope["B"]) < 0.5 * error(scope["B"], scope["C"])
    block = scope["kfac"].blocks["layers[0]"]
    assert block.a.shape == (3, 3) and block.g.shape == (16, 16)
    assert abs(scope["kfac"].trace() / scope["exact"].trace() - 1) < 0.1
    # "Both losses fall, and on this tiny problem [...] Adam's falls faster."
    first = float(scope["loss_fn"](scope["model"], scope["batch"]))
    assert scope["kfac_loss"] < 0.2 * first
    assert scope["adam_loss"] < scope["kfac_loss"]
    # "The K-FAC step points much closer to the exact damped Newton step than the
    # gradient does."
    exact = scope["newton_exact"]
    assert scope["cosine"](scope["newton_kfac"], exact) > scope["cosine"](
        scope["grads"], exact
    )


def test_maths_is_served_from_the_site():
    config = (ROOT / "mkdocs.yml").read_text()
    assert "arithmatex" in config
    scripts = re.findall(r"^  - (\S+\.(?:js|css))$", config, flags=re.M)
    assert scripts, "no KaTeX assets in mkdocs.yml"
    for s in scripts:
        assert "://" not in s, f"{s}: loaded from outside the site"
        assert (ROOT / "docs" / s).is_file(), s
    assert list((ROOT / "docs" / "assets" / "katex" / "fonts").glob("*.woff2"))


def test_one_kronecker_order():
    # The code's order (blocks/kronecker.py): a K-FAC block is G ⊗ A on the
    # row-major vec of the (out, in) weight matrix.
    pages = [
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "docs" / "api").glob("*.md"),
        ROOT / "README.md",
    ]
    for page in pages:
        text = page.read_text()
        for bad in ("A ⊗ G", r"A \otimes G", "A⊗G"):
            assert bad not in text, f"{page.name}: {bad!r}; write G ⊗ A"
