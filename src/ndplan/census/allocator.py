"""PyTorch's CUDA caching allocator, replayed: reserved bytes from a sequence of allocations.

``torch.cuda.max_memory_reserved`` is what the allocator took from the driver: segments
(``cudaMalloc`` calls) that it splits into blocks and keeps after their tensors die, to serve
later requests. Which requests a freed block can serve is set by a few rules, so the reserved
peak of a step follows from the order and sizes of its allocations and frees, which a step on
fake tensors records exactly. This replays them with the rules of the native allocator
(c10/cuda/CUDACachingAllocator.cpp, default settings):

* a request is rounded up to a multiple of 512 B (at least 512 B);
* requests up to 1 MiB come from the small pool, the rest from the large pool, each kept per
  stream: a block serves only requests of its pool made on the stream it was allocated on, and
  returns there when freed (FSDP2 allocates its all-gather buffers on a copy-in stream and the
  reduce-scatter output on a reduce-scatter stream);
* the smallest free block of the pool that holds the request serves it (best fit; among equal
  sizes the lowest address), and is split when what remains is at least 512 B (small pool) or
  over 1 MiB (large pool): the remainder stays free in the same segment;
* with no such block a new segment is allocated: 2 MiB for a small request, 20 MiB for one under
  10 MiB, else the request rounded up to 2 MiB;
* a freed block merges with the free blocks beside it in its segment; segments are returned to
  the driver only by ``empty_cache`` (or when a ``cudaMalloc`` would exceed the device, which
  first frees every cached segment with no live block: ``capacity_bytes``);

Not replayed: expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), the
``max_split_size_mb``, ``roundup_power2_divisions`` and ``garbage_collection_threshold``
settings, a block held past its free by work still queued on another stream (``record_stream``),
and NCCL's own buffers (outside the allocator). Pure Python, no torch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK_BYTES = 512
SMALL_REQUEST_BYTES = 1 << 20  # the largest request of the small pool
SMALL_SEGMENT_BYTES = 2 << 20
LARGE_SEGMENT_BYTES = 20 << 20  # segment of a request over 1 MiB and under MIN_LARGE_ALLOC_BYTES
MIN_LARGE_ALLOC_BYTES = 10 << 20
LARGE_ROUND_BYTES = 2 << 20


def rounded_request(nbytes: int) -> int:
    """Bytes a request of ``nbytes`` takes: a multiple of 512, at least 512."""
    if nbytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def segment_bytes(request: int) -> int:
    """Bytes of the segment a rounded ``request`` allocates when no cached block serves it."""
    if request <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if request < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-request // LARGE_ROUND_BYTES) * LARGE_ROUND_BYTES


@dataclass(eq=False)
class _Block:
    address: int
    size: int
    small: bool
    stream: int = 0
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int]:
        return (self.size, self.address)

    def pool(self) -> tuple[int, bool]:
        return (self.stream, self.small)


@dataclass
class CachingAllocator:
    """The allocator's state and its counters, in bytes. ``malloc(key, nbytes, stream)`` and
    ``free(key)`` name each allocation by a key of the caller's (a storage's id); streams are
    numbered by the caller (0: the default stream)."""

    capacity_bytes: int | None = None
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    segments_allocated: int = 0
    _pools: dict[tuple[int, bool], list[tuple[int, int]]] = field(default_factory=dict)
    _free_blocks: dict[tuple[int, bool, int, int], _Block] = field(default_factory=dict)
    _live: dict[object, _Block] = field(default_factory=dict)
    _next_address: int = 0

    def malloc(self, key: object, nbytes: int, stream: int = 0) -> None:
        """Serve a request of ``nbytes`` made on ``stream`` for ``key`` (a key already live is an
        error)."""
        if key in self._live:
            raise ValueError(f"allocation {key!r} is already live")
        size = rounded_request(int(nbytes))
        small = size <= SMALL_REQUEST_BYTES
        block = self._best_fit((stream, small), size)
        if block is None:
            block = self._new_segment(small, segment_bytes(size), stream)
        else:
            self._unlist(block)
        remaining = block.size - size
        if (remaining >= MIN_BLOCK_BYTES) if small else (remaining > SMALL_REQUEST_BYTES):
            rest = _Block(block.address + size, remaining, small, stream, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._list(rest)
        block.allocated = True
        self._live[key] = block
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)

    def free(self, key: object) -> None:
        """Return ``key``'s block to its pool, merged with the free blocks beside it."""
        block = self._live.pop(key)
        block.allocated = False
        self.allocated_bytes -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._unlist(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._list(block)

    def empty_cache(self) -> None:
        """Return every segment with no live block to the driver (``torch.cuda.empty_cache``)."""
        for block in list(self._free_blocks.values()):
            if block.prev is None and block.next is None:
                self._unlist(block)
                self.reserved_bytes -= block.size

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats``: the peaks start again from the present."""
        self.peak_allocated_bytes = self.allocated_bytes
        self.peak_reserved_bytes = self.reserved_bytes

    def live(self, key: object) -> bool:
        return key in self._live

    def _best_fit(self, pool_key: tuple[int, bool], size: int) -> _Block | None:
        pool = self._pools.get(pool_key, [])
        at = bisect.bisect_left(pool, (size, -1))
        if at == len(pool):
            return None
        found_size, address = pool[at]
        return self._free_blocks[(*pool_key, found_size, address)]

    def _new_segment(self, small: bool, nbytes: int, stream: int) -> _Block:
        if self.capacity_bytes is not None and self.reserved_bytes + nbytes > self.capacity_bytes:
            self.empty_cache()  # what the allocator does before it reports out of memory
        self.segments_allocated += 1
        block = _Block(self._next_address, nbytes, small, stream)
        self._next_address += nbytes
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return block

    def _list(self, block: _Block) -> None:
        bisect.insort(self._pools.setdefault(block.pool(), []), block.key())
        self._free_blocks[(*block.pool(), *block.key())] = block

    def _unlist(self, block: _Block) -> None:
        pool = self._pools[block.pool()]
        del pool[bisect.bisect_left(pool, block.key())]
        del self._free_blocks[(*block.pool(), *block.key())]


__all__ = ["CachingAllocator", "rounded_request", "segment_bytes"]
