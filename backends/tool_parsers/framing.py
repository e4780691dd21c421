"""The streaming machine every family parser is: content, call markers, call objects, separators.

A family is described by a few class attributes (its markers, how its calls are framed); the
machine turns text deltas into content and OpenAI `tool_calls` deltas. Every decision depends only
on the text seen, never on where a delta ended, so a stream in any chunking adds up to the whole
answer (`parse`). Text that may still become a marker or a call is held back until decided, and a
call that turns out malformed before it was committed is handed on as content, never dropped.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection

from backends.tool_parsers.calls import (
    CallReader,
    MalformedCall,
    ParsedOutput,
    StreamDelta,
    ToolCall,
    new_call_id,
)


class _Mode(enum.Enum):
    START = "start"  # nothing decided yet: the output may open with a bare call
    CONTENT = "content"  # plain text, watching for markers
    BODY = "body"  # after a marker: an object, or (where the family allows) an array of them
    ITEM = "item"  # in an array, before an object
    OBJECT = "object"  # inside a call object
    AFTER = "after"  # after a call object outside an array (end tag, separator)
    NEXT = "next"  # in an array after an object: ',' or ']'


class FramedToolParser:
    """Streaming tool call parser of one generation (one choice); use `feed` then `finish`.

    Args:
        tool_names: the functions of the request; a call naming another is treated as content.
        new_id: makes call ids (default: the family's own `new_id`).
    """

    #: the parser's name in `options.tool_parser` (vLLM's)
    name: str = ""
    #: texts that open calls anywhere in the output
    markers: tuple[str, ...] = ()
    #: a character that opens calls when the output starts with it (after whitespace), or None
    bare_start: str | None = None
    #: after a marker, an array of call objects is accepted as well as one object
    arrays: bool = False
    #: a text expected (and consumed) after a call object, or None
    end_tag: str | None = None
    #: a character that separates call objects outside arrays, or None
    separator: str | None = None
    #: the keys a call object may hold its arguments under
    args_keys: tuple[str, ...] = ("arguments",)
    #: makes the ids of the family's calls (what its chat template accepts back)
    new_id: Callable[[], str] = staticmethod(new_call_id)

    def __init__(
        self, tool_names: Collection[str] | None = None, new_id: Callable[[], str] | None = None
    ) -> None:
        self._tool_names = tool_names
        if new_id is not None:
            self.new_id = new_id
        self._mode = _Mode.START if self.bare_start else _Mode.CONTENT
        self._buf = ""  # text received, not yet decided
        self._raw = ""  # text consumed since the last call that is content should the call fail
        self._strip_lead = False  # drop whitespace at the start of content after a call
        self._reader: CallReader | None = None
        self._array_open = False  # inside `[...]` of calls
        self._eos = False
        self._out = StreamDelta()
        self._content: list[str] = []
        self.calls: list[ToolCall] = []

    @classmethod
    def parse(cls, text: str, tool_names: Collection[str] | None = None) -> ParsedOutput:
        """A whole output split into content and calls."""
        parser = cls(tool_names)
        parser.feed(text)
        parser.finish()
        return ParsedOutput(content="".join(parser._content), calls=parser.calls)

    def feed(self, text: str) -> StreamDelta:
        """The content and call deltas `text` (the next piece of output) decides."""
        self._buf += text
        return self._run()

    def finish(self) -> StreamDelta:
        """Whatever was held back, decided now that the output has ended."""
        self._eos = True
        return self._run()

    def _run(self) -> StreamDelta:
        steps = {
            _Mode.START: self._start,
            _Mode.CONTENT: self._text,
            _Mode.BODY: self._body,
            _Mode.ITEM: self._item,
            _Mode.OBJECT: self._object,
            _Mode.AFTER: self._after,
            _Mode.NEXT: self._next,
        }
        while steps[self._mode]():
            pass
        out, self._out = self._out, StreamDelta()
        return out

    # --- output ---------------------------------------------------------------------------------

    def _emit(self, text: str) -> None:
        if self._strip_lead:
            text = text.lstrip()
            self._strip_lead = not text
        if text:
            self._out.content += text
            self._content.append(text)

    def _to_content(self) -> bool:
        """Hand the held text on as content (a frame or call that failed) and go on reading text."""
        self._emit(self._raw)
        self._raw = ""
        self._array_open = False
        self._mode = _Mode.CONTENT
        return True

    def _skip_ws(self) -> bool:
        """Move leading whitespace of the buffer into the held text; True when something is left."""
        rest = self._buf.lstrip()
        self._raw += self._buf[: len(self._buf) - len(rest)]
        self._buf = rest
        return bool(rest)

    # --- modes (each returns True when it made progress and the machine should go on) -----------

    def _start(self) -> bool:
        rest = self._buf.lstrip()
        if not rest and not self._eos:
            return False
        if any(m.startswith(rest) for m in self.markers) and not self._eos:
            return False  # a marker may be coming (mistral's opens with the bare start's bracket)
        if rest[:1] == self.bare_start and not any(rest.startswith(m) for m in self.markers):
            self._skip_ws()
            if self.bare_start == "[":
                self._open_array()
            else:
                self._mode = _Mode.OBJECT
            return True
        self._mode = _Mode.CONTENT
        return True

    def _text(self) -> bool:
        buf = self._buf
        found = min(((buf.find(m), m) for m in self.markers if m in buf), default=None)
        if found is not None:
            at, marker = found
            before = buf[:at]
            kept = before.rstrip()
            self._emit(kept)
            self._raw = before[len(kept) :] + marker
            self._buf = buf[at + len(marker) :]
            self._mode = _Mode.BODY
            return True
        if self._eos:
            self._emit(buf.rstrip() if self.calls else buf)
            self._buf = ""
            return False
        hold = max((n for m in self.markers for n in range(1, len(m)) if buf.endswith(m[:n])), default=0)
        body = buf[: len(buf) - hold].rstrip()
        self._emit(body)
        self._buf = buf[len(body) :]
        return False

    def _body(self) -> bool:
        if not self._skip_ws():
            return self._to_content() if self._eos else False
        if self._buf[0] == "[" and self.arrays:
            self._open_array()
            return True
        self._mode = _Mode.OBJECT
        return True

    def _item(self) -> bool:
        if not self._skip_ws():
            return self._to_content() if self._eos else False
        if self._buf[0] != "{":
            return self._to_content()
        self._mode = _Mode.OBJECT
        return True

    def _object(self) -> bool:
        reader = self._reader = self._reader or CallReader(self.args_keys, self._tool_names, self.new_id)
        for at, ch in enumerate(self._buf):
            try:
                reader.step(ch)
            except MalformedCall:
                self._buf = self._buf[at:]  # the character that broke it is read as content
                if reader.call is None:  # not a call: everything held is content
                    self._raw += reader.text
                    self._reader = None
                    return self._to_content()
                self._close_call()  # the call stands with the arguments so far
                return True
            if reader.done:
                self._buf = self._buf[at + 1 :]
                self._close_call()
                self._mode = _Mode.NEXT if self._array_open else _Mode.AFTER
                return True
        self._buf = ""
        self._pull()
        if self._eos:
            if reader.call is not None:
                self._close_call()
                return False
            self._raw += reader.text
            self._reader = None
            return self._to_content()
        return False

    def _pull(self) -> None:
        """Pass on what the current call has decided: its first delta, then argument text."""
        reader = self._reader
        if reader is None or reader.call is None:
            return
        call = reader.call
        if not self.calls or self.calls[-1] is not call:
            self.calls.append(call)
            self._raw = ""  # committed: the text held so far was the call's frame
            header = {"name": call.name, "arguments": ""}
            self._out.tool_calls.append(
                {"index": len(self.calls) - 1, "id": call.id, "type": "function", "function": header}
            )
        index = len(self.calls) - 1
        piece = reader.pending_arguments()
        if piece:
            self._out.tool_calls.append({"index": index, "function": {"arguments": piece}})

    def _close_call(self) -> None:
        self._pull()
        self._reader = None
        self._raw = ""
        self._strip_lead = True
        self._mode = _Mode.CONTENT

    def _after(self) -> bool:
        if not self._skip_ws():
            return self._to_content() if self._eos else False
        if self.end_tag is not None:
            if self._buf.startswith(self.end_tag):
                self._buf = self._buf[len(self.end_tag) :]
                self._raw = ""
                self._mode = _Mode.CONTENT
                return True
            if self.end_tag.startswith(self._buf) and not self._eos:
                return False
        if self.separator is not None and self._buf[0] == self.separator:
            self._raw, self._buf = self._raw + self.separator, self._buf[1:]
            self._mode = _Mode.ITEM
            return True
        return self._to_content()

    def _next(self) -> bool:
        if not self._skip_ws():
            return self._to_content() if self._eos else False
        ch = self._buf[0]
        if ch not in ",]":
            return self._to_content()
        self._raw, self._buf = self._raw + ch, self._buf[1:]
        if ch == ",":
            self._mode = _Mode.ITEM
            return True
        self._raw = ""
        self._array_open = False
        self._mode = _Mode.CONTENT
        return True

    def _open_array(self) -> None:
        self._raw, self._buf = self._raw + "[", self._buf[1:]
        self._array_open = True
        self._mode = _Mode.ITEM
