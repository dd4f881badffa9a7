"""One error path for every command line (train, eval, regenerate, convert.*).

Exit codes (documented in the README):

    0    done
    1    a bug: an unexpected exception, printed with its traceback
    2    an expected failure: one ``error: ...`` line naming what is wrong (config, data, weights,
         I/O, a mismatch, training that diverged); nothing is left half-written
    130  interrupted by SIGINT (Ctrl-C), after its checkpoint
    143  interrupted by SIGTERM (a scheduler's preemption), after its checkpoint

Set ``DFLASH_TRACEBACK=1`` to see the traceback of an expected failure too.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Callable

EXIT_OK = 0
EXIT_ERROR = 2


class UserError(Exception):
    """An expected failure whose message tells the user what is wrong and what to change."""


class Interrupted(Exception):
    """The run stopped on a signal after writing its checkpoint; exits ``128 + signum``."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message or f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def expected_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input or a bad environment, not a bug in this code.

    ValueError covers the project's named errors (ConfigError, BadRecordError, BadDataError,
    CheckpointError, drafter/target mismatches); OSError covers missing, unreadable and unwritable
    files; safetensors raises its own error for a truncated or corrupt file."""
    errors: list[type[BaseException]] = [UserError, ValueError, OSError, FloatingPointError]
    try:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:  # pragma: no cover - safetensors is a dependency
        pass
    return tuple(errors)


def one_line(e: BaseException) -> str:
    """An exception as one line (multi-line messages joined with '; ')."""
    text = str(e).strip() or type(e).__name__
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def cli(main: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap a ``main(argv) -> exit code``: expected errors become one ``error: ...`` line on
    stderr and exit code 2; :class:`Interrupted` becomes ``128 + signum``."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            rc = main(*args, **kwargs)
        except Interrupted as e:
            print(f"{e}", file=sys.stderr)
            return e.exit_code
        except expected_errors() as e:
            if os.environ.get("DFLASH_TRACEBACK"):
                raise
            print(f"error: {one_line(e)}", file=sys.stderr)
            return EXIT_ERROR
        return EXIT_OK if rc is None else int(rc)

    return wrapped
