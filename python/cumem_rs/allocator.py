"""CuMemAllocator: the vLLM-compatible torch layer over the process-wide CUDA allocator.

Same public API and semantics as vLLM's `vllm/device_allocator/cumem.py` (`get_instance`, `default_tag`,
`use_memory_pool`, `sleep`, `wake_up`, `get_current_usage`, `discard`; the `MemAllocator` protocol of
`vllm/device_allocator/__init__.py`; vLLM's records `pointer_to_data`, `allocator_and_pools`, `current_tag`, and the
module's `lib_name`), plus `cudagraph_pool` (alias `use_cudagraph_pool`), `release_pools`, `close`, and per-tag
`set_tag_policy`, `pause`, `resume` and `status`. The memory itself is managed by the Rust
core (`cumem_rs.Allocator.cuda()`); this module only routes torch allocations to it and works around torch's
MemPool caveats:

* Routing: one `CUDAPluggableAllocator` over our exported `my_malloc`/`my_free`, a `MemPool` over it, and
  `use_mem_pool`. The tag of an allocation is the innermost tag on the native, per-thread tag stack, pushed
  around the block (torch calls `my_malloc` on the allocating thread).
* One MemPool per `use_memory_pool` call, as upstream does, dropped after the block. Dropping is what makes torch
  release the pool's cached but unused segments (through `my_free`): a live MemPool never returns memory, not
  even on `torch.cuda.empty_cache()` (pytorch#145168). Segments that still hold tensors stay in torch's private
  pool (torch keeps it while it owns segments) and are released through the pool's own allocator once those
  tensors die, at the next `torch.cuda.empty_cache()` or out-of-memory retry. That per-pool release is torch >=
  2.8; older versions fall back to `cudaFree` on our addresses (pytorch#146431), so they are refused.
* Pool blocks, the pluggable allocator, when pools may be dropped and expandable segments: `_pools.py`, shared
  with `memory_saver.py`.
* Pools we hold are dropped at exit (atexit), before interpreter teardown.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Optional, Union

import torch

from . import _env, _native
from ._native import Allocator, ClosedError, CumemError, CumemTypeError, CumemValueError
from ._pools import (
    LIB_NAME,
    EnteredPools,
    check_tag,
    new_pool,
    pluggable,
    pool_activity,
    pool_block,
    refuse_capture_into_asleep_pool,
    tag_tuple,
)
from ._records import AllocationRecords
from .logs import forward_native_logs
from .results import BackupTier, Compress, Report, Stats, Status, WakeFill

logger = logging.getLogger("cumem_rs")

#: Tags whose wake-up may be deferred: `wake_up(tags)` limits only these; every other asleep tag always wakes (vLLM's
#: "runtime", "workspace" and "cudagraph" among them).
DEFERRABLE_TAGS = frozenset({"weights", "kv_cache"})
#: Default tag of `cudagraph_pool`.
CUDAGRAPH_TAG = "cudagraph"

_MIN_TORCH = (2, 8)

#: The path of the library that exports `my_malloc` / `my_free` (what vLLM's `cumem.lib_name` names for its own).
lib_name: str = LIB_NAME

#: What `sleep` collects first, so that segments of tensors that died in reference cycles are freed rather than
#: copied: "full" (`gc.collect()`, what vLLM's allocator does: 68 ms in the benchmark process, more in a server
#: holding millions of objects), "young" (generations 0 and 1 only: cycles made since the last full collection,
#: typically the ones a step just dropped, at a cost that does not grow with the process's long-lived objects),
#: "off". Set per instance (`CuMemAllocator.sleep_gc`) or with CUMEM_RS_SLEEP_GC.
SLEEP_GC_MODES = ("full", "young", "off")
_DEFAULT_SLEEP_GC = "young"

#: Tags whose `use_memory_pool` block, when it ends, starts pinning host memory in the background for their
#: backup, so that the first sleep copies into page-locked memory (`CuMemAllocator.pin_ahead_tags`).
PIN_AHEAD_TAGS = ("weights", "default")
_GiB = float(1 << 30)

TagArg = Union[str, Iterable[str]]


def _torch_version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


# --- logging --------------------------------------------------------------------------------------------------------


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


# --- CuMemAllocator -------------------------------------------------------------------------------------------------

_INSTANCE_LOCK = threading.Lock()


class CuMemAllocator:
    """Singleton torch allocator whose memory can be put to sleep and woken at the same addresses.

    Tensors created inside `use_memory_pool(tag)` get their memory from cumem_rs under `tag`. `sleep(offload_tags)`
    copies the allocations of `offload_tags` to host memory and releases all physical memory; `wake_up(tags)` maps
    memory at the same virtual addresses again and restores the copies. Get it with `get_instance()`.
    """

    instance: Optional["CuMemAllocator"] = None
    default_tag: str = "default"

    @classmethod
    def get_instance(cls) -> "CuMemAllocator":
        """The process-wide instance (created on first call). Raises CumemError without a usable CUDA GPU."""
        if cls.instance is None:
            with _INSTANCE_LOCK:
                if cls.instance is None:
                    cls.instance = cls()
        return cls.instance

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise CumemError(
                "CuMemAllocator needs a CUDA GPU, but torch.cuda.is_available() is False "
                "(no GPU visible, no CUDA driver, or a CPU-only torch build)"
            )
        if not _native.cuda_available():
            raise CumemError(
                "CuMemAllocator needs a CUDA GPU, but cumem_rs could not load the CUDA driver (libcuda) "
                "or the driver reports no device"
            )
        if _torch_version() < _MIN_TORCH:
            raise CumemError(
                f"CuMemAllocator needs torch >= {_MIN_TORCH[0]}.{_MIN_TORCH[1]} (MemPool segments must be released "
                f"through their own allocator, pytorch#146431); found {torch.__version__}"
            )
        backend = torch.cuda.memory.get_allocator_backend()
        if backend != "native":
            raise CumemError(
                f"CuMemAllocator needs torch's native caching allocator (MemPool), but the backend is {backend!r}"
            )
        self._native: Allocator = Allocator.cuda()
        pluggable()  # created now, so that a failure to load it surfaces here rather than in the first pool block
        self._lock = threading.Lock()
        # Pools handed out by cudagraph_pool, per (tag, device): reused by later captures, dropped by release_pools.
        self._graph_pools: dict[tuple[str, int], torch.cuda.memory.MemPool] = {}
        self._entered = EnteredPools()
        self._records = AllocationRecords(self._native)
        self._closed = False
        self._sleep_gc = _DEFAULT_SLEEP_GC
        self.sleep_gc = _env.text(_env.SLEEP_GC, _DEFAULT_SLEEP_GC)
        #: Pin host memory for the backup of `pin_ahead_tags` in the background when one of their
        #: `use_memory_pool` blocks ends (default on; the switch CUMEM_RS_PIN_AHEAD=0 or off turns it off).
        self.pin_ahead: bool = _env.flag(_env.PIN_AHEAD, True)
        self.pin_ahead_tags: tuple[str, ...] = PIN_AHEAD_TAGS
        # A process forked from this one (a DataLoader worker, a fork pool) inherits the exit handler but none of
        # the CUDA state: there it does nothing.
        self._pid = os.getpid()
        atexit.register(self._at_exit)

    @property
    def sleep_gc(self) -> str:
        """Garbage collection before each sleep: "full", "young" (default) or "off" (see SLEEP_GC_MODES)."""
        return self._sleep_gc

    @sleep_gc.setter
    def sleep_gc(self, mode: str) -> None:
        if mode not in SLEEP_GC_MODES:
            raise CumemValueError(f"sleep_gc must be one of {SLEEP_GC_MODES}, got {mode!r}")
        self._sleep_gc = mode

    # -- introspection --

    @property
    def native(self) -> Allocator:
        """The core allocator (`cumem_rs.Allocator.cuda()`): allocations(), stats(), errors(), ..."""
        return self._native

    @property
    def pointer_to_data(self) -> AllocationRecords:
        """vLLM's records: a read-only live mapping, pointer of each live allocation -> `AllocationData` with
        `handle` `(device, size, pointer, 0)`, `tag`, `is_asleep`, `cpu_backup_tensor` (see `cumem_rs._records`).
        Every access asks the core allocator, so it never goes stale; a walk takes one snapshot."""
        return self._records

    @property
    def allocator_and_pools(self) -> dict[str, list[tuple[int, int]]]:
        """Per tag, the ids of the torch pools its `use_memory_pool` blocks and `cudagraph_pool` were served from,
        oldest first, while torch still holds memory of them (a copy; vLLM keeps (MemPool, allocator) pairs here,
        cumem_rs drops its pools when their block ends). Emptied by `release_pools`."""
        return self._entered.ids()

    @property
    def current_tag(self) -> str:
        """Innermost tag of the calling thread ("default" outside any pool)."""
        return self._native.current_tag()

    @property
    def codec(self) -> Optional[str]:
        """What sleeps compress host backups with (the codec's own description, e.g. nvCOMP's and where it was
        loaded from), or None when backups are raw (no codec, or CUMEM_RS_COMPRESS=0)."""
        return self._native.stats()["codec"]

    def stats(self) -> Stats:
        """The core allocator's counters, compression included: `host_tier_bytes` (raw) against
        `host_tier_stored_bytes`, `compressed_bytes`, `compressed_raw_bytes`, `compression_ratio`, `codec`."""
        return self._native.stats()

    def get_current_usage(self) -> int:
        """Bytes held by live allocations, awake or asleep (as upstream: every allocation still registered)."""
        return sum(size for _, size, *_ in self._native.records())

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this CuMemAllocator was closed; call CuMemAllocator.get_instance() for a new one")

    # -- pools --

    @contextlib.contextmanager
    def use_memory_pool(self, tag: Optional[str] = None) -> Iterator[None]:
        """Allocate the tensors created on this thread inside the block from cumem_rs, under `tag`.

        A fresh MemPool serves the block; when the block exits it is dropped, so torch releases the segments
        left unused (freed temporaries) right away, and the others once their tensors die and torch empties its
        cache: at the next sleep, `torch.cuda.empty_cache()`, or when `tag` is entered again (as vLLM trims a
        re-entered tag's older pools; see `_pools.EnteredPools`). Each block's pool is listed in
        `allocator_and_pools[tag]` while torch holds memory of it.
        """
        tag = self.default_tag if tag is None else check_tag(tag)
        self._check_open()
        if tag != self._native.current_tag():
            try:
                self._entered.enter_again(tag)
            except Exception as e:  # returning a dead tensor's memory early must never fail the block itself
                logger.warning("cumem_rs: releasing unused segments of earlier %r pools failed: %s", tag, e)
        with pool_block(self._native, tag) as retire:
            retire.append(new_pool())
            self._entered.add(tag, retire[0])
            with torch.cuda.memory.use_mem_pool(retire[0]):
                yield
        if self.pin_ahead and tag in self.pin_ahead_tags:
            self._start_pin_ahead()

    def _start_pin_ahead(self) -> None:
        """Pin, in the background, host memory for the backup of `pin_ahead_tags` (never fails the caller)."""
        try:
            nbytes = self._native.backup_bytes_of(list(self.pin_ahead_tags))
            if nbytes > 0:
                self._native.reserve_host(nbytes, background=True)
        except CumemError as e:
            logger.warning("cumem_rs: pinning host memory ahead of the first sleep failed: %s", e)

    @contextlib.contextmanager
    def cudagraph_pool(self, tag: str = CUDAGRAPH_TAG) -> Iterator[tuple[int, int]]:
        """Yield a pool id for `torch.cuda.graph(g, pool=...)`: memory the graphs allocate during capture comes from
        cumem_rs under `tag` (not offloaded by default: it is scratch memory, rewritten by every replay).

        Capture inside this block (it sets the tag and keeps expandable segments off). The same pool is returned
        for the same tag and device until `release_pools()`, so graphs captured in turn share their memory.
        vLLM itself captures graphs into the default torch pool; this is the opt-in to have them sleep too.
        While that pool holds memory of a tag that sleeps, the block is refused with CumemError: torch would hand a
        capture the pool's cached blocks there, unmapped, and their first use would end the CUDA context.
        """
        tag = check_tag(tag)
        self._check_open()
        key = (tag, torch.cuda.current_device())
        with self._lock:
            pool = self._graph_pools.get(key)
            fresh = pool is None
            if pool is None:
                pool = self._graph_pools[key] = new_pool()
                self._entered.add(tag, pool)
        pool_id = pool.id
        del pool
        if not fresh:
            refuse_capture_into_asleep_pool(
                self._native, pool_id, f"the graph pool of {tag!r}",
                f"cudagraph_pool({tag!r}): its pool holds memory that sleeps, which a capture would be handed "
                f"unmapped (its first use would end the CUDA context); wake {tag!r} first (wake_up() or "
                f"wake_up(tags=[{tag!r}]))",
            )
        with pool_block(self._native, tag):
            yield pool_id

    #: The name newer vLLM uses for `cudagraph_pool`.
    use_cudagraph_pool = cudagraph_pool

    def release_pools(self) -> None:
        """Drop the pools this object holds (those of `cudagraph_pool`) and let torch return every unused segment of
        released pools. Tensors and captured graphs that still use memory keep it."""
        with self._lock:
            pools = list(self._graph_pools.values())
            self._graph_pools.clear()
        self._entered.clear()
        pool_activity.retire(pools)
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Release the pools and cached host backup memory; later calls on this object raise ClosedError.
        Live tensors keep their memory (the core allocator is process-wide and stays open). Idempotent."""
        if self._closed:
            return
        self.release_pools()
        self._native.trim_host()
        self._closed = True
        atexit.unregister(self._at_exit)
        with _INSTANCE_LOCK:
            if CuMemAllocator.instance is self:
                CuMemAllocator.instance = None

    def _at_exit(self) -> None:
        # Release torch pools while torch, the pluggable allocator and the driver are all still alive; stop the
        # background pinning worker before the driver is torn down. Not in a forked child (see __init__).
        if os.getpid() != self._pid:
            return
        try:
            self._native.stop_pinning_ahead()
        except Exception as e:  # never fail interpreter shutdown
            logger.debug("cumem_rs: stopping background pinning at exit failed: %s", e)
        try:
            self.release_pools()
        except Exception as e:  # never fail interpreter shutdown
            logger.debug("cumem_rs: releasing pools at exit failed: %s", e)

    # -- where backups go --

    def set_host_budget(self, nbytes: Optional[int]) -> None:
        """Cap the pinned host memory held for backups at `nbytes` (None: no cap); see `Allocator.set_host_budget`."""
        self._check_open()
        self._native.set_host_budget(nbytes)

    def set_spill_dir(self, path: Optional[Union[str, "os.PathLike[str]"]]) -> None:
        """Backups past the host budget go to unlinked files in `path` (None: no file tier); see
        `Allocator.set_spill_dir`."""
        self._check_open()
        self._native.set_spill_dir(path)

    def settle_spill_files(self) -> None:
        """Wait until the disk blocks of spill files given back so far are free; see
        `Allocator.settle_spill_files`."""
        self._check_open()
        self._native.settle_spill_files()

    def set_staging_bytes(self, nbytes: int) -> None:
        """Size of the file tier's pinned staging ring (default 256 MiB); see `Allocator.set_staging_bytes`."""
        self._check_open()
        self._native.set_staging_bytes(nbytes)

    # -- sleep / wake --

    def sleep(self, offload_tags: Optional[TagArg] = None) -> Report:
        """Back up the allocations of `offload_tags` to host memory and release the physical memory of all.

        None means ("default",), a str one tag, an empty collection backs up nothing. Allocations already asleep
        keep their state. Returns the core report (copied, skipped-as-unchanged and discarded bytes, allocations,
        seconds). With tag policies set (`set_tag_policy`), None backs up each tag per its policy instead, and
        "default" only while it has none.
        """
        tags = None if offload_tags is None else tag_tuple(offload_tags, "offload_tags")
        self._check_open()
        # Let torch return segments whose tensors died (released pools): they are freed, not copied to host. This
        # also hands torch's own cached memory back to the driver, as upstream does after sleeping.
        if self._sleep_gc == "full":
            gc.collect()
        elif self._sleep_gc == "young":
            gc.collect(1)
        torch.cuda.empty_cache()
        report = self._native.sleep(None if tags is None else list(tags))
        self._log_release("sleep", "tags per policy" if tags is None else list(tags), report)
        return report

    def wake_up(self, tags: Optional[TagArg] = None) -> Report:
        """Map memory at the same addresses again and restore the backups.

        None wakes everything asleep. Otherwise `tags` selects among the deferrable tags ("weights", "kv_cache")
        only: every other asleep tag always wakes (vLLM semantics). All or nothing: on failure (e.g. out of memory)
        nothing is woken, backups are kept, CumemError is raised, and a later call can succeed.
        """
        requested = None if tags is None else set(tag_tuple(tags, "tags"))
        self._check_open()
        wanted: Optional[list[str]] = None
        if requested is not None:
            asleep = {a["tag"] for a in self._native.allocations() if a["asleep"]}
            wanted = sorted(requested | {t for t in asleep if t not in DEFERRABLE_TAGS})
        report = self._native.wake_up(wanted)
        self._log_restore("wake_up", "all tags" if wanted is None else wanted, report)
        return report

    def discard(self, tags: TagArg) -> Report:
        """Release the physical memory of the awake allocations of `tags` without backup (contents undefined after
        the next wake). Other tags are untouched."""
        wanted = tag_tuple(tags, "tags")
        self._check_open()
        report = self._native.discard(list(wanted))
        discarded = report["discarded_bytes"]
        logger.info(
            "cumem_rs: discard released %d bytes (%.2f GiB) of %s", discarded, discarded / _GiB, list(wanted)
        )
        forward_native_logs()
        return report

    # -- tag policies, pause/resume, status --

    def set_tag_policy(
        self,
        tag: str,
        backup: Optional[bool] = None,
        wake_fill: WakeFill = "undefined",
        backup_tier: BackupTier = "auto",
        compress: Compress = "auto",
    ) -> None:
        """Set the whole policy of `tag` ahead of time (the defaults clear it).

        `backup`: whether its memory is backed up when released by a call that does not say: `pause` always
        follows it (None: back up), `sleep()` without `offload_tags` too (None: only "default" is), while
        `sleep(offload_tags)` decides for every tag itself. `wake_fill="zero"`: its memory that wakes without a
        backup comes back zeroed instead of undefined (a device memset queued under the wake's copies).
        `backup_tier`: "host", "file" (the spill directory, `set_spill_dir`) or "auto" (host memory up to the
        host budget, files for the rest). `compress`: whether its host backups are compressed where a codec is
        active (`codec`): "auto" (the 16-bit mode, best for bf16/fp16 weights), "off", "bits16", "bits8" (fp8)
        or "bytes" (any data); what does not shrink is stored raw, and the file backups of such a tag are compressed
        too (their blobs in the spill file).
        """
        tag = check_tag(tag)
        if backup is not None and not isinstance(backup, bool):
            raise CumemTypeError(f"backup must be a bool or None, got {type(backup).__name__}")
        if wake_fill not in ("undefined", "zero"):
            raise CumemValueError(f"wake_fill must be 'undefined' or 'zero', got {wake_fill!r}")
        self._check_open()
        if backup_tier not in ("host", "file", "auto"):
            raise CumemValueError(f"backup_tier must be 'host', 'file' or 'auto', got {backup_tier!r}")
        if compress not in ("auto", "off", "bits16", "bits8", "bytes"):
            raise CumemValueError(
                f"compress must be 'auto', 'off', 'bits16', 'bits8' or 'bytes', got {compress!r}"
            )
        self._native.set_tag_policy(tag, backup, wake_fill, backup_tier, compress)

    def pause(self, tags: Optional[TagArg] = None) -> Report:
        """Release the awake memory of `tags` only (None: every tag), backed up per their policy (unset: backed
        up). Other tags keep their memory and their kernels keep running; only the devices holding paused
        memory are synchronized. Pausing a paused tag is a no-op. Returns the core report."""
        wanted = None if tags is None else list(tag_tuple(tags, "tags"))
        self._check_open()
        report = self._native.pause(wanted)
        self._log_release("pause", "all tags" if wanted is None else wanted, report)
        return report

    def resume(self, tags: Optional[TagArg] = None) -> Report:
        """Wake exactly `tags` (None: every tag; unlike `wake_up`, no tag wakes unasked). All or nothing, like
        `wake_up`; resuming an awake tag is a no-op. Memory without backup comes back per its wake_fill."""
        wanted = None if tags is None else list(tag_tuple(tags, "tags"))
        self._check_open()
        report = self._native.resume(wanted)
        self._log_restore("resume", "all tags" if wanted is None else wanted, report)
        return report

    def _log_release(self, what: str, tags: object, report: Report) -> None:
        copied, skipped = report["copied_bytes"], report["skipped_bytes"]
        discarded, seconds = report["discarded_bytes"], report["seconds"]
        logger.info(
            "cumem_rs: %s backed up %d bytes (%.2f GiB) of %s (%d copied, %d unchanged since the last wake) "
            "and discarded %d bytes (%.2f GiB); %d allocations in %.3f s (%.1f GB/s backed up)",
            what, copied + skipped, (copied + skipped) / _GiB, tags, copied, skipped, discarded, discarded / _GiB,
            report["allocations"], seconds, _rate(copied + skipped, seconds),
        )
        forward_native_logs()

    def _log_restore(self, what: str, tags: object, report: Report) -> None:
        restored, seconds = report["copied_bytes"], report["seconds"]
        logger.info(
            "cumem_rs: %s restored %d bytes (%.2f GiB) for %s; %d allocations in %.3f s (%.1f GB/s)",
            what, restored, restored / _GiB, tags, report["allocations"], seconds,
            _rate(restored, seconds),
        )
        forward_native_logs()

    def status(self) -> Status:
        """Per tag: allocations, mapped/asleep/backup bytes, policy (backup, wake_fill) and state (awake, asleep,
        mixed); plus `is_sleeping`. See `cumem_rs.Allocator.status`."""
        self._check_open()
        return self._native.status()

    def __repr__(self) -> str:
        if self._closed:
            return "<CuMemAllocator closed>"
        return f"<CuMemAllocator {_summary(self._native.status())}>"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", _GiB), ("MiB", float(1 << 20))):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _summary(status: Status) -> str:
    """One line from a status dict: totals, then the state of each tag with allocations (and its policy if set)."""
    tags = {name: t for name, t in status["tags"].items() if t["allocations"]}
    mapped = sum(t["mapped_bytes"] for t in tags.values())
    asleep = sum(t["asleep_bytes"] for t in tags.values())
    backed_up = sum(t["backup_bytes"] for t in tags.values())
    parts = []
    for name, t in tags.items():
        policy = []
        if t["backup"] is not None:
            policy.append(f"backup={t['backup']}")
        if t["wake_fill"] != "undefined":
            policy.append(f"wake_fill={t['wake_fill']}")
        parts.append(f"{name}={t['state']}" + (f"[{','.join(policy)}]" if policy else ""))
    return (
        f"{'sleeping' if status['is_sleeping'] else 'awake'}: {_size(mapped)} mapped, "
        f"{_size(asleep)} asleep ({_size(backed_up)} backed up); "
        + (" ".join(parts) if parts else "no tags")
    )


__all__ = ["CUDAGRAPH_TAG", "DEFERRABLE_TAGS", "CuMemAllocator", "lib_name"]
