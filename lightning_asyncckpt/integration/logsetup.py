"""How the package's log lines reach the user: Lightning's convention, without hiding them from the
application's own logging setup."""

from __future__ import annotations

import logging
import sys

PACKAGE = "lightning_asyncckpt"


class _UntilConfigured(logging.StreamHandler):
    """Prints the package's records only while the application has configured no logging of its own.

    Lightning gives its logger a console handler and turns propagation off when the root logger has no
    handlers at import. Doing that here would hide our records from a ``logging.basicConfig`` that the
    application calls after importing us. This handler decides at each record instead, and the records
    always propagate, so a handler configured later receives them (and this one falls silent).
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().hasHandlers():
            super().emit(record)


def configure() -> None:
    """(at import, once) INFO for the package (one line per committed checkpoint), shown on stderr until
    the application configures logging."""
    pkg = logging.getLogger(PACKAGE)
    if pkg.level == logging.NOTSET:
        pkg.setLevel(logging.INFO)
    if not any(isinstance(h, _UntilConfigured) for h in pkg.handlers):
        pkg.addHandler(_UntilConfigured())
