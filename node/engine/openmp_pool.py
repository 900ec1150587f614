"""The OpenMP workers behind torch's parallel loops belong to the thread that runs forwards.

libgomp (torch's OpenMP runtime on Linux) keeps one pool of worker threads per thread that has
opened a parallel region, and keeps it after the region ends. Once the pools' threads outnumber
the CPUs it stops spinning between regions, so each of a decode step's few hundred regions (the
GEMMs, the fused kernels) pays a futex wake-up. A server loads its model on one thread and
decodes on another, so both had a pool: at two threads its forward thread decoded slower than
at one. A backend therefore releases the pool of the thread that built it and, whenever it goes
idle, its own; the next parallel region makes a fresh one (microseconds, once per busy spell).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

OMP_PAUSE_SOFT = 1
"""``omp_pause_soft`` (OpenMP 5.0): free the workers; the runtime stays usable."""


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's), or None: another OpenMP runtime (macOS,
    Windows), none yet, or one without OpenMP 5.0's pause."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.rsplit(maxsplit=1)[-1] if line.strip() else ""
        if Path(path).name.startswith("libgomp"):
            lib = ctypes.CDLL(path)  # already mapped: dlopen returns the same library
            return lib if hasattr(lib, "omp_pause_resource_all") else None
    return None


def release_pool() -> bool:
    """Free the calling thread's idle OpenMP workers (``omp_pause_resource_all``); its next
    parallel region starts new ones. False where there is no libgomp to ask, or the thread is
    inside a parallel region (then nothing is freed)."""
    lib = _libgomp()
    if lib is None:
        return False
    return lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
