"""How fast a CUDA state reaches the local tier's mapped files: the device-to-host copy into a ``MAP_SHARED``
``/dev/shm`` mapping as the tier makes it (pageable), into the same mapping registered with CUDA
(``cudaHostRegister``: the driver then copies to it as to pinned memory), and into pinned and pageable
memory of the process's own, beside it. Also the time the registration itself takes (once per file).

    python benchmarks/probe_d2h_mapped.py --gib 2 --reps 6 [--dir /local/nvme]   # /dev/shm, and --dir too

Prints one JSON line per destination (medians after the first copy); needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def timed_copies(dst: torch.Tensor, src: torch.Tensor, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def mapped_file(directory: Path, nbytes: int) -> tuple[Path, torch.Tensor]:
    """A file of ``nbytes`` mapped and faulted in, as the tier's file pool makes them."""
    fd, name = tempfile.mkstemp(prefix="probe-d2h-", dir=directory)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    return Path(name), torch.frombuffer(mapping, dtype=torch.uint8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--dir", action="append", default=[], help="another directory whose mapped files to probe")
    args = p.parse_args()
    nbytes = int(args.gib * (1 << 30)) // 64 * 64
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    rows = []

    def row(dest: str, seconds: float, **extra: float) -> None:
        rows.append({"dest": dest, "gib": args.gib, "copy_s": seconds, "gb_per_s": nbytes / seconds / 1e9, **extra})
        print(json.dumps(rows[-1]), flush=True)

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    row("pinned (the persistent tier's staging)", timed_copies(pinned, src, args.reps))
    del pinned
    pageable = torch.zeros(nbytes, dtype=torch.uint8)
    row("pageable, touched", timed_copies(pageable, src, args.reps))
    del pageable
    for directory in [shm, *map(Path, args.dir)]:
        path, flat = mapped_file(directory, nbytes)
        try:
            row(f"mapped file in {directory}, pageable", timed_copies(flat, src, args.reps))
            cudart = torch.cuda.cudart()
            t0 = time.perf_counter()
            err = cudart.cudaHostRegister(flat.data_ptr(), nbytes, 1)  # cudaHostRegisterPortable, as the tier
            register_s = time.perf_counter() - t0
            if int(err) != 0:
                print(json.dumps({"dest": f"mapped file in {directory}, registered", "error": str(err)}), flush=True)
            else:
                row(f"mapped file in {directory}, cudaHostRegister-ed", timed_copies(flat, src, args.reps),
                    register_s=register_s)
                t0 = time.perf_counter()
                cudart.cudaHostUnregister(flat.data_ptr())
                rows[-1]["unregister_s"] = time.perf_counter() - t0
            assert torch.equal(flat[:4096], src[:4096].cpu())
        finally:
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
