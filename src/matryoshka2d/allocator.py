"""glibc's allocator, told how to keep a long-running process's memory flat (a no-op with another C library).

Batches of many shapes make the heap fragment: freed activation tensors and small objects leave holes that
the next batch's sizes do not fit, and RSS creeps up with the input or the load (docs/benchmarks.md: encode
memory, serving). Two remedies, measured there:
- `fix_mmap_threshold`: every allocation of 1 MB or more gets its own mmap, returned when freed (glibc
  otherwise raises this threshold after the first large free). Flat memory, but each large tensor costs page
  faults: about a fifth of the server's throughput.
- `trim_heap`: malloc_trim(0) after a unit of work returns the free pages; cheap at that rate.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_libc = None


def _c_library():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            _libc = False
    return _libc


def fix_mmap_threshold(size: int = 1 << 20) -> None:
    """Serve every allocation of `size` bytes or more with its own mmap."""
    libc = _c_library()
    if libc and hasattr(libc, "mallopt"):
        libc.mallopt(-3, size)  # M_MMAP_THRESHOLD


def trim_heap() -> None:
    """Give the heap's free pages back to the system."""
    libc = _c_library()
    if libc and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
