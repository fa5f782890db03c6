"""JSON read strictly: the one JSON parser csrun reads text with (``TF_CONFIG``, checkpoint
manifests, a task's result).

Python's :func:`json.loads` keeps the last of two equal keys without a word (``"task"``
given twice in ``TF_CONFIG``: the later one silently wins), reads ``NaN`` and
``Infinity`` (not JSON) and ``1e400`` as infinity, and reports an integer past Python's
4300-digit limit or deep nesting as a ``ValueError`` or ``RecursionError`` without a
place. Here each of them is a :class:`json.JSONDecodeError` that says what and where
(line and column), as a syntax error is; the caller says which text it was. The
pure-Python scanner it drives is about twice as slow as the C one: csrun reads only
small JSON (a manifest is a few kilobytes).

Example::

    loads('{"task": {"type": "ps"}, "task": {"type": "worker"}}')
    # json.JSONDecodeError: the key "task" is given twice in this object (JSON would keep
    # the last one silently): line 1 column 1 (char 0)
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import math
import sys
from typing import Any

__all__ = ["loads", "MAX_DEPTH"]

MAX_DEPTH = 64  # objects and arrays inside each other; as many as a YAML config may have


def loads(text: str | bytes) -> Any:
    """``text`` parsed as JSON, refusing what :func:`json.loads` would take silently.

    Raises:
      json.JSONDecodeError: not JSON, a key given twice in one object, ``NaN`` or
        ``Infinity`` or a number past a float's range, an integer of more digits than Python converts, or nesting deeper
        than :data:`MAX_DEPTH`.
    """
    if isinstance(text, (bytes, bytearray)):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise json.JSONDecodeError(f"the text is not UTF-8 ({exc.reason})", "",
                                       0) from None
    decoder = _StrictDecoder(text)
    return decoder.decode(text)


class _StrictDecoder(json.JSONDecoder):
    """The standard decoder, driven by the pure-Python scanner so that each object and
    array is seen with its place (the C scanner gives no hook with one)."""

    def __init__(self, doc: str):
        super().__init__(parse_constant=self._constant, parse_int=self._int,
                         parse_float=self._float,
                         object_pairs_hook=list)
        self.doc, self.depth = doc, 0
        self.parse_object, self.parse_array = self._object, self._array
        self.scan_once = json.scanner.py_make_scanner(self)

    def _object(self, s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo):
        start = self._enter(s_and_end[1] - 1)  # at the "{"
        try:
            pairs, end = json.decoder.JSONObject(s_and_end, strict, scan_once, object_hook,
                                                 list, memo)
        finally:
            self.depth -= 1
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise json.JSONDecodeError(f"the key {json.dumps(key)[:80]} is given twice "
                                           "in this object (JSON would keep the last one "
                                           "silently)", self.doc, start)
            seen.add(key)
        return dict(pairs), end

    def _array(self, s_and_end, scan_once):
        self._enter(s_and_end[1] - 1)
        try:
            return json.decoder.JSONArray(s_and_end, scan_once)
        finally:
            self.depth -= 1

    def _enter(self, where: int) -> int:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise json.JSONDecodeError(f"objects and arrays nest more than {MAX_DEPTH} "
                                       "deep", self.doc, where)
        return where

    def _constant(self, name: str) -> Any:
        raise json.JSONDecodeError(f"{name} is not a JSON number (JSON has no NaN or "
                                   "infinity)", self.doc, max(self.doc.find(name), 0))

    def _int(self, digits: str) -> int:
        limit = sys.get_int_max_str_digits() or len(digits)
        if len(digits.lstrip("-")) > limit:
            raise json.JSONDecodeError(f"an integer of {len(digits.lstrip('-'))} digits, "
                                       f"more than the {limit} Python converts",
                                       self.doc, max(self.doc.find(digits), 0))
        return int(digits)

    def _float(self, text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise json.JSONDecodeError(f"{text[:40]} is past the largest float (about "
                                       "1.8e308)", self.doc, max(self.doc.find(text), 0))
        return value
