"""Why memguard does not lower the DataLoader's prefetch under host-memory pressure (issue 39,
item 3): torch fixes `prefetch_factor` per iterator. The live iterator copies it when it starts
(`_MultiProcessingDataLoaderIter._prefetch_factor`) and primes `prefetch_factor × workers`
batch indices at once; setting the loader's attribute changes nothing until the next epoch's
iterator, and forcing the live iterator's private copy below the tasks already outstanding
makes the next batch fail (`AssertionError: Number of outstanding tasks exceeded maximum
allowed tasks`). The batches already prefetched sit in shared memory until consumed either way.
This test keeps that claim true of the installed torch: if it fails, docs/host-memory.md's
"Fewer prefetched batches" is stale.

    python3 -m pytest -q bench/host/test_prefetch_is_fixed.py
"""

import pytest
import torch
from torch.utils.data import DataLoader


def test_a_live_iterator_keeps_its_prefetch_and_lowering_it_breaks_the_next_batch() -> None:
    loader = DataLoader(list(range(400)), batch_size=2, num_workers=2, prefetch_factor=4)
    it = iter(loader)
    next(it)
    loader.prefetch_factor = 1
    assert it._prefetch_factor == 4, "the live iterator keeps the prefetch it started with"
    assert it._tasks_outstanding > 1 * 2, "more batches in flight than a prefetch of 1 allows"
    it._prefetch_factor = 1
    with pytest.raises(AssertionError, match="outstanding tasks exceeded"):
        next(it)
    del it
    # Only the next iterator (the next epoch, without persistent workers) takes the new value.
    fresh = iter(loader)
    next(fresh)
    assert fresh._prefetch_factor == 1
