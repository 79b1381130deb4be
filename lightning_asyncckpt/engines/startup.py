"""Why a spawned checkpoint worker died before it was ready, for the error that says so.

A worker that fails inside our code (an import of what the writes need, the engine's loop) sends its
exception through the startup pipe before it exits (``write.worker.engine_loop``). One that dies before any
of our code runs sends nothing, and its own words went to the job's stderr, not to the error:

- the interpreter cannot be executed (the job's virtualenv removed or rebuilt under it): the exec fails in
  multiprocessing's child, which exits with code 255 and prints nothing;
- the interpreter starts but cannot initialise or import us (``PYTHONHOME`` or ``PYTHONPATH`` changed in
  ``os.environ`` after the job started, a broken install): it prints to stderr and exits with code 1.

For those the interpreter is checked, and started once more as the worker is (same executable, environment,
``sys.path`` and directory; bounded), and what it says is the cause. Only on this failure path.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

DIAGNOSE_S = 60.0  # the second start of the interpreter: importing our worker module takes about a second
_ERROR_LINE = re.compile(r"error|exception", re.IGNORECASE)


def interpreter() -> str:
    """The executable that multiprocessing's spawn starts workers with (``multiprocessing.set_executable``)."""
    from multiprocessing import spawn

    return os.fsdecode(spawn.get_executable())


def diagnose() -> str:
    """(trainer) The cause of a worker's death before any of our code ran in it, as one sentence."""
    exe = interpreter()
    if not os.path.exists(exe) or not os.access(exe, os.X_OK):
        why = "No such file or directory" if not os.path.exists(exe) else "not executable by this user"
        return (f"cannot run the Python interpreter {exe} that starts it ({why}). Fix: was the job's environment"
                " removed or rebuilt under it? Run from an intact one (or point multiprocessing.set_executable()"
                " at a working interpreter)")
    code = f"import sys; sys.path[:0] = {sys.path!r}; import lightning_asyncckpt.write.worker"
    try:
        done = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=DIAGNOSE_S,
                              env=dict(os.environ), cwd=os.getcwd(), stdin=subprocess.DEVNULL)
    except OSError as e:
        return f"cannot run the Python interpreter {exe}: {e.strerror or e}"
    except subprocess.TimeoutExpired:
        return f"the Python interpreter {exe}, started again as the worker is, did not import it in {DIAGNOSE_S:g}s"
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        said = [line for line in lines if _ERROR_LINE.search(line)][-3:] or lines[-3:]
        return (f"the Python interpreter {exe}, started again as the worker is (same environment), says: "
                f"{' / '.join(said) or f'nothing (exit code {done.returncode})'}. Fix: the job's environment"
                " (PYTHONHOME, PYTHONPATH, the installed packages) as it is now")
    return ("it reported nothing, and the interpreter starts fine when tried again; the job's stderr may show"
            " the worker's own words")
