import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.cache import BlockAllocator, BlockAllocatorError


def test_fresh_allocator_hands_out_every_block_once():
    alloc = BlockAllocator(4)
    blocks = [alloc.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3]
    assert alloc.num_free == 0
    with pytest.raises(BlockAllocatorError, match="no free blocks"):
        alloc.allocate()


def test_double_free_and_foreign_ids_are_errors():
    alloc = BlockAllocator(2)
    block = alloc.allocate()
    alloc.free(block)
    with pytest.raises(BlockAllocatorError, match="double free"):
        alloc.free(block)
    with pytest.raises(BlockAllocatorError, match="does not belong"):
        alloc.free(7)
    with pytest.raises(BlockAllocatorError, match="does not belong"):
        alloc.free(-1)


def test_shared_block_returns_only_after_last_reference():
    alloc = BlockAllocator(1)
    block = alloc.allocate()
    alloc.share(block)
    assert alloc.refcount(block) == 2
    alloc.free(block)
    assert alloc.num_free == 0
    alloc.free(block)
    assert alloc.num_free == 1 and alloc.refcount(block) == 0


# Each op: ("alloc",) | ("free", i) | ("share", i) where i picks one of the references held.
ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc")),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("share"), st.integers(0, 1000)),
    ),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(0, 12), ops=ops)
def test_invariants_under_random_sequences(num_blocks, ops):
    alloc = BlockAllocator(num_blocks)
    held: list[int] = []  # one entry per reference held
    for op in ops:
        if op[0] == "alloc":
            if alloc.num_free == 0:
                with pytest.raises(BlockAllocatorError):
                    alloc.allocate()
            else:
                block = alloc.allocate()
                assert block not in held, "a live block was handed out again"
                held.append(block)
        elif held:
            block = held[op[1] % len(held)]
            if op[0] == "free":
                alloc.free(block)
                held.remove(block)
            else:
                alloc.share(block)
                held.append(block)
        live = set(held)
        assert alloc.num_free == num_blocks - len(live)
        for block in range(num_blocks):
            assert alloc.refcount(block) == held.count(block)
