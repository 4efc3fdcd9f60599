"""The reviewer's checks of issue 27, read from the source with `ast` (nothing is
imported or run):

- no private module that only re-exports (imports, `__all__` and a docstring): a
  package's `__init__` is its face, a public module such as `eqfisher/tracing.py`
  may be one, a private file may not;
- no function body over 60 lines (the docstring not counted);
- no `isinstance` dispatch on the concrete examples, estimators or structures: the
  behaviour lives on the option types, and validation against their `Abstract*` bases
  is fine;
- no layer-kind string comparisons (`kind == "dense"`, `kind in {...}`) outside the
  kind types.
"""

import ast
import pathlib
import re
from collections.abc import Iterator


PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "eqfisher"
MAX_BODY_LINES = 60

# The option types whose concrete subclasses must not be dispatched on; every class
# defined in eqfisher/ that descends from one of them, and is not itself abstract,
# is concrete. The names the issue lists are added, in case one moves out of reach
# of the search (a base spelled through an alias).
OPTION_ROOTS = ("AbstractExamples", "AbstractEstimator", "AbstractStructure")
NAMED_CONCRETE = frozenset(
    {
        "IndependentExamples",
        "InteractingExamples",
        "GGN",
        "FisherMC",
        "FisherExact",
        "EmpiricalFisher",
        "Hessian",
        "Dense",
        "KFAC",
        "EKFAC",
        "Diagonal",
        "BlockDiagonal",
        "PerLayer",
    }
)
_ABSTRACT = re.compile(r"^_*Abstract")

LAYER_KINDS = frozenset({"dense", "conv", "scale_and_shift", "embedding"})
# The files that define the layer kinds as types: the only place their names may be
# compared.
KIND_TYPE_FILES = frozenset({"_tracer/layers/kinds.py"})


def _modules() -> Iterator[tuple[str, ast.Module]]:
    """`(path relative to eqfisher/, parsed module)` for every module."""
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        yield relative, ast.parse(path.read_text(encoding="utf-8"), filename=relative)


def _is_docstring(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def _only_reexports(stmt: ast.stmt) -> bool:
    """Whether `stmt` is an import, a docstring or an assignment to `__all__`."""
    if isinstance(stmt, ast.Import | ast.ImportFrom) or _is_docstring(stmt):
        return True
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, ast.AnnAssign | ast.AugAssign):
        targets = [stmt.target]
    else:
        return False
    return all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)


def _name(node: ast.expr) -> str | None:
    """The name an expression refers to: `C` for `C` and for `module.C`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _ancestors(cls: str, bases: dict[str, set[str]]) -> set[str]:
    out: set[str] = set()
    todo = [cls]
    while todo:
        for b in bases.get(todo.pop(), ()):
            if b not in out:
                out.add(b)
                todo.append(b)
    return out


def _concrete_option_classes() -> frozenset[str]:
    bases: dict[str, set[str]] = {}
    for _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = {n for n in map(_name, node.bases) if n is not None}
                bases.setdefault(node.name, set()).update(names)
    found = set()
    for root in OPTION_ROOTS:
        below = {
            c for c in bases if root in _ancestors(c, bases) and not _ABSTRACT.match(c)
        }
        assert below, f"no concrete subclass of {root} found in eqfisher/"
        found |= below
    return frozenset(found) | NAMED_CONCRETE


def _class_operands(node: ast.expr) -> list[str]:
    """The class names in the second argument of `isinstance`/`issubclass`."""
    elements = node.elts if isinstance(node, ast.Tuple) else [node]
    return [n for n in map(_name, elements) if n is not None]


def _dispatches(
    tree: ast.Module, concrete: frozenset[str]
) -> Iterator[tuple[int, str]]:
    """`(line, class)` for each type test of a value against a concrete class:
    `isinstance`/`issubclass`, `type(x) is C`, and a `case C():` pattern."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and _name(node.func) in ("isinstance", "issubclass")
            and len(node.args) == 2
        ):
            for cls in _class_operands(node.args[1]):
                if cls in concrete:
                    yield node.lineno, cls
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            typed = any(
                isinstance(s, ast.Call) and _name(s.func) == "type" for s in sides
            )
            if typed and any(
                isinstance(op, ast.Is | ast.IsNot | ast.Eq | ast.NotEq)
                for op in node.ops
            ):
                for cls in map(_name, sides):
                    if cls in concrete:
                        yield node.lineno, cls
        elif isinstance(node, ast.MatchClass):
            cls = _name(node.cls)
            if cls in concrete:
                yield node.lineno, cls


def _kind_strings(node: ast.expr) -> set[str]:
    """The layer-kind names `node` spells: a string constant, or a tuple, list or
    set display of them (as in `kind in {"dense", "conv"}`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & LAYER_KINDS
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_kind_strings(e) for e in node.elts))
    if (
        isinstance(node, ast.Call)
        and _name(node.func) in ("frozenset", "set", "tuple")
        and node.args
    ):
        return _kind_strings(node.args[0])
    return set()


def _kind_comparisons(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """`(line, kind)` for each comparison with a layer-kind name (`==`, `!=`, `in`,
    `not in`, `is`), and each `case "dense":` pattern."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                for kind in sorted(_kind_strings(side)):
                    yield node.lineno, kind
        elif isinstance(node, ast.MatchValue):
            for kind in sorted(_kind_strings(node.value)):
                yield node.lineno, kind


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's end
    (comments and blank lines between them count)."""
    body = fn.body[1:] if _is_docstring(fn.body[0]) else fn.body
    if not body:
        return 0
    assert fn.end_lineno is not None
    return fn.end_lineno - body[0].lineno + 1


def test_no_private_module_only_reexports():
    offenders = []
    for relative, tree in _modules():
        parts = pathlib.PurePosixPath(relative).with_suffix("").parts
        private = any(p.startswith("_") for p in parts)
        if parts[-1] == "__init__" or not private:
            continue
        if all(_only_reexports(stmt) for stmt in tree.body):
            offenders.append(relative)
    assert not offenders, (
        "private modules that only re-export (move their content, or import from "
        f"where it is defined): {offenders}"
    )


def test_no_function_body_over_60_lines():
    offenders = []
    for relative, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = _body_lines(node)
                if n > MAX_BODY_LINES:
                    offenders.append(f"{relative}:{node.lineno} {node.name} ({n})")
    assert not offenders, (
        f"function bodies over {MAX_BODY_LINES} lines (docstring not counted): "
        f"{offenders}"
    )


def test_no_isinstance_dispatch_on_options():
    concrete = _concrete_option_classes()
    offenders = sorted(
        f"{relative}:{line} {cls}"
        for relative, tree in _modules()
        for line, cls in _dispatches(tree, concrete)
    )
    assert not offenders, (
        "type tests against concrete examples, estimators or structures (ask the "
        f"object instead; test against an Abstract* base to validate): {offenders}"
    )


def test_no_layer_kind_string_comparisons():
    offenders = sorted(
        f"{relative}:{line} {kind!r}"
        for relative, tree in _modules()
        if relative not in KIND_TYPE_FILES
        for line, kind in _kind_comparisons(tree)
    )
    assert not offenders, (
        "layer-kind names compared as strings outside the kind types "
        f"({sorted(KIND_TYPE_FILES)}): {offenders}"
    )
