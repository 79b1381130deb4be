"""What every command of ``lightning-asyncckpt`` shares: its exit statuses, the user error, a path that must
exist, and the bytes under a path."""

from __future__ import annotations

import os
from pathlib import Path

PROG = "lightning-asyncckpt"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """A user error: printed as one line on stderr, and the command exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def existing(path_arg: str) -> Path:
    """``path_arg`` as a path, or a user error naming it if nothing is there."""
    path = Path(path_arg)
    if not os.path.lexists(path):
        raise CliError(f"{path}: no such file or directory")
    return path


def tree_size(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed)."""
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total
