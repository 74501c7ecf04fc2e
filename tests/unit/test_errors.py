"""The exception tree drawn in :mod:`streamproc.errors` holds every exception class of the
package, each under its base class."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest

import streamproc
from streamproc import errors

_NODE = re.compile(r"^(?P<lead>[ │├└─]*?)(?P<name>[A-Z][A-Za-z]+)(?:\s{2,}.*)?$")


def drawn_tree(doc: str) -> dict[str, str]:
    """``class name -> base class name`` as the docstring's trees draw them (a root's base is
    itself; depth is the column where the name begins)."""
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in doc.splitlines():
        if not line.startswith("    ") or not line.strip():
            continue
        match = _NODE.match(line[4:])
        if match is None:
            continue
        column, name = len(match["lead"]), match["name"]
        while stack and stack[-1][0] >= column:
            stack.pop()
        parents[name] = stack[-1][1] if stack else name
        stack.append((column, name))
    return parents


def package_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of the package, by name."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(streamproc.__path__, "streamproc."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
            ):
                found[name] = value
    return found


def test_every_exception_class_of_the_package_is_drawn_under_its_base() -> None:
    assert errors.__doc__ is not None
    drawn = drawn_tree(errors.__doc__)
    classes = package_exceptions()
    assert set(classes) - set(drawn) == set(), "exception classes missing from the tree"
    for name, cls in classes.items():
        base = cls.__base__.__name__
        if drawn[name] == name:  # a root: the base of its tree is Exception
            assert base == "Exception", f"{name} drawn as a root, its base is {base}"
        else:
            assert drawn[name] == base, f"{name} drawn under {drawn[name]}, its base is {base}"
    assert set(drawn) - set(classes) == {"Exception"}, "classes drawn that do not exist"


def test_the_tree_reader_sees_depth_and_base() -> None:
    doc = "Xx::\n\n    Aa\n    ├── Bb  text\n    │   └── Cc\n    └── Dd\n"
    assert drawn_tree(doc) == {"Aa": "Aa", "Bb": "Aa", "Cc": "Bb", "Dd": "Aa"}


def test_the_package_names_its_lazily_imported_pipeline() -> None:
    """``Pipeline`` and ``RunSummary`` are imported on first use (PEP 562), yet named by
    ``dir()`` and ``__all__`` and given by attribute and ``from streamproc import``; an unknown
    name is an AttributeError."""
    from streamproc.pipeline import Pipeline, RunSummary

    assert {"Pipeline", "RunSummary"} <= set(dir(streamproc)) & set(streamproc.__all__)
    assert streamproc.Pipeline is Pipeline and streamproc.RunSummary is RunSummary
    with pytest.raises(AttributeError, match="no attribute 'Pipe'"):
        _ = streamproc.Pipe  # type: ignore[attr-defined]
