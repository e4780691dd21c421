"""A JSON value checked as it arrives, one character at a time.

The streaming tool parsers must decide, character by character and whatever the chunking, where a
call's `name` and `arguments` begin and end, and must never pass on arguments text that is not a
valid JSON prefix. A full parser cannot answer for a prefix; this pushdown scanner can. It tracks
the members of the outermost object only (what a call object holds) and leaves decoding to `json`.
"""

from __future__ import annotations

import re

_WS = frozenset(" \t\n\r")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrt')
#: characters of a number or of true / false / null (checked whole when the literal ends)
_BARE = frozenset("0123456789+-.eEtruefalsn")
_BARE_START = frozenset("-0123456789tfn")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")

# what the scanner expects next, outside a string or a literal
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE = range(6)


class JsonSyntaxError(ValueError):
    """The text stopped being a JSON prefix at the character just fed."""


class JsonScanner:
    """Checks one JSON value a character at a time and reports the spans of its top-level members.

    After each `step`, `key_span` / `value_span` hold the (start, end) positions of a member key
    (with its quotes) or member value of the outermost object that ended with that character, and
    `value_start` tells that a member value began at it. A number, true, false or null ends only
    when the next character arrives, so its span ends before that character. `done` is set when the
    outermost value is complete.
    """

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._expect = _VALUE
        self._in_string = False
        self._is_key = False
        #: 0 none; -1 just after a backslash; 1..4 hex digits of a \\u escape still to come
        self._escape = 0
        self._bare = ""
        self._start = 0
        self.pos = 0
        self.done = False
        self.value_start = False
        self.key_span: tuple[int, int] | None = None
        self.value_span: tuple[int, int] | None = None

    def step(self, ch: str) -> None:
        """Take the next character.

        Raises:
            JsonSyntaxError: the text is no longer the prefix of a JSON value.
        """
        self.value_start = False
        self.key_span = self.value_span = None
        try:
            if self.done:
                raise JsonSyntaxError("text after the end of the value")
            if self._in_string:
                self._string_char(ch)
                return
            if self._bare:
                if ch in _BARE:
                    self._bare += ch
                    return
                self._end_bare()
            if ch not in _WS:
                self._structural(ch)
        finally:
            self.pos += 1

    def _string_char(self, ch: str) -> None:
        if self._escape == -1:
            if ch == "u":
                self._escape = 4
            elif ch in _ESCAPES:
                self._escape = 0
            else:
                raise JsonSyntaxError(f"bad escape \\{ch}")
        elif self._escape > 0:
            if ch not in _HEX:
                raise JsonSyntaxError("bad \\u escape")
            self._escape -= 1
        elif ch == "\\":
            self._escape = -1
        elif ch == '"':
            self._in_string = False
            if self._is_key:
                self._expect = _COLON
                if len(self._stack) == 1:
                    self.key_span = (self._start, self.pos + 1)
            else:
                self._value_ended(self.pos + 1)
        elif ord(ch) < 0x20:
            raise JsonSyntaxError("control character in a string")

    def _structural(self, ch: str) -> None:
        expect = self._expect
        if expect in (_VALUE, _VALUE_OR_CLOSE):
            if ch == "]" and expect == _VALUE_OR_CLOSE:
                self._close()
            else:
                self._begin_value(ch)
        elif expect in (_KEY, _KEY_OR_CLOSE):
            if ch == "}" and expect == _KEY_OR_CLOSE:
                self._close()
            elif ch == '"':
                self._in_string, self._is_key = True, True
                if len(self._stack) == 1:
                    self._start = self.pos
            else:
                raise JsonSyntaxError(f"expected a key, got {ch!r}")
        elif expect == _COLON:
            if ch != ":":
                raise JsonSyntaxError(f"expected ':', got {ch!r}")
            self._expect = _VALUE
        else:  # _COMMA_OR_CLOSE
            top = self._stack[-1]
            if ch == ",":
                self._expect = _KEY if top == "{" else _VALUE
            elif ch == ("}" if top == "{" else "]"):
                self._close()
            else:
                raise JsonSyntaxError(f"expected ',' or a closing bracket, got {ch!r}")

    def _begin_value(self, ch: str) -> None:
        if len(self._stack) == 1:
            self.value_start = True
            self._start = self.pos
        if ch in "{[":
            self._stack.append(ch)
            self._expect = _KEY_OR_CLOSE if ch == "{" else _VALUE_OR_CLOSE
        elif ch == '"':
            self._in_string, self._is_key = True, False
        elif ch in _BARE_START:
            self._bare = ch
        else:
            raise JsonSyntaxError(f"expected a value, got {ch!r}")

    def _end_bare(self) -> None:
        bare, self._bare = self._bare, ""
        if bare not in ("true", "false", "null") and not _NUMBER.fullmatch(bare):
            raise JsonSyntaxError(f"not a JSON literal: {bare!r}")
        self._value_ended(self.pos)

    def _close(self) -> None:
        self._stack.pop()
        self._value_ended(self.pos + 1)

    def _value_ended(self, end: int) -> None:
        depth = len(self._stack)
        if depth == 0:
            self.done = True
            return
        if depth == 1:
            self.value_span = (self._start, end)
        self._expect = _COMMA_OR_CLOSE
