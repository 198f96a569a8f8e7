"""Host memory for the loader's large per-batch tensors, allocated where the copies and page faults are fewest.

A 224 px batch is tens of MB, allocated afresh every step: the first touch of each 4 KiB page is a
page fault, which on the 2-core CPU machine cost more than the arithmetic written into the pages
(profiled: a batch of 64 normalised to float32 spent ~17 of its ~22 ms faulting). So a normalised
batch lives in transparent huge pages (one fault per 2 MiB), and a loader worker stacks its batch
straight into shared memory (as DataLoader's default collate does) instead of having it copied
there when it is sent to the main process.

The training process normalises each batch on one thread (:func:`one_thread`): its loader workers
keep the cores busy, and torch's intra-op threads waiting on each other at every op's barrier while
the workers hold the cores cost ~3x the work itself (profiled on the 2-core CPU machine, 2 workers).
"""
from __future__ import annotations

import contextlib
import math
import mmap
from typing import Iterator, Sequence

import torch
from torch.utils.data import get_worker_info

HUGE_PAGE = 2 << 20
MIN_HUGE_BYTES = 4 * HUGE_PAGE  # smaller tensors: the default allocator (few faults, reused by malloc)


def empty_huge(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` backed by an anonymous private mapping advised to use huge
    pages; a plain ``torch.empty`` where the tensor is small or the platform has no ``MADV_HUGEPAGE``.
    The tensor holds the mapping (freed with it)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes < MIN_HUGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE  # a 2 MiB boundary
    buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % mmap.PAGESIZE)
    return torch.frombuffer(buf, dtype=dtype, offset=start, count=nbytes // itemsize).view(tuple(shape))


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch ops on this thread run single-threaded inside the block (the thread count restored after)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def stack_for_main(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)``; in a DataLoader worker, into shared memory, so sending it to the main
    process is no copy."""
    if get_worker_info() is None:
        return torch.stack(list(tensors))
    first = tensors[0]
    storage = first._typed_storage()._new_shared(len(tensors) * first.numel(), device=first.device)
    out = first.new(storage).resize_(len(tensors), *first.shape)
    return torch.stack(list(tensors), out=out)
