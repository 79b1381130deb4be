"""``python -m lightning_asyncckpt``: the ``lightning-asyncckpt`` command line (see :mod:`lightning_asyncckpt.tools.cli`)."""

from lightning_asyncckpt.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
