"""The torch side of routing allocations to cumem_rs, shared by `allocator.py` and `memory_saver.py`: tag checks, the
one pluggable allocator, pool activity across threads, and the block that routes a thread's allocations to a pool
under a tag (`pool_block`). torch's MemPool caveats are handled here and nowhere else:

* The pluggable allocator is kept alive for the whole process: torch's private pools hold a raw pointer to it,
  and a pool released after it (at interpreter shutdown, by a CUDA graph) would call into a dead object.
* A MemPool is only ever dropped while no pool block is active in the process: torch aborts the process when a
  pool is destroyed while allocations are being routed to any pool (its event sync asserts that no such routing
  is under way). Pools to drop wait until the last active block, on any thread, has ended.
* `expandable_segments` cannot be used with a MemPool (pytorch#147851): it is switched off while a pool block is
  active and the complete previous allocator settings string is restored afterwards.
* A pool that outlives one block (a region's pool in preload mode, a graph pool shared by token) caches the free
  blocks of its segments, and a paused tag's segments stay in it, unmapped: torch would hand such a block to the
  next allocation or capture in that pool, whose first access ends the CUDA context (an illegal address, sticky).
  `pool_holds_asleep_memory` tells; its callers take a fresh pool or refuse the capture.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Optional

import torch

from . import _native
from ._native import Allocator, CumemError, CumemTypeError, CumemValueError

logger = logging.getLogger("cumem_rs")

# --- argument checks ---------------------------------------------------------------------------------------------


def check_tag(tag: object) -> str:
    """`tag` if it is a non-empty str; CumemTypeError / CumemValueError otherwise."""
    if not isinstance(tag, str):
        raise CumemTypeError(f"a tag must be a str, got {type(tag).__name__}")
    if not tag:
        raise CumemValueError("a tag must be a non-empty str")
    return tag


def tag_tuple(tags: object, name: str) -> tuple[str, ...]:
    """A str means one tag; any other iterable is a collection of tags (possibly empty)."""
    if isinstance(tags, str):
        return (check_tag(tags),)
    if isinstance(tags, (bytes, bytearray)) or not isinstance(tags, Iterable):
        raise CumemTypeError(f"{name} must be a str or a collection of str, got {type(tags).__name__}")
    return tuple(check_tag(t) for t in tags)


# --- allocator settings (expandable segments) ---------------------------------------------------------------------

_EXPANDABLE_RE = re.compile(r"expandable_segments\s*:\s*(\w+)")


def _get_alloc_conf() -> str:
    """The allocator settings string in force. Newer torch reports the last one set (by env or at run time);
    torch 2.11 and older only have the environment, read in the order torch's CUDA allocator reads it."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        try:
            return str(getter())
        except Exception:  # a build without the accelerator config: use the environment
            pass
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""


def _set_alloc_conf(conf: str) -> None:
    # The whole string is always set: older torch resets the keys it is not given (max_split_size_mb, ...).
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(conf)
    else:
        torch.cuda.memory._set_allocator_settings(conf)


def _expandable_enabled(conf: str) -> bool:
    values = _EXPANDABLE_RE.findall(conf)
    return bool(values) and values[-1].lower() == "true"


# --- pool activity ------------------------------------------------------------------------------------------------


class PoolActivity:
    """Process-wide state of our pool blocks, across threads. While at least one block is active:

    * expandable segments are off; the settings string seen before the first block is restored after the last;
    * no MemPool is destroyed: pools handed to `exit`/`retire` are kept here and dropped, under the lock (so no
      block can start meanwhile), when the last block ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved_conf: Optional[str] = None
        self._retired: list[torch.cuda.memory.MemPool] = []

    def enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                conf = _get_alloc_conf()
                if _expandable_enabled(conf):
                    _set_alloc_conf(_EXPANDABLE_RE.sub("expandable_segments:False", conf))
                    self._saved_conf = conf
            self._depth += 1

    def exit(self, pools: list) -> None:
        """End one block; `pools` (emptied here, so the caller holds no reference) are dropped once idle."""
        with self._lock:
            self._retired.extend(pools)
            pools.clear()
            self._depth -= 1
            if self._depth == 0:
                try:
                    if self._saved_conf is not None:
                        saved, self._saved_conf = self._saved_conf, None
                        _set_alloc_conf(saved)
                finally:
                    self._drop_retired()

    def retire(self, pools: list) -> None:
        """Drop `pools` (emptied here) now if no block is active, else when the last one ends."""
        with self._lock:
            self._retired.extend(pools)
            pools.clear()
            if self._depth == 0:
                self._drop_retired()

    def when_idle(self, fn: Callable[[], None]) -> bool:
        """Run `fn` now if no block is active in the process, with none able to start meanwhile; False if one is.
        For torch calls that assert no allocation is being routed to a pool (`torch.cuda.empty_cache`)."""
        with self._lock:
            if self._depth:
                return False
            fn()
            return True

    def _drop_retired(self) -> None:
        # Our references are normally the last: torch releases each pool here, returning its unused segments
        # through my_free (no Python runs in there, so holding the lock is safe).
        self._retired.clear()


#: The one PoolActivity of the process: every pool block of every module enters and exits it.
pool_activity = PoolActivity()


@contextlib.contextmanager
def pool_block(native: Optional[Allocator] = None, tag: Optional[str] = None) -> Iterator[list]:
    """One pool block: `pool_activity` entered (expandable segments off, no pool destroyed meanwhile) and, with
    `native`, `tag` pushed as the innermost tag of this thread, both undone at exit in reverse order.

    Yields a list for the pools made for this block alone: make them inside the block and keep them only there;
    they are handed to `pool_activity` at exit (the list is emptied, so no frame keeps a pool alive and drops it
    later, at a moment when another block is routing allocations).
    """
    retire: list = []
    pool_activity.enter()
    try:
        if native is None:
            yield retire
        else:
            native.push_tag(check_tag(tag))
            try:
                yield retire
            finally:
                native.pop_tag()
    finally:
        pool_activity.exit(retire)


# --- pools entered, per tag --------------------------------------------------------------------------------------


def _segments(pool_ids: set[tuple[int, int]]) -> dict[tuple[int, int], list]:
    """torch's segments of each private pool in `pool_ids` (none once torch has released them all), from one
    snapshot of the whole allocator. Never torch's snapshot of one pool by id: for a pool torch has already
    destroyed, torch 2.11 crashes the process there (SIGSEGV in `memory_snapshot(pool_id)`, seen on an H200 with a
    thread re-entering tags while another slept and woke)."""
    try:
        segments = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # torch < 2.9 has no include_traces
        segments = torch.cuda.memory_snapshot()
    held: dict[tuple[int, int], list] = {pool_id: [] for pool_id in pool_ids}
    for segment in segments:
        pool_id = segment.get("segment_pool_id")
        if pool_id is not None and tuple(pool_id) in held:
            held[tuple(pool_id)].append(segment)
    return held


def asleep_segments(segments: Iterable[dict], asleep: list[tuple[int, int]]) -> list[int]:
    """The addresses of those of torch's `segments` (snapshot entries) that lie in an asleep allocation;
    `asleep` holds their (address, size), sorted by address."""
    starts = [a for a, _ in asleep]
    hits = []
    for segment in segments:
        address = int(segment["address"])
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and address < asleep[i][0] + asleep[i][1]:
            hits.append(address)
    return hits


def _asleep_ranges(native: Allocator) -> list[tuple[int, int]]:
    """(address, size) of the allocations of `native` now asleep, sorted by address."""
    return sorted((int(a["address"]), int(a["size"])) for a in native.allocations() if a["asleep"])


def segments_in_asleep_memory(native: Allocator, segments: list[dict]) -> list[int]:
    """The addresses of `segments` (torch's snapshot entries) that lie in allocations of `native` now asleep."""
    if not segments:
        return []
    asleep = _asleep_ranges(native)
    return asleep_segments(segments, asleep) if asleep else []


def pool_holds_asleep_memory(native: Allocator, pool_id: tuple[int, int]) -> bool:
    """Whether torch's private pool `pool_id` has a segment in memory of ours that is asleep (see the module doc).
    torch's snapshot (every block of every pool, under the allocator's lock) is taken only when something sleeps:
    vLLM asks before each of its captures, thousands at start-up with piecewise graphs, when nothing does."""
    asleep = _asleep_ranges(native)
    if not asleep:
        return False
    pool_id = (int(pool_id[0]), int(pool_id[1]))
    return bool(asleep_segments(_segments({pool_id})[pool_id], asleep))


def pool_holds_asleep_memory_or(native: Allocator, pool_id: tuple[int, int], unknown: bool, what: str) -> bool:
    """`pool_holds_asleep_memory`, or `unknown` (logged, naming `what`) when it cannot tell (torch's snapshot
    format changed, say): each caller picks the answer that is safe for it."""
    try:
        return pool_holds_asleep_memory(native, pool_id)
    except Exception as e:
        logger.warning("cumem_rs: could not tell whether %s holds memory asleep (%s): taken as %s", what, e,
                       "it does" if unknown else "it does not")
        return unknown


def refuse_capture_into_asleep_pool(native: Allocator, pool_id: tuple[int, int], what: str, message: str) -> None:
    """Raise CumemError(`message`) when the shared graph pool `pool_id` holds memory asleep: torch would hand a
    capture its cached blocks there, unmapped, and their first use would end the CUDA context. When it cannot
    tell, the capture goes on as before (logged): refusing every capture would break it for good."""
    if pool_holds_asleep_memory_or(native, pool_id, False, what):
        raise CumemError(message)


class EnteredPools:
    """The pools each tag's blocks were served from (vLLM's `allocator_and_pools`, by pool id), and the release of
    what they still hold when the tag is entered again.

    A pool we have dropped keeps, inside torch, the segments of tensors that were alive then; when those tensors
    die, their segments stay cached in torch until the next `torch.cuda.empty_cache()` (a dead pool has no cache of
    its own to trim). vLLM trims the older pools of a tag when the tag is entered again; `enter_again` does the
    same: where a dropped pool of the tag holds an unused segment, it empties torch's cache (only while no pool
    block is active in the process and the caller is not capturing a CUDA graph: torch asserts otherwise), which
    returns those segments through `my_free`. Pools torch no longer holds anything of are forgotten then, so the
    lists stay as long as the pools that still hold memory.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[str, list[tuple[tuple[int, int], weakref.ref]]] = {}

    def add(self, tag: str, pool: torch.cuda.memory.MemPool) -> None:
        with self._lock:
            self._pools.setdefault(tag, []).append((pool.id, weakref.ref(pool)))

    def ids(self) -> dict[str, list[tuple[int, int]]]:
        """A copy: per tag, the ids of its pools, oldest first."""
        with self._lock:
            return {tag: [pool_id for pool_id, _ in entries] for tag, entries in self._pools.items() if entries}

    def clear(self) -> None:
        with self._lock:
            self._pools.clear()

    def enter_again(self, tag: str) -> None:
        """Release the unused segments of the dropped pools of `tag`, and forget those with none left (class doc)."""
        with self._lock:
            dropped = [pool_id for pool_id, ref in self._pools.get(tag, ()) if ref() is None]
        if not dropped or not torch.cuda.is_initialized() or torch.cuda.is_current_stream_capturing():
            return
        segments = _segments(set(dropped))
        if any(s["allocated_size"] == 0 for held in segments.values() for s in held):
            if pool_activity.when_idle(torch.cuda.empty_cache):
                segments = _segments(set(dropped))
        empty = {pool_id for pool_id, held in segments.items() if not held}
        with self._lock:
            self._pools[tag] = [e for e in self._pools.get(tag, ()) if e[0] not in empty]


# --- the pluggable allocator ----------------------------------------------------------------------------------------

#: The path of the shared library that exports `my_malloc` / `my_free` (vLLM's `cumem.lib_name`): what
#: `CUDAPluggableAllocator` loads, and what code reaching the C entry points through ctypes opens.
LIB_NAME: str = _native.__file__

_PLUGGABLE: Optional[torch.cuda.memory.CUDAPluggableAllocator] = None
_PLUGGABLE_LOCK = threading.Lock()


def pluggable() -> torch.cuda.memory.CUDAPluggableAllocator:
    """The one CUDAPluggableAllocator over our `my_malloc`/`my_free`, created once and never destroyed."""
    global _PLUGGABLE
    with _PLUGGABLE_LOCK:
        if _PLUGGABLE is None:
            allocator = torch.cuda.memory.CUDAPluggableAllocator(LIB_NAME, "my_malloc", "my_free")
            # Deliberate leak: torch's private pools keep a raw pointer to this C++ allocator and call it when they
            # release segments, possibly during interpreter shutdown after module globals are cleared. One extra
            # reference keeps it alive until the process ends (vLLM hit "pure virtual method called" there).
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(allocator._allocator))
            _PLUGGABLE = allocator
        return _PLUGGABLE


def new_pool() -> torch.cuda.memory.MemPool:
    """A fresh MemPool over our allocator. Make it inside a `pool_block` and retire it through one."""
    return torch.cuda.memory.MemPool(pluggable()._allocator)
