"""A node's widget values read into one frozen record (no ComfyUI import).

ComfyUI hands a node's `execute` every widget as a keyword argument, and a saved workflow maps its `widgets_values`
onto the widgets by position: a node keeps its widgets so that saved workflows still load, and its `execute` reads
them at once into a frozen dataclass whose fields are the widget names (`read_widgets`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def read_widgets(record: type[T], values: Mapping[str, Any], node: str) -> T:
    """`record(**values)` after checking the names: every field without a default is given, no unknown name.
    Raises ValueError naming the node, the missing and the unknown widgets."""
    fields = dataclasses.fields(record)
    names = [f.name for f in fields]
    required = [f.name for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in values]
    unknown = sorted(set(values) - set(names))
    if missing or unknown:
        raise ValueError(f"{node} widgets: missing {missing}, unknown {unknown} (expected {names})")
    return record(**values)
