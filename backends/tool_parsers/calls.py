"""Tool calls as the parsers report them, and the reader of one call object.

A call object is `{"name": "...", "arguments": {...}}` (the arguments key differs by family). Its
arguments are passed on as the very text the model wrote, so the pieces of a stream join into the
arguments of the whole answer, whatever the chunking.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable, Collection
from typing import Any

import msgspec

from backends.tool_parsers.json_scan import JsonScanner, JsonSyntaxError


def new_call_id() -> str:
    """An OpenAI-style tool call id (`call_` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def new_short_call_id() -> str:
    """A call id of 9 letters and digits: Mistral's chat templates refuse any other shape."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class ToolCall(msgspec.Struct, kw_only=True):
    """One call the model made: its id, the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The call as an OpenAI whole answer lists it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ParsedOutput(msgspec.Struct, kw_only=True):
    """A whole output split into the text meant for the user and the calls."""

    content: str
    calls: list[ToolCall]


class StreamDelta(msgspec.Struct, kw_only=True):
    """What one piece of output text adds: content text, and OpenAI `tool_calls` deltas (a call's
    first delta has its index, id, type and name with empty arguments; later ones add argument text)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = msgspec.field(default_factory=list)


class MalformedCall(ValueError):
    """The call object cannot be a call (bad JSON, no name, arguments not an object...)."""


class CallReader:
    """Reads one call object a character at a time.

    The call is *committed* once its name is known and its arguments have begun (or the object
    ended without arguments: `{}`). Before that a failure makes the text plain content; after it,
    the call stands with the arguments written so far.

    Args:
        args_keys: the keys that may hold the arguments (the first one present is used).
        tool_names: when given, a name outside it is not a call.
        new_id: makes the id of the call.
    """

    def __init__(
        self,
        args_keys: tuple[str, ...],
        tool_names: Collection[str] | None,
        new_id: Callable[[], str],
    ) -> None:
        self._scanner = JsonScanner()
        self._args_keys = args_keys
        self._tool_names = tool_names
        self._new_id = new_id
        self._key: str | None = None
        self._name: str | None = None
        self._args_start: int | None = None
        self._args_end: int | None = None
        self._sent = 0  # arguments text handed out so far (characters)
        self._opened = False
        self.text = ""
        self.call: ToolCall | None = None  # set at commit

    @property
    def done(self) -> bool:
        return self._scanner.done

    def step(self, ch: str) -> None:
        """Take the next character of the object.

        Raises:
            MalformedCall: the text is not (or no longer) a call object; the character is not taken.
        """
        self.text += ch
        try:
            self._take(ch)
        except MalformedCall:
            self.text = self.text[:-1]
            raise

    def _take(self, ch: str) -> None:
        scanner = self._scanner
        try:
            scanner.step(ch)
        except JsonSyntaxError as exc:
            raise MalformedCall(str(exc)) from None
        if not self._opened and not ch.isspace():
            if ch != "{":
                raise MalformedCall("a call is a JSON object")
            self._opened = True
        if scanner.key_span is not None:
            self._key = json.loads(self.text[slice(*scanner.key_span)])
        if scanner.value_start and self._key in self._args_keys and self._args_start is None:
            if ch != "{":
                raise MalformedCall("the arguments of a call are a JSON object")
            self._args_start = len(self.text) - 1
        if scanner.value_span is not None:
            self._member_ended(*scanner.value_span)
        if scanner.done:
            if self._name is None:
                raise MalformedCall("a call names its function")
            if self._args_start is None:  # a function without arguments
                self.text, self._args_start, self._args_end = self.text + "{}", len(self.text), len(self.text) + 2
        if self.call is None and self._name is not None and self._args_start is not None:
            self.call = ToolCall(id=self._new_id(), name=self._name)

    def _member_ended(self, start: int, end: int) -> None:
        if self._key == "name" and self._name is None:
            name = json.loads(self.text[start:end])
            if not isinstance(name, str) or not name:
                raise MalformedCall("a call's name is a string")
            if self._tool_names is not None and name not in self._tool_names:
                raise MalformedCall(f"no tool is named {name!r}")
            self._name = name
        elif start == self._args_start:
            self._args_end = end

    def pending_arguments(self) -> str:
        """The arguments text written since the last call (empty before the commit)."""
        if self.call is None or self._args_start is None:
            return ""
        upto = self._args_end if self._args_end is not None else len(self.text)
        piece = self.text[self._args_start + self._sent : upto]
        self._sent += len(piece)
        self.call.arguments += piece
        return piece
