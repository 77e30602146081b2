"""SourceWriter: how every generator writes TileLang source, block by block.

    w = SourceWriter()
    with w.block("for k in T.serial(n):"):
        w.line("qb: T.int32 = lo + k")

A line holding several lines (a snippet) is indented as a whole; a block's header is written
at the current depth and its body one level deeper. Four spaces a level, as TVMScript wants.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from engine.codegen.params import KernelParam

INDENT = "    "


class SourceWriter:
    def __init__(self) -> None:
        self._lines: list[str] = []
        self._depth = 0

    def line(self, text: str = "") -> None:
        """`text`, each of its lines at the current depth (an empty text writes nothing)."""
        for ln in text.splitlines():
            self._lines.append(INDENT * self._depth + ln)

    def lines(self, texts: list[str]) -> None:
        for text in texts:
            self.line(text)

    def blank(self, count: int = 1) -> None:
        self._lines.extend([""] * count)

    @contextmanager
    def indented(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    @contextmanager
    def block(self, header: str) -> Iterator[None]:
        """`header` (a for, if, else or with line) here, what the block writes one level below."""
        self.line(header)
        with self.indented():
            yield

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def write_header(w: SourceWriter, comment: str, params: list[KernelParam], preamble: str = "",
                 blank_lines: int = 1) -> None:
    """The program around a kernel's body: `comment` (what generated it), the import,
    `preamble` (module-level lines: symbols, pass configs) and `def main(<params>):`.
    (`blank_lines` after the import: 2 in the backward's pre/post passes, as they always had:
    the source is the compile cache's key.)"""
    w.line(comment)
    w.line("import tilelang.language as T")
    w.blank(blank_lines)
    if preamble:
        w.line(preamble)
        w.blank()
    w.line("@T.prim_func")
    w.line("def main(")
    with w.indented():
        w.lines([p.declaration() + "," for p in params])
    w.line("):")
