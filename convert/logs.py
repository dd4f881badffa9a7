"""Logging for the converter CLIs: warnings only by default (orbax and absl log every step at INFO),
everything with ``-v``."""

from __future__ import annotations

import logging


def add_verbose_flag(parser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO), orbax's included")


def configure_logging(verbose: bool) -> None:
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)
    for noisy in ("absl", "orbax"):
        logging.getLogger(noisy).setLevel(level)
    try:
        from absl import logging as absl_logging
    except ImportError:  # absl comes with orbax; without it there is nothing to quieten
        return
    absl_logging.set_verbosity(absl_logging.INFO if verbose else absl_logging.WARNING)
