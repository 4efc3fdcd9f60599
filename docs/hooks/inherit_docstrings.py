"""Griffe extension: a method without a docstring inherits its base's, as in Python.

`inspect.getdoc` finds a method's docstring in the base classes (a block's `mv`
has lineax's `AbstractLinearOperator.mv` docstring, its `solve` that of
`eqfisher.blocks.AbstractBlock.solve`); mkdocstrings would otherwise leave such
methods out of the API reference. tests/test_docs.py checks coverage by the same
rule.
"""

import re

import griffe


class InheritDocstrings(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs):
        if pkg.name != "eqfisher":
            return
        # The bases outside eqfisher whose docstrings are inherited.
        for name in ("lineax", "equinox"):
            if name not in loader.modules_collection:
                loader.load(name)
        loader.resolve_aliases(implicit=False, external=True)
        for cls in _classes(pkg):
            for name, member in cls.members.items():
                if member.is_alias or not member.is_function or member.docstring:
                    continue
                for base in cls.mro():
                    found = base.members.get(name)
                    if found is not None and found.docstring:
                        text = found.docstring.value
                        if not base.path.startswith("eqfisher"):
                            text = _unlink(text)
                        member.docstring = griffe.Docstring(text, parent=member)
                        break


def _classes(obj):
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.is_class:
            yield member
            yield from _classes(member)
        elif member.is_module:
            yield from _classes(member)


def _unlink(text: str) -> str:
    """Cross-references of another package's docs (`[x][]`, `[x][y]`) as plain code:
    their targets are not on this site."""
    text = re.sub(r"\[`?([^\]`]+)`?\]\[\]", r"`\1`", text)
    return re.sub(r"\[([^\]]+)\]\[[^\]]+\]", r"\1", text)
