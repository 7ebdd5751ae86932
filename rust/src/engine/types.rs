//! What the engine reports to callers: per-call reports, allocation listings, statistics, per-tag status.

use std::collections::BTreeMap;

use super::policy::TagPolicy;
use crate::driver::DevPtr;

/// What one sleep, wake or discard did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    pub allocations: usize,
    /// Bytes copied to host (sleep) or back to the device (wake).
    pub copied_bytes: usize,
    /// Bytes released without backup (sleep, discard) or woken without contents (wake).
    pub discarded_bytes: usize,
    /// Of the bytes woken without contents, those zero-filled per their tag's policy (wake only).
    pub zeroed_bytes: usize,
    /// Sleep: bytes of retained backups not copied because their chunk fingerprints did not change.
    pub skipped_bytes: usize,
    /// Sleep: chunks of retained backups whose fingerprints were compared.
    pub chunks_checked: usize,
    /// Sleep: seconds spent on fingerprints: queueing them, waiting for them (what did not overlap other
    /// work), comparing them and queueing the changed chunks' copies.
    pub fingerprint_seconds: f64,
    /// Bytes written to spill files (sleep) or read from them (wake), rounded up to whole I/O blocks on sleep.
    pub written_bytes: usize,
    pub read_bytes: usize,
    /// Seconds of the file tier's pipeline (its rate: written or read bytes over these).
    pub file_seconds: f64,
    /// Wake: of `file_seconds`, those the pipeline waited for file reads (the disk's share), and those it spent
    /// queueing the staging ring's copies to the device and waiting for them before a slot could take the next
    /// read.
    pub file_read_wait_seconds: f64,
    pub file_copy_seconds: f64,
    /// Wake: seconds spent giving back what the restored backups held once the wake succeeded (host arenas; a
    /// spill file whose last backup went is handed to the reclaim thread, which closes it after the call).
    pub release_seconds: f64,
    /// Compressed backups this call made (sleep) or restored (wake): their raw bytes, and the host bytes their
    /// blobs take (`stored_bytes / raw_bytes` is the ratio). Raw backups count in neither.
    pub raw_bytes: usize,
    pub stored_bytes: usize,
    /// Wake: bytes restored and found equal to the fingerprints their sleep took (every tier; 0 with
    /// `CUMEM_RS_VERIFY_WAKE=0`, and not counting backups without prints or written through a view).
    pub verified_bytes: usize,
    pub seconds: f64,
}

/// One live allocation as seen from outside.
#[derive(Debug, Clone, PartialEq)]
pub struct AllocationInfo {
    pub addr: DevPtr,
    pub size: usize,
    pub requested: usize,
    pub device: i32,
    pub tag: String,
    pub asleep: bool,
    pub backed_up: bool,
}

#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub live_allocations: usize,
    pub asleep_allocations: usize,
    pub mapped_bytes: usize,
    pub asleep_bytes: usize,
    pub peak_mapped_bytes: usize,
    pub host_backup_bytes: usize,
    pub host_cached_bytes: usize,
    /// Host bytes of backups kept bound to awake allocations (retained backups).
    pub host_retained_bytes: usize,
    /// Bytes of the backups of asleep allocations per tier (raw: the allocations' bytes): pinned host memory,
    /// spill files.
    pub host_tier_bytes: usize,
    pub file_tier_bytes: usize,
    /// The host bytes the host tier's backups take as stored (compressed ones count their blobs).
    pub host_tier_stored_bytes: usize,
    /// The file bytes the file tier's backups take (compressed ones count their blobs, padded to I/O blocks).
    pub file_tier_stored_bytes: usize,
    /// The compressed ones among them: their host bytes, their raw bytes, and the ratio (stored / raw; 1.0
    /// with none).
    pub compressed_bytes: usize,
    pub compressed_raw_bytes: usize,
    pub compression_ratio: f64,
    /// The codec sleeps compress with (`DeviceCodec::describe`); None: backups are raw (no codec, or off).
    pub codec: Option<String>,
    /// Pinned bytes of the file tier's staging ring (outside the host budget; 0 until the file tier is used).
    pub staging_bytes: usize,
    pub retained_allocations: usize,
    pub mallocs: u64,
    pub frees: u64,
    pub sleeps: u64,
    pub wakes: u64,
    pub recorded_errors: u64,
    pub pending_releases: usize,
    /// Wake groups alive (runs of neighbours woken on one shared handle, `group.rs`).
    pub wake_groups: usize,
    /// Bytes of freed allocations whose memory a wake group still holds for its live members (returned when the
    /// last member is freed or the group sleeps).
    pub unreturned_bytes: usize,
    /// Device memory the driver took for the allocator itself (kernels and their buffers), on every device: taken
    /// when a device is first used, never inside a sleep.
    pub own_device_bytes: usize,
    pub last_sleep: Option<Report>,
    pub last_wake: Option<Report>,
}

/// What the engine counts as calls go by (the rest of `Stats` is read off the components when asked).
#[derive(Debug, Clone, Default)]
pub struct Counters {
    pub mallocs: u64,
    pub frees: u64,
    pub sleeps: u64,
    pub wakes: u64,
    pub peak_mapped_bytes: usize,
    pub last_sleep: Option<Report>,
    pub last_wake: Option<Report>,
}

/// One tag as seen by `status`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TagStatus {
    pub allocations: usize,
    /// Bytes of its awake allocations (physically mapped).
    pub mapped_bytes: usize,
    /// Bytes of its asleep allocations (address range kept, no physical memory).
    pub asleep_bytes: usize,
    /// Host backup bytes held for its allocations: the backups of asleep ones plus `retained_bytes`.
    pub backup_bytes: usize,
    /// Host bytes of retained backups, kept bound to awake allocations after the wake that restored them.
    pub retained_bytes: usize,
    /// Of `backup_bytes`, those in spill files (the file tier); the rest are in host memory.
    pub file_bytes: usize,
    pub policy: TagPolicy,
}

impl TagStatus {
    /// "awake" (nothing asleep, also when it has no allocations), "asleep" (nothing awake) or "mixed".
    pub fn state(&self) -> &'static str {
        match (self.mapped_bytes > 0, self.asleep_bytes > 0) {
            (_, false) => "awake",
            (false, true) => "asleep",
            (true, true) => "mixed",
        }
    }
}

/// Every tag with an allocation or a policy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Status {
    pub tags: BTreeMap<String, TagStatus>,
    /// True while any allocation is asleep.
    pub is_sleeping: bool,
}
