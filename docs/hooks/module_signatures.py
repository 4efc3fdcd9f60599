"""Griffe extension: the constructor signature of a Module or NamedTuple, with defaults.

An `eqx.Module` with no hand-written `__init__` gets a dataclass `__init__` from
its fields, and a `NamedTuple` one from its annotations; griffe reads the source,
sees neither, and the API reference would show `FisherMC` with no signature and its
defaults (`samples=1`) nowhere. This extension writes that `__init__` for griffe, so
that `merge_init_into_class` renders it on the class's heading.

Which parameters, in which order, with which kinds and whether each has a default,
come from the imported class (`inspect.signature`: the fields in order, no
`ClassVar`, `AbstractVar` or `eqx.field(init=False)`, a base's fields first); how
each is written comes from the source: the field's annotation, and its default as
written (`default=...` of `eqx.field`/`dataclasses.field`, `factory()` for a
`default_factory`, or the assigned value).

It also writes out eqfisher's `Literal` aliases in every signature
(`weight_sharing: Literal["expand", "reduce"]`, not `WeightSharing`, a name that is
neither public nor in the API reference). tests/test_docs.py loads eqfisher through
these extensions and checks the constructors they show.
"""

import dataclasses
import importlib
import inspect
import logging
import re

import griffe


_log = logging.getLogger("mkdocs.hooks.module_signatures")

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}


class ModuleSignatures(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs):
        if pkg.name != "eqfisher":
            return
        # Decided before any is written: a class's `__init__` written here is no
        # reason to leave out its subclasses'.
        todo = [cls for cls in _classes(pkg) if "__init__" not in cls.all_members]
        for cls in todo:
            runtime = _runtime(cls)
            if runtime is not None and _generated_init(runtime):
                cls.set_member("__init__", _init(cls, runtime))
        for function in _functions(pkg):
            for p in function.parameters:
                p.annotation = _expand_literals(p.annotation)
            function.returns = _expand_literals(function.returns)


def _classes(obj):
    for member in list(obj.members.values()):
        if member.is_alias:
            continue
        if member.is_class:
            yield member
            yield from _classes(member)
        elif member.is_module:
            yield from _classes(member)


def _functions(obj):
    for member in list(obj.members.values()):
        if member.is_alias:
            continue
        if member.is_function:
            yield member
        elif member.is_class or member.is_module:
            yield from _functions(member)


def _literal_alias(name: griffe.ExprName) -> griffe.Expr | None:
    """The value of `name` if it names a `Literal[...]` alias of eqfisher's."""
    try:
        path = name.canonical_path
        if not path.startswith("eqfisher."):
            return None
        target = name.parent.modules_collection[path]
    except Exception:  # noqa: BLE001 (not found: left as it is)
        return None
    value = getattr(target, "value", None)
    if getattr(target, "is_attribute", False) and isinstance(
        value, griffe.ExprSubscript
    ):
        if value.left.canonical_path in ("typing.Literal", "typing_extensions.Literal"):
            return value
    return None


def _expand_literals(annotation):
    """`annotation` with eqfisher's `Literal` aliases written out.

    `weight_sharing: WeightSharing` names an alias that is not public (nor in the
    API reference); `weight_sharing: Literal["expand", "reduce"]` says what to pass.
    """
    if not isinstance(annotation, griffe.Expr):
        return annotation
    parts, changed = [], False
    for part in annotation.iterate(flat=True):
        value = _literal_alias(part) if isinstance(part, griffe.ExprName) else None
        if value is not None:
            changed = True
            parts.append(_double_quoted(str(value)))
        else:
            parts.append(str(part))
    return "".join(parts) if changed else annotation


def _double_quoted(code: str) -> str:
    """String literals in double quotes, as the source (and ruff) writes them."""
    return re.sub(r"'([^'\"\\]*)'", r'"\1"', code)


def _runtime(cls: griffe.Class):
    try:
        obj = importlib.import_module(cls.module.path)
        for part in cls.path[len(cls.module.path) + 1 :].split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 (not importable: left as griffe read it)
        return None
    return obj if inspect.isclass(obj) else None


def _generated_init(runtime: type) -> bool:
    """Whether `runtime.__init__` is made from fields: an `eqx.Module`'s dataclass
    `__init__`, or a `NamedTuple`'s `__new__`."""
    if issubclass(runtime, tuple) and hasattr(runtime, "_fields"):
        return True
    import equinox as eqx

    # An abstract class is not constructed: no signature to show.
    abstract = inspect.isabstract(runtime) or runtime.__name__.startswith("Abstract")
    return (
        issubclass(runtime, eqx.Module)
        and dataclasses.is_dataclass(runtime)
        and not abstract
    )


def _field(cls: griffe.Class, name: str) -> griffe.Attribute | None:
    """The attribute `name` as the class or its nearest base declares it."""
    try:
        mro = [cls, *cls.mro()]
    except ValueError:
        mro = [cls]
    for base in mro:
        member = base.members.get(name)
        if member is not None and not member.is_alias and member.is_attribute:
            return member
    return None


def _call_arguments(value) -> dict | None:
    """The keyword arguments of `eqx.field(...)` / `dataclasses.field(...)`."""
    if not isinstance(value, griffe.ExprCall):
        return None
    if str(value.function).split(".")[-1] != "field":
        return None
    return {
        a.name: a.value for a in value.arguments if isinstance(a, griffe.ExprKeyword)
    }


def _default(attribute: griffe.Attribute | None, runtime_default) -> object:
    """The default as the source writes it, else as Python prints it."""
    if attribute is not None and attribute.value is not None:
        arguments = _call_arguments(attribute.value)
        if arguments is None:
            value = attribute.value
            return _double_quoted(value) if isinstance(value, str) else value
        if "default" in arguments:
            default = arguments["default"]
            return _double_quoted(default) if isinstance(default, str) else default
        if "default_factory" in arguments:
            return griffe.ExprCall(arguments["default_factory"], [])
    return _double_quoted(repr(runtime_default))


def _init(cls: griffe.Class, runtime: type) -> griffe.Function:
    parameters = [
        griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)
    ]
    for p in inspect.signature(runtime).parameters.values():
        attribute = _field(cls, p.name)
        if attribute is None:
            _log.debug("%s: no source for parameter %s", cls.path, p.name)
        has_default = p.default is not inspect.Parameter.empty
        parameters.append(
            griffe.Parameter(
                p.name,
                annotation=None if attribute is None else attribute.annotation,
                kind=_KINDS[p.kind],
                default=_default(attribute, p.default) if has_default else None,
                docstring=None if attribute is None else attribute.docstring,
            )
        )
    return griffe.Function(
        "__init__",
        lineno=cls.lineno,
        endlineno=cls.lineno,
        parent=cls,
        parameters=griffe.Parameters(*parameters),
        returns=None,
    )
