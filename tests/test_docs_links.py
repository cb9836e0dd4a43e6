"""What `mkdocs build --strict` cannot see: the README and the copied plots.

The strict build (`make docs`, a step of `make test`) checks every link and
anchor inside docs/. The README lives outside docs/, so its relative links are
checked here, against the files and, for a `#fragment`, against the headings
of the target the way GitHub makes its anchors.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# [text](target) and ![alt](target); the target ends at whitespace or ")".
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(markdown: str) -> str:
    """``markdown`` without its fenced code blocks (whose lines are not links or headings)."""
    return _FENCE.sub("", markdown)


def relative_links(markdown: str) -> list[str]:
    """Every link target of ``markdown`` that is not a URL, in order."""
    return [
        target
        for target in _LINK.findall(prose(markdown))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target)
    ]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors_of(markdown: str) -> set[str]:
    return {github_anchor(h) for h in _HEADING.findall(prose(markdown))}


def test_github_anchor_follows_githubs_rule() -> None:
    assert github_anchor("The floor at small N, honestly") == "the-floor-at-small-n-honestly"
    assert github_anchor("`--verify`") == "--verify"
    assert github_anchor("Hierarchical aggregation, from a node's side") == (
        "hierarchical-aggregation-from-a-nodes-side"
    )


def test_relative_links_skip_urls_and_code_blocks() -> None:
    text = "[a](docs/x.md#y) [b](https://example.com)\n```\n[c](nope.md)\n```\n![d](p.png)"
    assert relative_links(text) == ["docs/x.md#y", "p.png"]


def test_the_readme_starts_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert lines[0] == "# lossreduce"
    assert lines[2] == "```bash"
    assert lines[3].startswith("make demo   # ")
    assert lines[4].startswith("make test   # ")
    assert lines[5] == "```"


def test_the_readme_is_under_250_lines() -> None:
    n = len(README.read_text().splitlines())
    assert n < 250, f"README.md has {n} lines; move the detail into a page under docs/"


def test_every_relative_link_of_the_readme_resolves() -> None:
    readme = README.read_text()
    links = relative_links(readme)
    assert any(link.startswith("docs/") for link in links), "the README links to no page"
    broken = []
    for link in links:
        path, _, fragment = link.partition("#")
        target = (ROOT / path) if path else README
        if not target.is_file():
            broken.append(f"{link}: no file {path}")
        elif fragment and target.suffix == ".md" and fragment not in anchors_of(target.read_text()):
            broken.append(f"{link}: no heading #{fragment} in {path or 'README.md'}")
    assert not broken, "\n".join(broken)


_CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
# <timestamp>, <job>: what a reader must substitute, which Markdown would take
# for an HTML tag and drop. Real tags in prose (<br>, <sub>) are not used here.
_PLACEHOLDER = re.compile(r"<[a-z_][a-z0-9_ -]*>")


def pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def test_no_placeholder_in_prose_would_vanish_as_an_html_tag() -> None:
    found = [
        f"{page.relative_to(ROOT)}: {match}"
        for page in pages()
        for match in _PLACEHOLDER.findall(_CODE_SPAN.sub("", prose(page.read_text())))
    ]
    assert not found, "write these inside `code` or as &lt;...&gt;:\n" + "\n".join(found)


def test_every_test_the_docs_cite_exists() -> None:
    # The guarantees are "shown by" named tests; a moved or renamed test must
    # take its citation along.
    text = "\n".join(page.read_text() for page in pages())
    missing = [
        path for path in re.findall(r"tests/[\w/]+\.py", text) if not (ROOT / path).is_file()
    ]
    defined = set(
        re.findall(
            r"^\s*(?:async\s+)?def (test_\w+)",
            "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py")),
            flags=re.MULTILINE,
        )
    )
    # A name ending in "*" (`::test_mutual_tls_*`) stands for several tests.
    cited = set(re.findall(r"::(test_\w+)(?![\w*])", text))
    assert cited, "the docs cite no test"
    missing += sorted(f"def {name}" for name in cited - defined)
    assert not missing, f"cited in the docs but not in tests/: {missing}"


@pytest.mark.parametrize(
    ("copy", "original"),
    [
        ("docs/assets/bench_plot.png", "bench/bench_plot.png"),
        ("docs/assets/demo_plot.png", "trainer_worker/train/demo_plot.png"),
    ],
)
def test_the_docs_plots_are_the_ones_beside_the_code(copy: str, original: str) -> None:
    # MkDocs serves only files under docs/, so the pages show copies of the
    # plots the code writes beside itself; a regenerated plot is copied too.
    assert (ROOT / copy).read_bytes() == (ROOT / original).read_bytes(), (
        f"{copy} differs from {original}: copy the regenerated plot into docs/assets/"
    )
