"""Generated blocks in hand-written files (the tables of docs/ pages).

A block sits between two marker comments; whatever is between them belongs to
the generator, everything around them to the author. One writer serves the
patch table, the drift table, the matrix's compatibility table and the
benchmark table.
"""

from __future__ import annotations

from specshim._base import SpecShimError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path


def rewrite(path: Path, transform: Callable[[str], str]) -> None:
    """Replace the file's text by ``transform(text)``, writing only on change."""
    text = path.read_text(encoding="utf-8")
    new = transform(text)
    if new != text:
        path.write_text(new, encoding="utf-8")


class Block:
    """The text between ``begin`` and ``end`` (each on a line of its own)."""

    def __init__(self, begin: str, end: str) -> None:
        self.begin, self.end = begin, end

    def _split(self, text: str, where: str) -> tuple[str, str, str]:
        if text.count(self.begin) != 1 or text.count(self.end) != 1:
            raise SpecShimError(
                f"{where}: needs exactly one {self.begin!r} and one {self.end!r} "
                f"(found {text.count(self.begin)} and {text.count(self.end)})"
            )
        head, rest = text.split(self.begin, 1)
        body, tail = rest.split(self.end, 1)
        if "\n" not in body:
            raise SpecShimError(f"{where}: {self.end!r} must follow {self.begin!r}")
        return head, body, tail

    def read(self, text: str, where: str = "text") -> str:
        """The block's content, without the line breaks that frame it."""
        return self._split(text, where)[1].removeprefix("\n").removesuffix("\n")

    def render(self, text: str, content: str, where: str = "text") -> str:
        """``text`` with the block's content replaced by ``content``."""
        head, _, tail = self._split(text, where)
        return f"{head}{self.begin}\n{content}\n{self.end}{tail}"

    def write(self, path: Path, content: str) -> None:
        """Replace the block in the file (written only if it changes)."""
        rewrite(path, lambda text: self.render(text, content, str(path)))
