"""Tries corrupted checkpoints (``corrupt_variants.py``) in one process, each under its own alarm.

    python corrupt_runner.py load|fit|verify|inspect ORIGINALS.json VARIANTS.json [SECONDS]

prints one JSON line per variant: how the plugin's load or a real ``Trainer.fit(ckpt_path=...)`` ended
(``equal``, ``refused``, ``wrong``, ``hang``), or the CLI's exit status, output and whether an exception escaped
``main``. One process for the whole set keeps the bounded suite fast (torch is imported once).
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from corrupt_variants import Variant


# -- comparing a load with the original ------------------------------------------------------------------------
def same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of nested checkpoint content (tensors by dtype, shape and bytes)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and repr(a) == repr(b)


# -- the runner ------------------------------------------------------------------------------------------------
class _Hang(BaseException):
    pass


def _alarm(*_: Any) -> None:
    raise _Hang()


def _load(path: str) -> Any:
    from lightning_asyncckpt import AsyncCheckpointIO

    return AsyncCheckpointIO(worker="fork").load_checkpoint(path)


def run_load(originals: dict[str, str], variants: list[Variant], timeout_s: int) -> list[dict]:
    reference = {kind: _load(p) for kind, p in originals.items()}
    results = []
    for v in variants:
        signal.alarm(timeout_s)
        try:
            loaded = _load(v.path)
            outcome, message = ("equal" if same(loaded, reference[v.original]) else "wrong"), ""
        except _Hang:
            outcome, message = "hang", ""
        except BaseException as e:  # noqa: BLE001 - every refusal is recorded (DCP's CheckpointException is one)
            outcome, message = "refused", f"{type(e).__name__}: {e}"
            if "_Hang" in traceback.format_exc():  # the alarm, caught and wrapped on the way (DCP's reader does)
                outcome = "hang"
        finally:
            signal.alarm(0)
        results.append({"name": v.name, "outcome": outcome, "message": message})
    return results


def run_cli(command: str, variants: list[Variant], timeout_s: int) -> list[dict]:
    from lightning_asyncckpt.tools import cli

    results = []
    for v in variants:
        out, err = io.StringIO(), io.StringIO()
        signal.alarm(timeout_s)
        code, escaped = None, ""
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli.main([command, v.path])
        except _Hang:
            code = "hang"
        except BaseException:  # noqa: BLE001 - escaped main: the command would print a traceback
            escaped = traceback.format_exc()
        finally:
            signal.alarm(0)
        results.append({"name": v.name, "code": code, "out": out.getvalue(), "err": err.getvalue(),
                        "traceback": escaped})
    return results


def run_fit(originals: dict[str, str], variants: list[Variant], timeout_s: int) -> list[dict]:
    """A real ``Trainer.fit(ckpt_path=variant)`` with the plugin for each variant: the model's weights and the
    optimizer's state right after the restore are compared with the original checkpoint's."""
    import lightning as L

    from helpers import TinyModel, loader, trainer
    from lightning_asyncckpt import AsyncCheckpointIO

    class Restored(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.state = {"state_dict": {k: v.detach().clone() for k, v in module.state_dict().items()},
                          "optimizer": trainer.optimizers[0].state_dict()["state"]}
            raise _Stop()

    reference = {kind: _load(p) for kind, p in originals.items()}
    results = []
    for v in variants:
        ref = reference[v.original]
        restored = Restored()
        t = trainer(Path(v.path).parent / f"fit-{v.name}", [AsyncCheckpointIO(worker="fork")], [restored],
                    max_steps=ref["global_step"] + 1, enable_checkpointing=False)
        signal.alarm(timeout_s)
        try:
            t.fit(TinyModel(width=32), loader(width=32), ckpt_path=v.path)
            outcome, message = "wrong", "fit ran without restoring"
        except _Stop:
            want = {"state_dict": ref["state_dict"], "optimizer": ref["optimizer_states"][0]["state"]}
            outcome, message = ("equal" if same(_plain(restored.state), _plain(want)) else "wrong"), ""
        except _Hang:
            outcome, message = "hang", ""
        except BaseException as e:  # noqa: BLE001
            outcome, message = "refused", f"{type(e).__name__}: {e}"
            if "_Hang" in traceback.format_exc():
                outcome = "hang"
        finally:
            signal.alarm(0)
        results.append({"name": v.name, "outcome": outcome, "message": message})
    return results


class _Stop(Exception):
    pass


def _plain(obj: Any) -> Any:
    """Dicts with their keys in one order, so that a restored state compares with the saved one."""
    if isinstance(obj, dict):
        return {k: _plain(obj[k]) for k in sorted(obj, key=repr)}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    return obj


def main(argv: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    op, originals, variants = argv[0], json.loads(Path(argv[1]).read_text()), json.loads(Path(argv[2]).read_text())
    timeout_s = int(argv[3]) if len(argv) > 3 else 20
    vs = [Variant(**v) for v in variants]
    import torch.distributed.checkpoint  # noqa: F401 - imported before the alarms: an import cut short breaks torch

    signal.signal(signal.SIGALRM, _alarm)
    runs = {"load": run_load, "fit": run_fit}
    results = runs[op](originals, vs, timeout_s) if op in runs else run_cli(op, vs, timeout_s)
    for r in results:
        print(json.dumps(r), flush=True)


if __name__ == "__main__":  # run as a script: tests/ is sys.path[0], and corrupt_variants imports from it
    main(sys.argv[1:])
