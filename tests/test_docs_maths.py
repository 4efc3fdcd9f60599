"""The maths on the documentation pages is KaTeX, not Unicode.

Formulas are written as `$...$` (inline) and `$$...$$` (display) for
pymdownx.arithmatex and the KaTeX copy served from docs/assets/katex. These tests
read the Markdown sources:

- outside code and maths, no character that only a formula uses (⊗, ⁻¹, ᵀ, ‖, Σ,
  √, θ, λ, ...), so no formula is left in plain Unicode;
- every `$` and `$$` is balanced, and placed where arithmatex reads it as maths;
- the Kronecker order inside the maths is the code's, G ⊗ A.
"""

import pathlib
import re

import pytest


ROOT = pathlib.Path(__file__).parents[1]
PAGES = (
    "laplace.md",
    "products.md",
    "influence.md",
    "estimators.md",
    "spectral.md",
    "shared_forward.md",
    "scale.md",
    "index.md",
    "getting_started.md",
    "choosing.md",
    "structures.md",
    "losses.md",
    "optim.md",
    "filters.md",
    "layers.md",
    "examples.md",
    "design.md",
    "project.md",
)
# Characters of formulas, never of prose: operators, super- and subscripts, and the
# Greek letters the pages use as symbols. (×, −, · and → also occur in prose:
# "2–5× faster", "768 → 50,257".)
FORMULA_CHARS = set("⊗⊙⁻₋⁰¹²³ᵀₙᵢⱼₖₗ‖Σ∑∏√∇∂∈≈≤≥½αθλδσμπΔΛφτεκψ")
# Names that contain one of them.
NAMES = ("π-damping", "π-damped")

_FENCE = re.compile(r"^( *)(```|~~~).*?^\1\2[ \t]*$", flags=re.M | re.S)
_INLINE_CODE = re.compile(r"(`+)(?!`).+?(?<!`)\1", flags=re.S)
_DISPLAY = re.compile(r"\$\$(.+?)\$\$", flags=re.S)
# As arithmatex reads inline maths: no space just inside the dollars.
_INLINE = re.compile(r"(?<![\\$])\$(?![\s$])((?:\\.|[^\\$])+?)(?<!\s)\$(?!\$)")


def _without_code(text: str) -> str:
    text = _FENCE.sub("", text)
    return _INLINE_CODE.sub("`code`", text)


def _page(name: str) -> str:
    return _without_code((ROOT / "docs" / name).read_text())


def _maths(text: str) -> list[str]:
    """The formulas of a page without its code, display ones first."""
    return _DISPLAY.findall(text) + _INLINE.findall(_DISPLAY.sub("", text))


def _prose(text: str) -> str:
    """Everything that is neither code nor maths."""
    text = _INLINE.sub("", _DISPLAY.sub("", text))
    for name in NAMES:
        text = text.replace(name, "")
    return text


@pytest.mark.parametrize("name", PAGES)
def test_no_unicode_formulas(name):
    text = _page(name)
    found = [
        f"line {i}: {line.strip()}"
        for i, line in enumerate(_prose(text).splitlines(), 1)
        if FORMULA_CHARS & set(line)
    ]
    assert not found, f"{name}: formulas in Unicode, write them as $...$:\n" + (
        "\n".join(found)
    )


@pytest.mark.parametrize("name", PAGES)
def test_dollars_are_balanced(name):
    text = _page(name)
    # Display maths is a paragraph of its own: `$$` opens and closes on lines of
    # their own, with a blank line before and after.
    for m in _DISPLAY.finditer(text):
        before, after = text[: m.start()], text[m.end() :]
        assert re.search(r"\n[ \t]*\n[ \t]*$", before), (
            f"{name}: no blank line before `$$`: {before[-40:]!r}"
        )
        assert re.match(r"[ \t]*\n[ \t]*(\n|$)", after), (
            f"{name}: no blank line after `$$`: {after[:40]!r}"
        )
        assert m.group(1).startswith("\n") and re.search(r"\n[ \t]*$", m.group(1)), (
            f"{name}: put `$$` on lines of their own: {m.group(0)[:40]!r}"
        )
    rest = _DISPLAY.sub("", text)
    assert "$$" not in rest, f"{name}: unbalanced `$$`"
    # Inline maths stays within one paragraph; any `$` left over is unmatched.
    for paragraph in re.split(r"\n[ \t]*\n", rest):
        left = _INLINE.sub("", paragraph.replace(r"\$", ""))
        assert "$" not in left, f"{name}: unmatched `$` in:\n{paragraph}"


@pytest.mark.parametrize("name", PAGES)
def test_arithmatex_reads_every_formula(name):
    # The page through the Markdown extensions of mkdocs.yml that place maths:
    # every formula found above becomes one arithmatex element (inside lists,
    # tables and admonitions too), and no `$` is left in the text.
    markdown = pytest.importorskip("markdown")
    pytest.importorskip("pymdownx", reason="the docs extra")
    # Code blocks (some run by markdown-exec at build time) become a placeholder.
    source = _FENCE.sub(r"\1code", (ROOT / "docs" / name).read_text())
    html = markdown.markdown(
        source,
        extensions=["admonition", "md_in_html", "tables", "pymdownx.arithmatex"],
        extension_configs={"pymdownx.arithmatex": {"generic": True}},
    )
    html = re.sub(r"<code>.*?</code>", "", html, flags=re.S)
    maths = re.findall(r'<(span|div) class="arithmatex">', html)
    assert len(maths) == len(_maths(_without_code(source))), name
    text = re.sub(r'<(span|div) class="arithmatex">.*?</\1>', "", html, flags=re.S)
    assert "$" not in text, f"{name}: a `$` arithmatex did not read as maths"


@pytest.mark.parametrize("name", PAGES)
def test_maths_kronecker_order(name):
    # test_docs.py checks the literal "A \otimes G"; this catches the same order
    # with factors' eigenbases, inverses and damping (Q_A \otimes Q_G, ...).
    bad = re.compile(r"A\b[^\\]*?\\otimes\s*\(?\s*(?:[QS]_)?G\b")
    for formula in _maths(_page(name)):
        for term in re.split(r"[=,;]|\\q?quad", formula):
            assert not bad.search(term), f"{name}: {term!r}; write G \\otimes A"


def test_the_checks_see_formulas():
    # The helpers find maths and Unicode formulas where they are.
    text = "A $G \\otimes A$ block.\n\n$$\nx^\\top y\n$$\n\n`θ` in code, θ⁻¹ not"
    assert _maths(text) == ["\nx^\\top y\n", "G \\otimes A"]
    assert FORMULA_CHARS & set(_prose(_without_code(text))) == {"θ", "⁻", "¹"}
    assert not _INLINE.search("costs $ 5 and $ 6")
