"""docs/configuration.md is generated from the config Structs and must match them."""

from __future__ import annotations

import pathlib

import msgspec

from gateway import config_reference
from gateway.config import ServerConfig

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "run python -m gateway.config_reference > docs/configuration.md"


def _section(text: str, heading: str) -> str:
    """The body of one `## heading` section."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_configuration_doc_is_generated_from_the_structs() -> None:
    assert DOC.read_text(encoding="utf-8") == config_reference.render(), REGENERATE


def test_every_server_field_is_in_the_server_section() -> None:
    server = _section(config_reference.render(), "`server`")
    for field in msgspec.structs.fields(ServerConfig):
        assert f"| `{field.encode_name}` |" in server, f"server.{field.encode_name} is missing"


def test_every_field_says_what_it_does() -> None:
    """A field without a `#:` comment (or docstring entry) shows "—"; name them all at once."""
    undocumented = [line.split("|")[1].strip() for line in config_reference.render().splitlines() if line.endswith("| — |")]
    assert undocumented == [], f"add a `#:` comment above these config fields: {undocumented}"


def test_comment_parser_reads_hash_colon_lines_and_attributes() -> None:
    class Example(msgspec.Struct):
        """An example.

        Attributes:
            b: from the docstring,
                on two lines.
        """

        #: first line
        #: second line
        a: int = 1
        b: int = 2
        c: int = 3

    comments = config_reference.field_comments(Example)
    assert comments == {"a": "first line second line", "b": "from the docstring, on two lines."}
