"""The arena's invariants over random lifetimes: aligned, no overlap while live, bytes >= the lower bound."""

from hypothesis import given, settings, strategies as st

from lanefuse.lane.lower.arena import ALIGN, Live, aligned, check, lower_bound, place


@st.composite
def lifetimes(draw):
    n = draw(st.integers(0, 40))
    launches = draw(st.integers(1, 30))
    items = []
    for i in range(n):
        a = draw(st.integers(0, launches - 1))
        b = draw(st.integers(a, launches - 1))
        items.append(Live(f"t{i}", draw(st.integers(1, 5000)), a, b))
    return items


@settings(max_examples=300, deadline=None)
@given(lifetimes())
def test_arena_invariants(items):
    arena = place(items)
    check(arena)
    assert len(arena.arrays) == len(items)
    assert arena.lower_bound == lower_bound(items)
    assert all(p.offset % ALIGN == 0 for p in arena.arrays)


def test_disjoint_lifetimes_share_offset_zero():
    arena = place([Live("a", 1000, 0, 1), Live("b", 1000, 2, 3), Live("c", 10, 4, 4)])
    assert {p.offset for p in arena.arrays} == {0}
    assert arena.bytes == aligned(1000) == arena.lower_bound


def test_overlapping_lifetimes_stack_largest_first():
    arena = place([Live("small", 100, 0, 2), Live("big", 5000, 1, 3)])
    by = arena.by_name()
    assert by["big"].offset == 0 and by["small"].offset == aligned(5000)
    assert arena.bytes == aligned(5000) + aligned(100)


def test_placing_a_name_twice_is_refused():
    import pytest

    with pytest.raises(ValueError):
        place([Live("a", 1, 0, 0), Live("a", 1, 1, 1)])
