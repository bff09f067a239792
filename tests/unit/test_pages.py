"""engine.generate.pages: the page allocator's free list, reference counts and prefix cache (chained hashes
of full pages, first writer wins, unheld cached pages evicted least-recently-freed first).
Pure Python: exact page ids."""

from __future__ import annotations

import random

import pytest

from engine.generate.pages import SCRATCH_PAGE, PageAllocator, prefix_hashes


def all_free(alloc: PageAllocator) -> bool:
    return alloc.num_free == alloc.num_pages - 1 and all(alloc.ref_count(p) == 0 for p in range(alloc.num_pages))


# ---- prefix_hashes ----


def test_prefix_hashes_cover_full_pages_only():
    assert prefix_hashes([1, 2, 3], 4) == []
    assert len(prefix_hashes(list(range(4)), 4)) == 1
    assert len(prefix_hashes(list(range(11)), 4)) == 2
    assert len(prefix_hashes(list(range(12)), 4)) == 3


def test_prefix_hashes_are_chained_over_the_whole_prefix():
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = prefix_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same second page, different first page
    assert prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == a  # a partial page adds nothing
    assert prefix_hashes([5, 6, 7, 8], 4, parent=a[0]) == a[1:]  # `parent` continues the chain
    assert prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a  # deterministic


# ---- free list and reference counts ----


def test_needs_a_page_besides_the_scratch_page():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(1, 4)


def test_allocate_never_hands_out_the_scratch_page():
    alloc = PageAllocator(5, 4)
    assert alloc.num_free == 4
    assert alloc.can_allocate(4) and not alloc.can_allocate(5)
    assert alloc.allocate(3) == [1, 2, 3]
    assert alloc.allocate(1) == [4]
    assert alloc.num_free == 0 and not alloc.can_allocate(1) and alloc.can_allocate(0)
    assert alloc.ref_count(SCRATCH_PAGE) == 0
    assert [alloc.ref_count(p) for p in range(1, 5)] == [1, 1, 1, 1]
    with pytest.raises(RuntimeError, match="can_allocate"):
        alloc.allocate(1)
    alloc.free([1, 2, 3, 4])
    assert all_free(alloc)


def test_allocate_zero_pages():
    alloc = PageAllocator(3, 4)
    assert alloc.allocate(0) == []
    assert alloc.num_free == 2


def test_free_more_often_than_allocated_raises():
    alloc = PageAllocator(4, 4)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(RuntimeError, match="freed more often"):
        alloc.free(pages[:1])
    with pytest.raises(RuntimeError, match="freed more often"):
        alloc.free([3])  # never allocated


def test_ref_counts_follow_match_and_free():
    alloc = PageAllocator(6, 2)
    pages = alloc.allocate(2)
    hashes = prefix_hashes([1, 2, 3, 4], 2)
    for page, h in zip(pages, hashes):
        alloc.register(page, h)
    assert alloc.match_prefix(hashes) == pages
    assert alloc.match_prefix(hashes[:1]) == pages[:1]
    assert [alloc.ref_count(p) for p in pages] == [3, 2]
    assert alloc.num_free == 3  # matching held pages takes nothing from the free list
    alloc.free(pages)
    alloc.free(pages[:1])
    assert [alloc.ref_count(p) for p in pages] == [1, 1]
    assert alloc.num_free == 3
    alloc.free(pages)
    assert all_free(alloc)


def test_uncached_pages_are_reused_before_cached_ones():
    alloc = PageAllocator(5, 2)
    a, b = alloc.allocate(2)
    alloc.register(a, prefix_hashes([1, 2], 2)[0])
    alloc.free([a, b])  # b holds nothing findable
    assert alloc.allocate(3) == [b, 3, 4]  # then the never-used pages, then the cached one
    assert alloc.cached_page(prefix_hashes([1, 2], 2)[0]) == a
    assert alloc.allocate(1) == [a]
    assert alloc.cached_page(prefix_hashes([1, 2], 2)[0]) is None


def test_without_caching_freed_pages_are_reused_at_once():
    alloc = PageAllocator(5, 2, enable_prefix_caching=False)
    a, b = alloc.allocate(2)
    alloc.free([a, b])
    assert alloc.allocate(2) == [a, b]


# ---- prefix cache ----


def test_match_prefix_stops_at_the_first_miss():
    alloc = PageAllocator(8, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = prefix_hashes(tokens, 2)
    pages = alloc.allocate(3)
    alloc.register(pages[0], hashes[0])
    alloc.register(pages[2], hashes[2])  # page 1 never registered: page 2 is unreachable
    assert alloc.match_prefix(hashes) == pages[:1]
    assert alloc.match_prefix(prefix_hashes([9, 9, 3, 4], 2)) == []
    assert alloc.match_prefix([]) == []
    assert alloc.ref_count(pages[0]) == 2 and alloc.ref_count(pages[2]) == 1


def test_cached_pages_survive_free_and_match_takes_them_back():
    alloc = PageAllocator(6, 4)
    hashes = prefix_hashes(list(range(12)), 4)
    pages = alloc.allocate(3)
    for page, h in zip(pages, hashes):
        alloc.register(page, h)
    alloc.free(pages)
    assert all_free(alloc)
    assert [alloc.cached_page(h) for h in hashes] == pages
    assert alloc.match_prefix(hashes[:2]) == pages[:2]
    assert alloc.num_free == 3
    assert [alloc.ref_count(p) for p in pages] == [1, 1, 0]
    # The pages left in the free list keep their order: the other page, then the old never used ones.
    assert alloc.allocate(3) == [4, 5, pages[2]]
    assert alloc.cached_page(hashes[2]) is None  # evicted by reuse
    assert alloc.cached_page(hashes[0]) == pages[0]


def test_register_first_writer_wins_and_a_page_keeps_its_hash():
    alloc = PageAllocator(4, 2)
    h1, h2 = prefix_hashes([1, 2], 2)[0], prefix_hashes([3, 4], 2)[0]
    a, b = alloc.allocate(2)
    alloc.register(a, h1)
    alloc.register(b, h1)  # same content computed twice: the first page stays the cached one
    alloc.register(a, h2)  # a page carries one hash
    assert alloc.cached_page(h1) == a
    assert alloc.cached_page(h2) is None
    alloc.register(b, h2)
    assert alloc.cached_page(h2) == b
    alloc.free([a, b])
    assert alloc.allocate(3) == [3, b, a]  # freed in reverse; reuse forgets both hashes
    assert alloc.cached_page(h1) is None and alloc.cached_page(h2) is None


def test_disabled_prefix_cache_never_matches():
    alloc = PageAllocator(4, 2, enable_prefix_caching=False)
    h = prefix_hashes([1, 2], 2)
    (page,) = alloc.allocate(1)
    alloc.register(page, h[0])
    assert alloc.cached_page(h[0]) is None
    assert alloc.match_prefix(h) == []
    assert alloc.ref_count(page) == 1


def test_eviction_is_least_recently_freed_first():
    alloc = PageAllocator(5, 2)
    ha, hb = prefix_hashes([1, 2, 3, 4], 2), prefix_hashes([5, 6, 7, 8], 2)
    a = alloc.allocate(2)
    b = alloc.allocate(2)
    for pages, hashes in ((a, ha), (b, hb)):
        for page, h in zip(pages, hashes):
            alloc.register(page, h)
    alloc.free(b)  # b freed first: evicted first, although allocated later
    alloc.free(a)
    assert alloc.allocate(1) == [b[1]]  # the tail of a freed sequence goes before its prefix
    assert alloc.match_prefix(hb) == [b[0]]  # b's first page is still findable
    alloc.free([b[0]])  # ...and now the most recently freed
    assert alloc.allocate(2) == [a[1], a[0]]
    assert alloc.match_prefix(ha) == []
    assert alloc.match_prefix(hb) == [b[0]]


def test_match_refreshes_nothing_until_freed_again():
    """A matched page leaves the free list; freeing it again puts it at the back of the order."""
    alloc = PageAllocator(4, 2)
    hashes = [prefix_hashes([t, t], 2)[0] for t in range(3)]
    pages = alloc.allocate(3)
    for page, h in zip(pages, hashes):
        alloc.register(page, h)
        alloc.free([page])  # freed in order 0, 1, 2
    assert alloc.match_prefix(hashes[:1]) == pages[:1]
    alloc.free(pages[:1])  # order now 1, 2, 0
    assert alloc.allocate(1) == [pages[1]]
    assert alloc.allocate(1) == [pages[2]]
    assert alloc.allocate(1) == [pages[0]]


def test_random_holders_keep_counts_exact():
    rng = random.Random(0)
    alloc = PageAllocator(12, 2)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.45 or not alloc.can_allocate(1)):
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            tokens = [rng.randrange(3) for _ in range(2 * rng.randint(1, 3))]
            hashes = prefix_hashes(tokens, 2)
            pages = alloc.match_prefix(hashes)
            n = len(hashes) - len(pages)
            if not alloc.can_allocate(n):
                alloc.free(pages)
                continue
            pages += alloc.allocate(n)
            for page, h in zip(pages, hashes):
                alloc.register(page, h)
            held.append(pages)
        counts = [0] * alloc.num_pages
        for pages in held:
            assert len(set(pages)) == len(pages) and SCRATCH_PAGE not in pages
            for page in pages:
                counts[page] += 1
        assert [alloc.ref_count(p) for p in range(alloc.num_pages)] == counts
        assert alloc.num_free == sum(1 for c in counts[1:] if c == 0)
    for pages in held:
        alloc.free(pages)
    assert all_free(alloc)
