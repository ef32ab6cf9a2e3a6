import pytest
from hypothesis import given
from hypothesis import strategies as st

from preempt.core.block_pool import BlockPool, BlockPoolError, blocks_needed


def test_blocks_needed_is_ceil_division():
    assert [blocks_needed(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_allocate_and_free_keep_accounting():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert pool.num_free == 0 and not pool.can_allocate(1)
    assert sorted(a + b) == list(range(8))
    pool.free(a)
    assert pool.num_free == 3 and pool.num_used == 5
    pool.check()


def test_misuse_is_an_error_not_silent_drift():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(BlockPoolError, match="not in use"):
        pool.free(blocks[:1])
    with pytest.raises(BlockPoolError, match="asked for 5"):
        pool.allocate(5)
    with pytest.raises(ValueError):
        BlockPool(0)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60))
def test_random_alloc_free_conserves_blocks(ops):
    pool = BlockPool(16)
    owned: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc and pool.can_allocate(n):
            owned.append(pool.allocate(n))
        elif not is_alloc and owned:
            pool.free(owned.pop(n % len(owned)))
        flat = [b for blocks in owned for b in blocks]
        assert len(flat) == len(set(flat)) == pool.num_used
        assert pool.num_free + pool.num_used == 16
        pool.check()
