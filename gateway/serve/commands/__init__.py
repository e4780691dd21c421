"""The `fleetgate` subcommands, one module each.

Each module has `register(add_parser)`, which adds its parser(s) and sets `func` to the function
that runs it; `gateway/serve/cli.py` lists the modules, so a new command is a new module here plus
one line in that list.
"""
