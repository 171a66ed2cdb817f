"""The Python that tests run in child processes compiles, checked without a GPU.

Tests that need a GPU run their scenario in a fresh process from a string; a slip in
that string (an indentation that ``textwrap.dedent`` cannot remove once helpers are
prepended) shows only as a failure on the GPU.  Every literal handed to a ``_child`` or
``_python`` helper of these files is built here as the test builds it and compiled."""

from __future__ import annotations

import ast
import importlib
import textwrap

import pytest

_FILES = ("test_cuda_tms_process", "test_tms_process_host")
_HELPERS = {"_child", "_python"}


def _snippets(name: str):
    module = importlib.import_module(name)
    tree = ast.parse(open(module.__file__).read())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in _HELPERS and node.args):
            arg = node.args[0]
            if isinstance(arg, ast.Name) and arg.id not in vars(module):
                continue  # a parameter of a helper, not a snippet
            code = eval(compile(ast.Expression(arg), module.__file__, "eval"), vars(module))
            if isinstance(code, str):
                yield node.lineno, textwrap.dedent(code)


@pytest.mark.parametrize("name", _FILES)
def test_every_child_snippet_compiles(name):
    snippets = list(_snippets(name))
    assert snippets, f"no snippets found in {name}"
    for line, code in snippets:
        try:
            compile(code, f"{name}.py:{line}", "exec")
        except SyntaxError as exc:
            pytest.fail(f"{name}.py:{line}: the child's code does not compile: {exc}")
