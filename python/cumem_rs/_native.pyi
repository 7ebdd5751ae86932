"""Type stubs for the Rust extension module `cumem_rs._native`.

Addresses are plain ints (device virtual addresses; on the simulated driver they are host addresses of
`mmap` reservations, which stay the same across sleep/wake exactly as on a GPU). The dicts returned are typed by
the TypedDicts of `cumem_rs.results`. A bad argument raises `CumemValueError` (a wrong value) or `CumemTypeError`
(a wrong type), naming the argument: both are `CumemError`s, and a `ValueError` / `TypeError` respectively.
"""

import os
import pathlib
from typing import Literal, Optional, Sequence, Union, final, overload

from .results import (
    AllocationRecord,
    DriverCounts,
    Info,
    PinAheadStatus,
    Report,
    Stats,
    Status,
    TagPolicy,
)

__all__ = [
    "__version__",
    "FAULT_OPS",
    "CORRUPTING_FAULT_OPS",
    "FAULT_ERRORS",
    "CumemError",
    "CumemOutOfMemoryError",
    "CumemTypeError",
    "CumemValueError",
    "DriverError",
    "ClosedError",
    "Allocator",
    "HostBytes",
    "cuda_available",
    "env_flag",
    "fingerprint_bytes",
    "is_cuda_allocator_ready",
    "ffi_errors",
    "drain_logs",
    "set_nvcomp_wheels",
    "cuda_codec_status",
    "cuda_codec_device_bytes",
    "_codec_round_trip",
    "_panic_in_next_ffi_call",
    "preload_library",
    "preload_register",
    "preload_registered",
    "preload_route_to",
    "preload_set_init_enable",
    "preload_init_enable",
    "preload_push_region",
    "preload_push_disabled",
    "preload_pop",
    "preload_routed_tag",
    "preload_live_pointers",
]

__version__: str

#: Operation names accepted by `Allocator.inject_fault` (simulated driver only).
FAULT_OPS: list[str]
#: Also accepted by `inject_fault`, but the call succeeds with wrong results instead of failing:
#: "decompress_corrupt" flips a byte of what a wake's decompression restored, "copy_h2d_corrupt" one of what a
#: host -> device copy wrote, which the wake's verification against the sleep's fingerprints must catch.
CORRUPTING_FAULT_OPS: list[str]
#: Error kinds accepted by `Allocator.inject_fault`.
FAULT_ERRORS: list[str]

class CumemError(RuntimeError):
    """Base class of every error raised by cumem_rs. An internal error (a caught Rust panic) is a CumemError
    too; if it interrupted a call holding the allocator's lock, that allocator refuses every later call."""

class CumemOutOfMemoryError(CumemError):
    """Physical device memory (or host backup memory) ran out."""

class CumemValueError(CumemError, ValueError):
    """A bad argument value (a negative size, an empty tag, an unknown address or device, an int out of range); the
    message names the argument and the value given. Both a CumemError and a ValueError."""

class CumemTypeError(CumemError, TypeError):
    """An argument of the wrong type; the message names the argument. Both a CumemError and a TypeError."""

class DriverError(CumemError):
    """A driver call failed; the message names the operation and the CUDA error."""

    #: The driver operation that failed: a FAULT_OPS name ("create", "map", ...), or for a set-up call on CUDA the
    #: driver function ("cuInit", "cuCtxGetCurrent", ...).
    op: str
    #: The CUDA result code it returned (e.g. 999 for CUDA_ERROR_UNKNOWN).
    code: int

class ClosedError(CumemError):
    """The allocator was closed; no further calls are possible."""

def fingerprint_bytes(data: bytes, chunk: int) -> list[tuple[int, int]]:
    """Host reference fingerprints of `data` in chunks of `chunk` bytes (both multiples of 16): the values the GPU
    kernel computes for the same bytes."""
def env_flag(name: str, default: bool) -> bool:
    """The switch `name` of the environment as the Rust side reads every switch: 1/true/yes/on or 0/false/no/off
    (any case); unset, empty or another value (logged as a warning): `default`."""

def cuda_available() -> bool:
    """True when libcuda can be loaded and reports at least one device. Never raises."""

def ffi_errors() -> list[str]:
    """Errors recorded by my_malloc/my_free while no CUDA allocator existed to record them (e.g. no GPU)."""

# The preload hook (cumem_rs._preload and memory_saver's hook_mode="preload" use these).
def preload_library() -> bytes:
    """The preload hook library (a shared object) to write to a file for LD_PRELOAD."""
def preload_register() -> bool:
    """Install the hooks in the preload library if it is loaded in this process; False when it is not."""
def preload_registered() -> bool:
    """Whether the hooks are installed in a preloaded library in this process."""
def preload_route_to(allocator: Optional[Allocator]) -> None:
    """Route allocations of the hook to `allocator` (None: the process-wide CUDA allocator)."""
def preload_set_init_enable(on: bool) -> None:
    """TMS_INIT_ENABLE: route every thread's allocations outside regions (under the default tag)."""
def preload_init_enable() -> bool:
    """Whether TMS_INIT_ENABLE's routing is on."""
def preload_push_region(tag: str) -> None:
    """Enter a region on this thread: its cudaMalloc calls are routed under `tag` until `preload_pop`."""
def preload_push_disabled() -> None:
    """Enter disable() on this thread: its cudaMalloc calls go to the runtime until `preload_pop`."""
def preload_pop() -> None:
    """Leave this thread's innermost region or disable()."""
def preload_routed_tag() -> Optional[str]:
    """The tag a cudaMalloc on this thread would get now; None: it would go to the runtime."""
def preload_live_pointers() -> int:
    """How many pointers the hook handed out that are not freed yet."""

def drain_logs() -> list[tuple[int, str]]:
    """Rust-side log records queued since the last call, oldest first: (Python logging level, message)."""

def set_nvcomp_wheels(wheels: list[tuple[int, str]]) -> None:
    """Remember the installed nvCOMP wheels as (CUDA major, library path), for when the CUDA driver loads."""

def cuda_codec_status() -> tuple[bool, str]:
    """(active, text): the CUDA backend's codec and where it comes from, or why there is none."""

def cuda_codec_device_bytes(device: int) -> int:
    """Device bytes the CUDA codec holds on `device` (its staging ring)."""

def _codec_round_trip(
    device: int, src: int, dst: int, nbytes: int, kind: str = "bits16"
) -> list[tuple[int, bool]]:
    """Diagnostic: compress `nbytes` at device address `src` through the CUDA codec, restore them at `dst`;
    (stored bytes, raw) per 2 MiB range."""

def _panic_in_next_ffi_call(on: bool) -> None:
    """Test hook: the next my_malloc or my_free call panics inside; the panic must be caught there."""

def is_cuda_allocator_ready() -> bool:
    """True once the process-wide CUDA allocator behind `my_malloc`/`my_free` has been created."""

# Native (PyO3) classes: they cannot be subclassed.
@final
class HostBytes:
    """`nbytes` bytes of raw host backup memory at `address` (of this process), mapped as long as this object
    lives (`Allocator.view_backup`)."""

    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...

@final
class Allocator:
    """Virtual-memory allocator over one driver (simulated or CUDA)."""

    @staticmethod
    def simulated(
        devices: Optional[int] = None,
        capacity: Optional[int] = None,
        granularity: Optional[int] = None,
        host_memory: Optional[int] = None,
        host_register_delay: float = 0.0,
        compress: bool = True,
    ) -> "Allocator":
        """A fresh allocator over a new simulated driver. `capacity` is physical bytes per device.
        None means the default: 1 device, 1 GiB capacity, 2 MiB granularity. `host_memory`: host bytes the
        simulated machine can pin (None: the real host's, see CUMEM_RS_HOST_MEMORY_LIMIT); `host_register_delay`:
        seconds each host registration takes (to race sleeps against background pinning in tests); `compress`:
        whether the simulated driver offers its host codec (zstd) for compressed backups (False: every backup is
        raw, as on a GPU without nvCOMP)."""
    @staticmethod
    def cuda() -> "Allocator":
        """The process-wide CUDA allocator (the one `my_malloc`/`my_free` use). Raises CumemError without a GPU."""
    @property
    def backend(self) -> str:
        """"sim" or "cuda"."""
    def device_count(self) -> int: ...
    def granularity(self, device: int = 0) -> int: ...
    def mem_info(self, device: int = 0) -> tuple[int, int]:
        """(free, total) physical bytes of the device."""
    def malloc(self, size: int, device: int = 0, stream: object = None) -> int:
        """Reserve, create, map `size` bytes (rounded up to the granularity) under the current tag.

        `stream` is the stream whose work `free` waits for (and whose graph capture it respects): None or 0 (no
        stream: free synchronizes the device), or a `torch.cuda.Stream`. Raw integer handles (and
        `torch.cuda.ExternalStream`, which wraps one) are refused with ValueError / TypeError: they cannot be
        checked and a wrong one would crash the process at free."""
    def free(self, address: int) -> None:
        """Free a live allocation, awake or asleep (its backup is released too). If the driver refuses the
        synchronize or unmap, this raises and the allocation stays live (try again later); a release failing
        after the unmap is queued for retry instead. (`my_free`, whose caller forgets the pointer, queues the
        whole release and records the failure in `errors()`.)"""
    def push_tag(self, tag: str) -> None:
        """Make `tag` the current tag of the calling thread (a stack; innermost wins)."""
    def pop_tag(self) -> str:
        """Undo the last push_tag of this thread and return its tag."""
    def current_tag(self) -> str:
        """Innermost tag of this thread, "default" when the stack is empty."""
    def sleep(self, offload_tags: Optional[Union[str, Sequence[str]]] = None) -> Report:
        """Back up awake allocations of `offload_tags` to host memory, then release the physical memory of all
        awake allocations. None: each tag is backed up per its policy (`set_tag_policy`), and a tag without a
        backup policy only if it is "default" (so None means ("default",) while no policy is set). Returns a
        `Report` (`cumem_rs.results.Report` says what each key means)."""
    def wake_up(self, tags: Optional[Union[str, Sequence[str]]] = None) -> Report:
        """Map new physical memory at the same addresses for asleep allocations of `tags` (None = all) and copy
        backups back. Transactional: on failure nothing is woken and the backups are kept. Every restored chunk is
        compared with the fingerprint its sleep took (any tier; CUMEM_RS_VERIFY_WAKE=0 turns it off): a mismatch
        fails the wake like a failed copy. Returns a `Report` (`cumem_rs.results.Report`)."""
    def discard(self, tags: Union[str, Sequence[str]]) -> Report:
        """Release awake allocations of `tags` without backup (contents undefined after wake)."""
    def read(self, address: int, size: int) -> bytes:
        """Copy `size` bytes at `address` (inside one awake allocation) to host."""
    def write(self, address: int, data: bytes) -> None:
        """Copy `data` to `address` (inside one awake allocation)."""
    def info(self) -> Info:
        """The backend, its devices, the codec sleeps compress with and the driver's version
        (`cumem_rs.results.Info`)."""
    @property
    def closed(self) -> bool: ...
    def usage(self, device: Optional[int] = None) -> int:
        """Mapped (physical) bytes held by this allocator, on one device or all."""
    def allocations(self) -> list[AllocationRecord]:
        """One dict per live allocation: address, size, requested, device, tag, asleep, backed_up."""
    @overload
    def records(self, address: None = None) -> list[tuple[int, int, int, str, bool, bool]]: ...
    @overload
    def records(self, address: int) -> Optional[tuple[int, int, int, str, bool, bool]]:
        """`(address, size, device, tag, asleep, backed_up)` per live allocation, in address order; with
        `address`, the one allocation that starts there, or None. What `CuMemAllocator.pointer_to_data` reads."""
    def stats(self) -> Stats:
        """Counters: live allocations, mapped/asleep/host bytes, last sleep and wake reports, error counts."""
    def host_bytes(self) -> int:
        """Host backup bytes held (in use by asleep allocations plus cached for the next sleep). Bounded: at
        most the bytes asleep with a backup plus one spare arena no larger than the largest backup one sleep
        made (or `reserve_host` asked for); backups left in arenas with holes by partial wakes are moved
        together when needed to stay within that."""
    def set_spill_dir(self, path: Optional[Union[str, "os.PathLike[str]"]], named: bool = False) -> None:
        """The file tier's spill directory (None: no file tier; env CUMEM_RS_SPILL_DIR). Backups past the host
        budget go to files there, created unlinked with mode 0600 (nothing is left behind by a killed process),
        through a pinned staging ring; O_DIRECT where the file system takes it. ValueError naming the path when it
        is missing, not a directory or not writable.

        `named=True` (torch_memory_saver's disk backup, `cumem_rs.memory_saver`): each file-tier backup is a file
        of its own, visible in the directory as `cumem_rs-<pid>-<serial>.bak` (mode 0600, created exclusively,
        never through a symlink, its size the allocation's rounded up to 4 KiB), removed as soon as its backup is
        dropped: at wake (unless retained), free, discard, `trim_host`, close, or by `unlink_named_spill_files`
        (the memory saver calls it at interpreter exit). A killed process leaves its named files behind. Each
        named backup holds an open file: thousands of them need a matching `ulimit -n`."""
    @staticmethod
    def unlink_named_spill_files() -> int:
        """Remove the names of this process's named spill files from their directories (for an exit handler);
        the backups stay readable through their open files. Returns how many names were removed."""
    @property
    def spill_dir(self) -> Optional[pathlib.Path]:
        """The spill directory, or None."""
    def settle_spill_files(self) -> None:
        """Wait until the disk blocks of the spill files and holes given back so far are free. A wake, free or
        discard that drops file backups returns before the file system has freed their blocks (closing a file of
        a few GiB takes it about a second); a background thread does that. The next sleep's space check and
        `close()` wait for it too; call this before measuring the disk."""
    def set_staging_bytes(self, nbytes: int) -> None:
        """Size of the file tier's pinned staging ring (default 256 MiB, at least 4 KiB; outside the host budget)."""
    def inject_spill_fault(self, op: Literal["write", "read"], nth: int = 1, error: Literal["short", "enospc", "eio"] = "eio") -> None:
        """Test hook: the `nth` next spill-file write or read fails (short: half the bytes, then no progress)."""
    def clear_spill_faults(self) -> None:
        """Drop every armed spill-file fault."""
    def set_host_budget(self, nbytes: Optional[int]) -> None:
        """Cap the pinned host memory held for backups (`host_bytes()`) at `nbytes` (None: no cap; env
        CUMEM_RS_HOST_BUDGET with K/M/G suffixes). A sleep whose backups would pass it sends the rest to the spill
        directory (`set_spill_dir`); without one it is refused with CumemOutOfMemoryError naming the budget,
        before anything is released."""
    @property
    def host_budget(self) -> Optional[int]:
        """The host budget in bytes, or None."""
    def set_keep_host_memory(self, keep: bool) -> None:
        """Keep host backup memory after wake for a fast next sleep (True, default) or return it (False)."""
    def reserve_host(self, nbytes: int, background: bool = False) -> None:
        """Acquire and pin `nbytes` of host backup memory for the first sleep: now, or (`background`) on a worker
        thread that the next sleep stops and takes over (it pins only what is still unpinned). CumemOutOfMemoryError
        when the host cannot give that much (a background worker stops at the limit and records a warning)."""
    def pin_ahead_status(self) -> PinAheadStatus:
        """The background pinning worker: running, pinned so far, its target (`cumem_rs.results.PinAheadStatus`)."""
    def backup_bytes_of(self, tags: Union[str, Sequence[str]]) -> int:
        """Bytes of host arena a sleep offloading `tags` would need now: their awake allocations, less tags whose
        policy is not to back up and allocations with a retained backup (what to pin ahead for them)."""
    def stop_pinning_ahead(self) -> None:
        """Stop background pinning; what it pinned stays cached for the next sleep."""
    def set_pin_chunk(self, nbytes: int) -> None:
        """Cell size (rounded up to whole pages; default 512 MiB) in which a cold sleep pins host memory while
        the first cells already copy. ValueError when not positive or too large to round."""
    def trim_host(self) -> int:
        """Drop retained backups and return cached, unused host backup memory to the OS; returns bytes released."""
    def set_retain_backups(self, on: bool) -> None:
        """Keep a backup bound to its allocation after the wake that restored it, so the next sleep copies only the
        chunks whose GPU fingerprint changed (default on; env CUMEM_RS_RETAIN_BACKUPS=0). False drops them all."""
    def retains_backups(self) -> bool:
        """Whether wakes keep backups now: policy on, host memory kept, fingerprint kernel available."""
    def set_verify_wakes(self, on: bool) -> None:
        """Compare what every wake restores with the fingerprints its sleep took, at every tier (default on; env
        CUMEM_RS_VERIFY_WAKE=0 starts it off). A mismatch fails the wake like a failed copy. Sleeps take those
        fingerprints while it is on (or backups are retained); a backup made by a sleep that took none wakes
        unverified."""
    def verifies_wakes(self) -> bool:
        """The setting of `set_verify_wakes`."""
    def set_fingerprint_chunk(self, nbytes: int) -> None:
        """Bytes per fingerprinted chunk (positive multiple of 16; default 2 MiB). A change drops retained backups."""
    def set_wake_group_bytes(self, nbytes: int) -> None:
        """Largest run of neighbouring allocations of one tag that a wake maps on one shared physical handle
        (default 32 MiB; env CUMEM_RS_WAKE_GROUP_BYTES, K/M/G suffixes). Fewer driver calls at thousands of small
        allocations; the memory of a member freed while its neighbours live comes back when the last of them is
        freed or sleeps (`stats()["unreturned_bytes"]`). 0: every allocation on its own handle."""
    @property
    def wake_group_bytes(self) -> int:
        """The current wake-group limit in bytes (see `set_wake_group_bytes`)."""
    def fingerprints(self, address: int, length: int) -> list[tuple[int, int]]:
        """Driver-computed 128-bit fingerprints (lo, hi) of [address, address+length), one per chunk."""
    def errors(self) -> list[str]:
        """Errors recorded by calls that could not raise (my_free), oldest first."""
    def inject_fault(self, op: str, nth: int = 1, error: str = "unknown") -> None:
        """Simulated driver only: the `nth` next call of `op` fails with `error` (see FAULT_OPS, FAULT_ERRORS).
        "thread_spawn" is the allocator starting a worker thread: when it fails, the work runs on the calling
        thread and the failure is recorded in `errors()`."""
    def inject_panic(self, op: str, nth: int = 1) -> None:
        """Simulated driver only, a test hook: the `nth` next call of `op` panics inside the driver. The panic
        surfaces as CumemError, and the allocator refuses later calls (see CumemError)."""
    def clear_faults(self) -> None: ...
    def driver_counts(self) -> DriverCounts:
        """Simulated driver only: live ranges, handles, host registrations, mapped bytes, per-op call counts."""
    def close(self) -> None:
        """Free every allocation and host buffer. Later calls raise ClosedError. Idempotent."""
    # -- tag policies, pause/resume, status --
    def set_tag_policy(
        self,
        tag: str,
        backup: Optional[bool] = None,
        wake_fill: Literal["undefined", "zero"] = "undefined",
        backup_tier: Literal["host", "file", "auto"] = "auto",
        compress: Literal["auto", "off", "bits16", "bits8", "bytes"] = "auto",
    ) -> None:
        """Set the whole policy of `tag` (the defaults clear it). `backup`: whether a release that does not say
        backs the tag up: `pause` always follows it (None: back up), `sleep(None)` too (None: only "default"),
        an explicit `sleep(offload_tags)` decides itself. `wake_fill="zero"`: memory of the tag that wakes
        without a backup comes back zeroed (device memset under the wake's copies). `backup_tier`: where its
        backups go: "host" (pinned host memory, refused past the host budget), "file" (the spill directory;
        refused without one) or "auto" (host memory up to the budget, files for the rest). `compress`: whether
        its host backups are compressed where the driver has a codec: "auto" (the 16-bit mode, for bf16/fp16),
        "off", "bits16", "bits8" (fp8) or "bytes" (any data); file backups of such a tag are compressed too (their
        blobs in the spill file)."""
    def tag_policy(self, tag: str) -> TagPolicy:
        """The policy of `tag` as set (`cumem_rs.results.TagPolicy`)."""
    def pause(self, tags: Optional[Union[str, Sequence[str]]] = None) -> Report:
        """Release the awake allocations of `tags` (None: every tag), backed up per their policy (unset: backed
        up). Other tags keep their memory; only the devices holding paused allocations are synchronized.
        Pausing a paused tag is a no-op. Returns a report like sleep's."""
    def resume(self, tags: Optional[Union[str, Sequence[str]]] = None) -> Report:
        """Wake the asleep allocations of `tags` (None: every tag), all or nothing, like wake_up; resuming an
        awake tag is a no-op."""
    def status(self) -> Status:
        """Whether anything sleeps, and per tag with an allocation or a policy its bytes, policy and state (a tag
        without allocations is "awake"): `cumem_rs.results.Status`."""
    def read_backup(self, address: int, size: int) -> Optional[bytes]:
        """The backed-up bytes [address, address+size) of an asleep allocation; None while it is awake. Raises
        CumemError for an asleep allocation without backup, ValueError outside every allocation."""
    def view_backup(self, address: int, size: int, writable: Optional[bool] = None) -> Optional[HostBytes]:
        """The backed-up bytes [address, address+size) where they lie, when the backup (of an asleep allocation, or
        retained by an awake one) is raw host memory; None otherwise (no backup, compressed, in a file: read_backup
        copies those). The bytes stay mapped as long as the `HostBytes` lives, whatever happens to the backup.
        `writable` (default True): the caller may write through it, which makes the next sleep of the allocation
        copy it whole, and a write into an asleep backup is restored as written (that wake does not verify it
        against the sleep's fingerprints); False promises to only read. ValueError outside every allocation."""
    def keep_host_memory(self) -> bool:
        """The setting of `set_keep_host_memory`."""
