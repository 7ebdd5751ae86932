"""The types of the dicts `cumem_rs.Allocator` returns: one `TypedDict` per kind, used by `_native.pyi`.

They exist at run time too, so callers can annotate with them (`def log(r: cumem_rs.results.Report)`) and tests can
compare them with what a real call returns (`tests/test_results.py`: the keys the extension builds, in
`rust/src/python/results.rs`, must be exactly these).
"""

from __future__ import annotations

from typing import Literal, Optional, TypedDict

__all__ = [
    "AllocationRecord",
    "DeviceInfo",
    "DriverCounts",
    "Info",
    "PinAheadStatus",
    "Report",
    "Stats",
    "Status",
    "TagPolicy",
    "TagStatus",
    "BackupTier",
    "Compress",
    "WakeFill",
]

WakeFill = Literal["undefined", "zero"]
#: Where a tag's backups go: pinned host memory, the spill directory, or host up to the budget then files.
BackupTier = Literal["host", "file", "auto"]
#: Whether and how a tag's host backups are compressed ("auto": the 16-bit mode; see docs/compression.md).
Compress = Literal["auto", "off", "bits16", "bits8", "bytes"]


class Report(TypedDict):
    """What one `sleep`, `wake_up`, `discard`, `pause` or `resume` did. Sizes are the allocations' rounded (mapped)
    sizes; bytes backed up by a sleep = `copied_bytes` + `skipped_bytes`."""

    #: Allocations the call released (sleep, discard, pause) or mapped again (wake, resume).
    allocations: int
    #: Bytes copied to host (sleep) or back to the device (wake).
    copied_bytes: int
    #: Bytes released without backup (sleep, discard) or woken without contents (wake).
    discarded_bytes: int
    #: Of the bytes woken without contents, those zero-filled per their tag's `wake_fill` (wake only).
    zeroed_bytes: int
    #: Bytes of retained backups not copied because their chunks did not change since the wake (sleep only).
    skipped_bytes: int
    #: Chunks of retained backups whose fingerprints were compared (sleep only).
    chunks_checked: int
    fingerprint_seconds: float
    #: Bytes written to spill files (sleep, whole I/O blocks) or read from them (wake).
    written_bytes: int
    read_bytes: int
    #: Seconds of the file tier's pipeline, and its rate ((written or read bytes) / file_seconds / 1e9).
    file_seconds: float
    file_gb_per_s: float
    #: Wake: of file_seconds, those its pipeline waited for file reads (the disk's share) and those it spent on the
    #: staging ring's copies to the device, queueing and waiting for them (0.0 on sleep and without files).
    file_read_wait_seconds: float
    file_copy_seconds: float
    #: Wake: seconds spent giving back what the restored backups held (host arenas; a spill file whose last backup
    #: went is handed to a background thread, which closes it after the call) after the wake succeeded.
    release_seconds: float
    #: Compressed backups the call made (sleep) or restored (wake): their raw bytes and the host bytes their
    #: blobs take (stored_bytes / raw_bytes is the ratio); raw backups count in neither.
    raw_bytes: int
    stored_bytes: int
    #: Wake: bytes restored and found equal to the fingerprints their sleep took, at every tier (0 on sleep and
    #: with CUMEM_RS_VERIFY_WAKE=0; backups without prints, or written through a writable view, are not counted).
    verified_bytes: int
    seconds: float
    #: copied_bytes / seconds / 1e9 (0.0 when nothing took time).
    gb_per_s: float


class AllocationRecord(TypedDict):
    """One live allocation, as listed by `allocations()`."""

    address: int
    #: Mapped size: the request rounded up to the granularity.
    size: int
    requested: int
    device: int
    tag: str
    asleep: bool
    #: Asleep with a host backup (restored by the next wake).
    backed_up: bool


class Stats(TypedDict):
    """The counters of `stats()`."""

    live_allocations: int
    asleep_allocations: int
    mapped_bytes: int
    asleep_bytes: int
    peak_mapped_bytes: int
    host_backup_bytes: int
    host_cached_bytes: int
    host_retained_bytes: int
    #: Bytes of the backups of asleep allocations per tier (raw: the allocations' bytes).
    host_tier_bytes: int
    file_tier_bytes: int
    #: Host bytes the host tier's backups take as stored (compressed ones count their blobs).
    host_tier_stored_bytes: int
    #: File bytes the file tier's backups take (compressed ones count their blobs, padded to I/O blocks).
    file_tier_stored_bytes: int
    #: The compressed backups of asleep allocations: host bytes, raw bytes, their ratio (1.0 with none).
    compressed_bytes: int
    compressed_raw_bytes: int
    compression_ratio: float
    #: The codec sleeps compress with; None: backups are raw (no codec, CUMEM_RS_COMPRESS=0).
    codec: Optional[str]
    #: Pinned bytes of the file tier's staging ring (outside the host budget).
    staging_bytes: int
    retained_allocations: int
    mallocs: int
    frees: int
    sleeps: int
    wakes: int
    recorded_errors: int
    pending_releases: int
    wake_groups: int
    unreturned_bytes: int
    #: Device memory the allocator took for itself (its kernels and their buffers): taken when a device is first
    #: used, before its first allocation, never inside a sleep (0 on the simulated device).
    own_device_bytes: int
    #: Preload hook mode, process-wide: calls of the CUDA runtime's other allocators (cudaMallocAsync,
    #: cudaFreeAsync, cudaMallocManaged) made where a cudaMalloc would have been routed (a region, or
    #: TMS_INIT_ENABLE=1), and the bytes they allocated: forwarded to the runtime, so never paused.
    preload_unrouted_calls: int
    preload_unrouted_bytes: int
    last_sleep: Optional[Report]
    last_wake: Optional[Report]


class PinAheadStatus(TypedDict):
    """The background pinning worker (`pin_ahead_status()`): all false/0 when there is none."""

    running: bool
    #: Bytes pinned so far.
    pinned: int
    #: Bytes the worker pins in all.
    nbytes: int


class _TagPolicyKeys(TypedDict):
    backup: Optional[bool]
    wake_fill: WakeFill


class TagPolicy(_TagPolicyKeys, total=False):
    """The policy of one tag (`tag_policy()`); `backup_tier` and `compress` only when not the default "auto"."""

    backup_tier: BackupTier
    compress: Compress


class _TagStatusKeys(TypedDict):

    allocations: int
    mapped_bytes: int
    asleep_bytes: int
    #: Backups of asleep allocations plus retained ones.
    backup_bytes: int
    #: Retained backups of awake allocations.
    retained_bytes: int
    backup: Optional[bool]
    wake_fill: WakeFill
    state: Literal["awake", "asleep", "mixed"]


class TagStatus(_TagStatusKeys, total=False):
    """One tag of `status()`: its allocations, bytes, policy and state; `backup_tier` only when not "auto", and
    `file_bytes` (of `backup_bytes`, those in spill files) only when some are."""

    backup_tier: BackupTier
    compress: Compress
    file_bytes: int


class Status(TypedDict):
    """`status()`: every tag with an allocation or a policy."""

    is_sleeping: bool
    tags: dict[str, TagStatus]


class DriverCounts(TypedDict):
    """What the simulated driver holds (`driver_counts()`, simulated driver only)."""

    ranges: int
    handles: int
    mapped_bytes: int
    #: Physical bytes in use, per device.
    used_bytes: list[int]
    host_registered: int
    host_allocated: int
    #: Host bytes pinned now (registered plus allocated), and the most pinned at once so far.
    host_pinned_bytes: int
    host_peak_pinned_bytes: int
    markers: int
    fingerprint_batches: int
    #: The host codec: ranges compressed (of them stored raw, not shrinking), ranges restored.
    codec_compressed: int
    codec_stored_raw: int
    codec_decompressed: int
    #: Calls so far, per operation name (see FAULT_OPS).
    calls: dict[str, int]


class DeviceInfo(TypedDict):
    """One device of `info()`."""

    device: int
    name: str
    free: int
    total: int
    granularity: int
    rdma_with_vmm: bool


class _InfoKeys(TypedDict):
    backend: str
    devices: list[DeviceInfo]
    #: The codec sleeps compress with (None: backups are raw).
    codec: Optional[str]


class Info(_InfoKeys, total=False):
    """`info()`: the backend and its devices; `driver_version` on CUDA only."""

    driver_version: int
