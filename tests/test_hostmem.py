"""The loader's batch memory: huge-page float batches and worker batches stacked into shared memory."""
from __future__ import annotations

import gc
import resource
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from pipeline.data.hostmem import MIN_HUGE_BYTES, empty_huge, one_thread, stack_for_main
from pipeline.data.transforms import BatchFinish

SHAPE = (64, 3, 224, 224)  # a 224 px batch: 38 MB as float32
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _faults(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_empty_huge_is_a_usable_tensor_that_owns_its_memory():
    x = empty_huge(SHAPE)
    assert x.shape == SHAPE and x.dtype == torch.float32 and x.is_contiguous()
    x.fill_(1.5)
    gc.collect()  # the mapping is the tensor's: nothing else holds it
    assert float(x[-1, -1, -1, -1]) == 1.5 and float(x.sum()) == 1.5 * x.numel()
    small = empty_huge((3, 8, 8), torch.uint8)
    assert small.shape == (3, 8, 8) and small.dtype == torch.uint8 and small.nbytes < MIN_HUGE_BYTES


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_empty_huge_faults_far_fewer_pages_than_torch_empty():
    plain = _faults(lambda: torch.empty(SHAPE).fill_(0))
    huge = _faults(lambda: empty_huge(SHAPE).fill_(0))
    assert plain > 5000  # one per 4 KiB page
    assert huge < plain / 10, (huge, plain)


def test_batch_finish_on_cpu_gives_the_reference_arithmetic():
    finish = BatchFinish(None)
    batch = torch.randint(0, 256, SHAPE, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    expected = batch.to(torch.float32).sub_(finish.shift).div_(finish.scale)
    assert torch.equal(finish(batch), expected)
    assert torch.equal(finish(batch[:2]), expected[:2])  # a small batch: the default allocator


def test_one_thread_inside_the_block_and_the_count_restored_after(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        seen = []
        real = torch.Tensor.copy_
        monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src: seen.append(torch.get_num_threads())
                            or real(self, src))
        BatchFinish(None)(torch.zeros(2, 3, 4, 4, dtype=torch.uint8))  # the CPU normalisation: one thread
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


class _Stacked(IterableDataset):
    def __iter__(self):
        images = [torch.full((3, 4, 5), i, dtype=torch.uint8) for i in range(6)]
        out = stack_for_main(images)
        yield out, torch.tensor(out.is_shared())


def test_stack_for_main_stacks_into_shared_memory_in_a_worker():
    assert not stack_for_main([torch.zeros(2), torch.ones(2)]).is_shared()  # the main process: a plain stack
    (batch, shared_in_worker), = DataLoader(_Stacked(), batch_size=None, num_workers=1)
    assert bool(shared_in_worker)
    assert torch.equal(batch, torch.arange(6, dtype=torch.uint8).view(6, 1, 1, 1).expand(6, 3, 4, 5))
