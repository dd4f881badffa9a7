"""One error path for every command line (train, eval, regenerate, convert.*).

Exit codes (documented in the README):

    0    done
    1    a bug: an unexpected exception, printed with its traceback
    2    an expected failure: one ``error: ...`` line naming what is wrong (config, data, weights,
         I/O, a mismatch, training that diverged); nothing is left half-written
    3    does not fit: ``train --plan`` / its pre-flight check, ``mesh_experiment`` (no layout runs)
    130  interrupted by SIGINT (Ctrl-C), after its checkpoint
    143  interrupted by SIGTERM (a scheduler's preemption), after its checkpoint

Set ``DFLASH_TRACEBACK=1`` to see the traceback of an expected failure too. Outputs that exist
are refused unless ``--overwrite`` (:func:`check_output_free`); orbax's own logging never reaches
the terminal (:func:`keep_library_logs_off_the_terminal`).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

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


# orbax logs through absl.logging (the Python logger "absl"); its async writes that fail are also
# reported by asyncio ("Task exception was never retrieved"), when collected at exit.
LIBRARY_LOGGERS = ("absl", "asyncio")


def keep_library_logs_off_the_terminal() -> None:
    """Orbax's INFO chatter and its worker threads' tracebacks (hundreds of lines on a full disk,
    around the one ``error:`` line) never reach the terminal; a failure they describe surfaces as
    our own exception. ``training.run`` keeps them in ``<run dir>/orbax.log``."""
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.propagate = False
        if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
            logger.addHandler(logging.NullHandler())  # else logging's last resort prints warnings


class _LibraryLogFile(logging.FileHandler):
    def handleError(self, record):  # noqa: N802 - a full disk must not print logging's own traceback
        pass


def log_library_logs_to(path: str | os.PathLike) -> None:
    """Send the library loggers' records to ``path`` (replacing an earlier file of this process)."""
    handler = _LibraryLogFile(path, delay=True)  # no file until a record comes
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.dflash_library_log = True
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if getattr(h, "dflash_library_log", False)]:
            logger.removeHandler(old)
            old.close()
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def check_output_free(path: str | os.PathLike, *, overwrite: bool, flag: str = "--out") -> Path:
    """Refuse to replace what a user made: an existing file, or a non-empty directory, at an
    output path is an error naming it (exit 2) unless ``overwrite``. Called before any work, so a
    refused command costs nothing; returns the path."""
    path = Path(path).expanduser()
    if overwrite or not (path.exists() or path.is_symlink()):
        return path
    if path.is_dir() and not any(path.iterdir()):
        return path
    what = "a non-empty directory" if path.is_dir() else "a file"
    raise FileExistsError(
        f"{flag} {path} already exists ({what}): pass --overwrite to replace it, or choose another {flag}"
    )


def one_line(e: BaseException) -> str:
    """An exception as one line (multi-line messages joined with '; ')."""
    text = str(e).strip() or type(e).__name__
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def cli(main: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap a ``main(argv) -> exit code``: expected errors become one ``error: ...`` line on
    stderr and exit code 2; :class:`Interrupted` becomes ``128 + signum``."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        keep_library_logs_off_the_terminal()
        try:
            rc = main(*args, **kwargs)
        except Interrupted as e:
            print(f"{e}", file=sys.stderr)
            return e.exit_code
        except expected_errors() as e:
            if os.environ.get("DFLASH_TRACEBACK"):
                raise
            from dflash_jax.distributed import failure_note

            note = failure_note()  # a multi-process run: the peer that died is the cause
            print(f"error: {note + ': ' if note else ''}{one_line(e)}", file=sys.stderr, flush=True)
            return EXIT_ERROR
        return EXIT_OK if rc is None else int(rc)

    return wrapped
