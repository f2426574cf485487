"""Every relative link in README.md and docs/ leads somewhere.

A link resolves when its file (or folder) exists inside the repository and, for
a ``#anchor``, when the markdown file it names has a heading with that slug, as
GitHub makes them. External links (``http(s)://``, ``mailto:``) are not fetched.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
# A code span may wrap lines inside a paragraph, never across a blank line.
CODE_SPAN = re.compile(r"(`+)(?:(?!\n\s*\n).)*?\1", re.DOTALL)
# [text](target) and ![alt](target), the text possibly wrapped; a target may
# be wrapped in <...> and may carry a "title" after it.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?[^)]*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)", re.MULTILINE)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def _prose_lines(text: str) -> list[str]:
    """The lines, those of fenced code blocks (fences included) made empty."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code."""
    prose = "\n".join(_prose_lines(text))
    prose = CODE_SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), prose)
    found = [*INLINE_LINK.finditer(prose), *REFERENCE_DEF.finditer(prose)]
    return sorted((prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in found)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation other than '-' and
    ' ' dropped (letters, digits and '_' stay), each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's slug; a repeated one also as slug-1, slug-2, ..."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose_lines(text):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with each relative link of ``page``, one line each."""
    text = page.read_text(encoding="utf-8")
    problems = []
    for number, target in links(text):
        where = f"{page.relative_to(root)}:{number}: {target}"
        if not target or EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(root):
            problems.append(f"{where}: leaves the repository")
        elif not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md":
            if anchor not in anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"{where}: no heading #{anchor} in {dest.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken(page) == []


def test_the_checker_sees_a_broken_link(tmp_path):
    """A checker that finds nothing would pass any page: show it bad ones."""
    root = tmp_path / "repo"
    root.mkdir()
    (root / "there.md").write_text(
        "# A heading, with: punctuation\n## Twice\n## Twice\n"
    )
    page = root / "page.md"
    page.write_text(
        "[ok](there.md#a-heading-with-punctuation) [ok](there.md#twice-1) "
        "[ok](#mine) [gone](missing.md) [bad anchor](there.md#nope)\n"
        "`[in code](missing.md)` [web](https://example.com/x) `a code\n"
        "span](missing.md)` [wrapped\ntext](there.md#twice-2)\n"
        "```\n[fenced](missing.md)\n```\n"
        "[out](../elsewhere.md)\n\n# Mine\n"
    )
    assert [line.split(": ", 1)[1] for line in broken(page, root)] == [
        "missing.md: no such file",
        "there.md#nope: no heading #nope in there.md",
        "there.md#twice-2: no heading #twice-2 in there.md",
        "../elsewhere.md: leaves the repository",
    ]


def test_slug_follows_github():
    assert slug("Compatibility across vLLM versions") == (
        "compatibility-across-vllm-versions"
    )
    assert slug("Vetting a vLLM upgrade: `specshim check`") == (
        "vetting-a-vllm-upgrade-specshim-check"
    )
    assert slug("What `verify` costs there") == "what-verify-costs-there"
    assert slug("On the H200: where `generate()`'s time goes now") == (
        "on-the-h200-where-generates-time-goes-now"
    )
