"""A router that parses JSON numbers as float64, emulated (tests only).

Go's ``encoding/json`` decoding into ``interface{}`` (llm-d's routing sidecar and EPP)
and JavaScript's ``JSON.parse`` hold every JSON number as a float64: an integer at or
above 2**53 comes out as its nearest float64. Writing it back, both print a float64
below 1e21 as the shortest decimal that reads back as the same float64, without a
fraction when it is integral (Go: ``strconv.FormatFloat(f, 'f', -1, 64)``; JavaScript:
``Number.prototype.toString``), so 2**60 + 1 leaves them as ``1152921504606847000``.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

__all__ = ["as_float64", "float64_router", "go_marshal", "numbers", "parse_float64"]


def as_float64(doc: Any) -> Any:
    """``doc`` as a float64 parser holds it: every JSON number a Python float."""
    return json.loads(json.dumps(doc), parse_int=float, parse_float=float)


def parse_float64(text: str | bytes) -> Any:
    """Parse JSON as Go's ``encoding/json`` does into ``any``: every number a float64."""
    return json.loads(text, parse_int=float, parse_float=float)


_GO_ESCAPES = (
    ("<", "\\u003c"),
    (">", "\\u003e"),
    ("&", "\\u0026"),
    ("\u2028", "\\u2028"),
    ("\u2029", "\\u2029"),
)


def go_marshal(doc: Any) -> bytes:
    """``doc`` (as :func:`parse_float64` gives it) written as Go's ``json.Marshal``
    writes a ``map[string]any``: keys sorted, no spaces, float64 values without a
    fraction when integral (below 1e21), UTF-8 as is, and ``<``, ``>``, ``&``, U+2028
    and U+2029 escaped (those characters occur only inside strings)."""
    text = json.dumps(
        _as_written(doc),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    for char, escaped in _GO_ESCAPES:
        text = text.replace(char, escaped)
    return text.encode()


def float64_router(doc: Any) -> Any:
    """``doc`` after a Go or JavaScript router parsed it and wrote it back, as the
    next (Python) hop parses it."""
    return json.loads(json.dumps(_as_written(as_float64(doc))))


def _as_written(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _as_written(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_written(v) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        # repr is the shortest round-tripping decimal, as Go and JavaScript print it;
        # Decimal spells it out in full digits ("1.152921504606847e+18" -> ...7000).
        return int(Decimal(repr(value)))
    return value


def numbers(doc: Any) -> list[int | float]:
    """Every JSON number in ``doc`` (booleans are not numbers)."""
    if isinstance(doc, dict):
        return [n for v in doc.values() for n in numbers(v)]
    if isinstance(doc, list):
        return [n for v in doc for n in numbers(v)]
    if isinstance(doc, int | float) and not isinstance(doc, bool):
        return [doc]
    return []
