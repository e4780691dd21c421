"""What every subcommand shares: the exit codes, the one-line failure, and how it is registered.

Errors a user can fix (a bad config, an unknown tenant) print one line on stderr and exit
`EXIT_USAGE`; an unreachable state store prints one line and exits `EXIT_UNAVAILABLE`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 1

#: `add_parser` of the `fleetgate` subparsers (argparse's own), handed to each command's `register`
AddParser = Callable[..., argparse.ArgumentParser]


def fail(message: str) -> int:
    """Tell the user what to fix, on one line of stderr; the exit code of a usage error."""
    print(f"fleetgate: {message}", file=sys.stderr)
    return EXIT_USAGE

