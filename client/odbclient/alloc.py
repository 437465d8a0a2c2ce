"""First-fit free list with coalescing: the daemon's arena and each producer's lane use it.

Lives in odbclient because producers allocate inside their own lane without a round trip to
the daemon; the daemon sends back the offsets trainers released.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(slots=True)
class FreeList:
    """Address-ordered free extents of one segment: first-fit allocation, coalescing free.

    Why first-fit over a free list rather than size-class slabs: sample sizes vary widely
    (length CV up to 1.2), so slabs would waste space or need many classes, and samples are
    freed roughly in allocation order (FIFO through the buffer), so freed neighbours coalesce
    and the list stays a handful of extents long; a scan of it costs less than a slab lookup.
    """

    starts: list[int]  # sorted extent start offsets
    sizes: list[int]  # sizes[i] belongs to starts[i]; adjacent extents never touch (coalesced)

    def take(self, size: int) -> int | None:
        for i, start in enumerate(self.starts):
            if self.sizes[i] >= size:
                if self.sizes[i] == size:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += size
                    self.sizes[i] -= size
                return start
        return None

    def give(self, start: int, size: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        if i < len(self.starts) and start + size == self.starts[i]:  # merge with the next
            size += self.sizes[i]
            del self.starts[i], self.sizes[i]
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == start:  # merge with the previous
            self.sizes[i - 1] += size
        else:
            self.starts.insert(i, start)
            self.sizes.insert(i, size)

    def largest(self) -> int:
        return max(self.sizes, default=0)
