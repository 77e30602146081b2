"""SourceWriter: blocks indent their body one level; snippets keep their own layout."""

from __future__ import annotations

from engine.codegen.params import custom_param, param
from engine.codegen.source import SourceWriter, write_header


def test_blocks_nest_and_snippets_indent_as_a_whole():
    w = SourceWriter()
    with w.block("for k in T.serial(n):"):
        w.line("qb: T.int32 = lo + k")
        with w.block("if qb < 3:"):
            w.line("for i in T.Parallel(4):\n    a[i] = 0")
        w.line("")  # writes nothing
    w.line("done = 1")
    assert w.text() == (
        "for k in T.serial(n):\n"
        "    qb: T.int32 = lo + k\n"
        "    if qb < 3:\n"
        "        for i in T.Parallel(4):\n"
        "            a[i] = 0\n"
        "done = 1\n"
    )


def test_header_declares_main_with_its_parameters():
    w = SourceWriter()
    write_header(w, "# made here", [param("A", (4, "S"), "int8"),
                                    custom_param("C_x", ("heads",), 2, 8, 16, 16)], preamble="X = 1")
    with w.indented():
        w.line("pass")
    assert w.text() == ('# made here\nimport tilelang.language as T\n\nX = 1\n\n@T.prim_func\n'
                        'def main(\n    A: T.Tensor((4, S), "int8"),\n'
                        '    C_x: T.Tensor((8,), "float32"),\n):\n    pass\n')
