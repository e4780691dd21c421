"""Constrained decoding for the engine: JSON schemas, regexes, choices and grammars compiled by
xgrammar into token masks (`grammar`), and the schema keywords it enforces (`schema`)."""
