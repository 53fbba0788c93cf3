"""Text for ``--help``: docstrings read well in the source, with reStructuredText markup that is noise
on a terminal. Kept free of imports so any module's ``register`` can use it."""

from __future__ import annotations

import re


def describe(doc: str | None) -> str:
    """A module docstring's first line as a ``--help`` description, without the markup (double
    backquotes, ``:func:`name``` roles)."""
    text = (doc or "").strip()
    line = text.splitlines()[0] if text else ""
    line = re.sub(r":\w+:`~?([^`]+)`", r"\1", line)
    return line.replace("``", "")
