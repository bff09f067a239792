"""KV page allocator with reference counts and an automatic prefix cache. Pure Python.

Invariants:
- Page 0 is the scratch page padding tokens write to; it is never handed out.
- A page is *held* while its reference count is positive; `num_free` counts the others.
- A full page can carry a prefix hash: a hash of every token from the sequence start to the page's
  end. Such a page stays findable after its last holder lets go, until the allocator needs it
  again. Unheld pages without a hash are reused first (they hold nothing findable); cached ones
  are evicted least-recently-freed first, so recently used prefixes survive.
- Hashes and pages map one to one: a page carries at most one hash, a hash names at most one page.
- When no request holds a page, `num_free == num_pages - 1`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional, Sequence

SCRATCH_PAGE = 0


def prefix_hashes(token_ids: Sequence[int], page_size: int, parent: int = 0) -> list[int]:
    """One chained hash per *full* page of `token_ids`: hash i covers every token from the start
    of the sequence to the end of page i. `parent` is the hash of the pages before `token_ids`."""
    hashes: list[int] = []
    for end in range(page_size, len(token_ids) + 1, page_size):
        parent = hash((parent, tuple(token_ids[end - page_size : end])))
        hashes.append(parent)
    return hashes


class PageAllocator:
    """Hands out KV pages; `allocate`/`free` come in pairs, `match_prefix`/`register` serve the cache."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_pages
        # Unheld pages in reuse order (oldest first); cached ones among them remain findable.
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, num_pages))
        self._page_of_hash: dict[int, int] = {}
        self._hash_of_page: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` unheld pages, evicting the least recently freed cached ones."""
        if not self.can_allocate(n):
            raise RuntimeError(f"asked for {n} KV pages with {self.num_free} free; call can_allocate first")
        pages = []
        for _ in range(n):
            page, _ = self._free.popitem(last=False)
            self._forget(page)
            self._ref_counts[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page. Unheld cached pages go to the back of the reuse order,
        unheld uncached ones to the front. Pages are freed in reverse so a sequence's tail is
        reused before its shared prefix."""
        for page in reversed(list(pages)):
            if self._ref_counts[page] <= 0:
                raise RuntimeError(f"page {page} freed more often than it was allocated")
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free[page] = None
                if page not in self._hash_of_page:
                    self._free.move_to_end(page, last=False)

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Take a reference to the cached pages matching `hashes` from the first one on, stopping
        at the first miss. Returns those pages (possibly none)."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for h in hashes:
            page = self._page_of_hash.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self._ref_counts[page] == 0:
                del self._free[page]
            self._ref_counts[page] += 1
        return pages

    def register(self, page: int, page_hash: int) -> None:
        """Make a full, held page findable by its prefix hash (first writer wins; a page keeps
        its first hash until it is reallocated)."""
        if not self.enable_prefix_caching or page_hash in self._page_of_hash or page in self._hash_of_page:
            return
        self._page_of_hash[page_hash] = page
        self._hash_of_page[page] = page_hash

    def cached_page(self, page_hash: int) -> Optional[int]:
        return self._page_of_hash.get(page_hash)

    def _forget(self, page: int) -> None:
        page_hash = self._hash_of_page.pop(page, None)
        if page_hash is not None:
            del self._page_of_hash[page_hash]
