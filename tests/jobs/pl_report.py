"""The entry point of the jobs that run under ``.venv-pl`` (the ``pytorch_lightning`` distribution alone),
which import nothing of the test helpers (those import ``lightning``)."""

from __future__ import annotations

import argparse
import json
import os
import traceback
from collections.abc import Callable


def report_main(run: Callable[[str, dict], None], name: Callable[[], str] = lambda: "report.json") -> None:
    """Parses ``--out``, runs ``run(out, report)`` and writes ``report`` to ``<out>/<name()>``, with the
    traceback as ``crash`` if ``run`` raised (the test fails with it)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    report: dict = {}
    try:
        run(args.out, report)
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        report["crash"] = traceback.format_exc()
    with open(os.path.join(args.out, name()), "w") as f:
        json.dump(report, f)
