//! What callers can ask: usage, the allocation list, statistics, per-tag status, the bytes of a backup; and the
//! tag policies they set. Each answer is read off the components under the lock.

use std::collections::BTreeMap;

use super::{
    tag_set, AllocationInfo, BackupTier, Engine, Inner, Stats, Status, TagPolicy, TagStatus,
};
use crate::backups::HostView;
use crate::driver::{DevPtr, HostPtr};
use crate::error::{Error, Result};
use crate::registry::{Allocation, State};

impl Inner {
    fn info_of(&self, a: &Allocation) -> AllocationInfo {
        AllocationInfo {
            addr: a.addr,
            size: a.size,
            requested: a.requested,
            device: a.device,
            tag: a.tag.to_string(),
            asleep: !a.is_awake(),
            backed_up: self.backups.backup_of(a.addr).is_some(),
        }
    }
}

impl Engine {
    pub fn usage(&self, device: Option<i32>) -> Result<usize> {
        Ok(self.lock_open()?.reg.mapped_bytes(device))
    }

    pub fn allocations(&self) -> Result<Vec<AllocationInfo>> {
        let inner = self.lock_open()?;
        Ok(inner.reg.iter().map(|a| inner.info_of(a)).collect())
    }

    /// The live allocation that starts at `addr`, if any (one lookup, not a scan: `pointer_to_data[ptr]`).
    pub fn allocation(&self, addr: DevPtr) -> Result<Option<AllocationInfo>> {
        let inner = self.lock_open()?;
        Ok(inner.reg.get(addr).map(|a| inner.info_of(a)))
    }

    /// Counters and sizes; answers on a closed or poisoned engine too (diagnostics).
    pub fn stats(&self) -> Stats {
        let mut locked = self.inner.lock();
        let inner = &mut *locked;
        inner.backups.collect_finished_pin_ahead(&mut inner.log);
        let c = &inner.counters;
        let asleep = || inner.reg.iter().filter(|a| !a.is_awake());
        let compressed = inner.backups.compressed_asleep();
        Stats {
            live_allocations: inner.reg.len(),
            asleep_allocations: asleep().count(),
            mapped_bytes: inner.reg.mapped_bytes(None),
            asleep_bytes: asleep().map(|a| a.size).sum(),
            peak_mapped_bytes: c.peak_mapped_bytes,
            host_backup_bytes: inner.backups.arena_bytes(),
            host_cached_bytes: inner.backups.cached_bytes(),
            host_retained_bytes: inner.backups.retained_bytes(),
            host_tier_bytes: inner.backups.asleep_raw_bytes(),
            file_tier_bytes: inner.backups.file_bytes(),
            host_tier_stored_bytes: inner.backups.asleep_bytes(),
            file_tier_stored_bytes: inner.backups.file_stored_bytes(),
            compressed_bytes: compressed.0,
            compressed_raw_bytes: compressed.1,
            compression_ratio: match compressed {
                (_, 0) => 1.0,
                (s, r) => s as f64 / r as f64,
            },
            codec: inner.backups.codec_description(),
            staging_bytes: inner.backups.staging_held(),
            retained_allocations: inner.backups.retained_count(),
            mallocs: c.mallocs,
            frees: c.frees,
            sleeps: c.sleeps,
            wakes: c.wakes,
            recorded_errors: inner.log.recorded(),
            pending_releases: inner.pending.len(),
            wake_groups: inner.groups.len(),
            unreturned_bytes: inner.groups.unreturned(),
            own_device_bytes: (0..self.device_count() as i32)
                .map(|d| self.driver.own_device_bytes(d))
                .sum(),
            last_sleep: c.last_sleep.clone(),
            last_wake: c.last_wake.clone(),
        }
    }

    /// Host backup bytes held: arenas in use by asleep allocations plus cached ones.
    pub fn host_bytes(&self) -> usize {
        let mut locked = self.inner.lock();
        let inner = &mut *locked;
        inner.backups.collect_finished_pin_ahead(&mut inner.log);
        inner.backups.held()
    }

    /// Per tag: allocations, mapped, asleep, backed-up and retained bytes, policy and state; plus whether anything
    /// sleeps.
    pub fn status(&self) -> Result<Status> {
        let inner = self.lock_open()?;
        let mut tags: BTreeMap<String, TagStatus> = BTreeMap::new();
        for a in inner.reg.iter() {
            let t = tags.entry(a.tag.to_string()).or_default();
            t.allocations += 1;
            match a.state {
                State::Awake { .. } => {
                    t.mapped_bytes += a.size;
                    if inner.backups.is_retained(a.addr) {
                        t.retained_bytes += a.size;
                        t.backup_bytes += a.size;
                    }
                }
                State::Asleep => {
                    t.asleep_bytes += a.size;
                    if let Some(b) = inner.backups.backup_of(a.addr) {
                        t.backup_bytes += a.size;
                        if !b.in_host() {
                            t.file_bytes += a.size;
                        }
                    }
                }
            }
        }
        for tag in inner.policies.tags() {
            tags.entry(tag.to_string()).or_default();
        }
        for (tag, t) in tags.iter_mut() {
            t.policy = inner.policies.get(tag);
        }
        let is_sleeping = tags.values().any(|t| t.asleep_bytes > 0);
        Ok(Status { tags, is_sleeping })
    }

    /// The backed-up contents of [addr, addr+len) while its allocation is asleep with a backup; None while it is
    /// awake. An asleep allocation without a backup is an error (there is nothing to read).
    pub fn read_backup(&self, addr: DevPtr, len: usize) -> Result<Option<Vec<u8>>> {
        let inner = self.lock_open()?;
        let a = inner.reg.containing(addr, len.max(1)).ok_or_else(|| {
            Error::invalid(format!(
                "[{addr:#x}, +{len}) is not inside one live allocation"
            ))
        })?;
        if a.is_awake() {
            return Ok(None);
        }
        let backup = inner.backups.backup_of(a.addr).ok_or_else(|| {
            Error::InvalidState(format!(
                "allocation {:#x} (tag {:?}) is asleep without a backup: its contents were released",
                a.addr, a.tag
            ))
        })?;
        let mut out = vec![0u8; len];
        backup.read_at((addr - a.addr) as usize, &mut out)?;
        Ok(Some(out))
    }

    /// A view of the backed-up bytes [addr, addr+len) where they lie, when its allocation's backup (asleep, or
    /// retained by an awake one) is raw bytes in host memory; None otherwise (no backup, compressed, in a file:
    /// `read_backup` copies those). The view keeps its bytes mapped as long as it lives; `writable`: whether the
    /// caller may write through it (backups/view.rs).
    pub fn view_backup(
        &self,
        addr: DevPtr,
        len: usize,
        writable: bool,
    ) -> Result<Option<HostView>> {
        let mut inner = self.lock_open()?;
        let a = inner.reg.containing(addr, len.max(1)).ok_or_else(|| {
            Error::invalid(format!(
                "[{addr:#x}, +{len}) is not inside one live allocation"
            ))
        })?;
        let (base, at) = (a.addr, (addr - a.addr) as usize);
        let view = inner.backups.view(base, at, len, writable);
        if let Some(v) = &view {
            self.driver
                .user_host_access(HostPtr(v.address()), v.len(), writable)?;
        }
        Ok(view)
    }

    /// Bytes of the arena a sleep offloading `tags` would need now: their awake allocations, except those of
    /// tags whose policy is not to back up or backs up to files, and those with a retained backup (which need no
    /// new arena); those of tags that compress count what they are estimated to take stored (the ratio of the
    /// last compressed sleep). What to pin ahead when the allocations of those tags have been made.
    pub fn backup_bytes_of<S: AsRef<str>>(&self, tags: &[S]) -> Result<usize> {
        let wanted = tag_set(tags);
        let inner = self.lock_open()?;
        let compressing = inner.backups.compressing();
        let (mut raw, mut packed) = (0, 0);
        for a in (inner.reg.iter()).filter(|a| a.is_awake() && wanted.contains(&*a.tag)) {
            if inner.policies.pause_backup(&a.tag)
                && inner.policies.backup_tier(&a.tag) != BackupTier::File
                && !inner.backups.is_retained(a.addr)
            {
                // One the codec could not shrink goes raw (incompressible.rs).
                if compressing
                    && inner.policies.compress_kind(&a.tag).is_some()
                    && !inner.backups.would_skip_codec(a.addr)
                {
                    packed += a.size;
                } else {
                    raw += a.size;
                }
            }
        }
        Ok(raw + inner.backups.estimate_stored(packed))
    }

    // ----- policies ---------------------------------------------------------------------------------------

    /// Set the whole policy of `tag` (the default policy clears it).
    pub fn set_tag_policy(&self, tag: &str, policy: TagPolicy) -> Result<()> {
        if tag.is_empty() {
            return Err(Error::invalid("tag must be a non-empty string"));
        }
        self.lock_open()?.policies.set(tag, policy);
        Ok(())
    }

    pub fn tag_policy(&self, tag: &str) -> Result<TagPolicy> {
        Ok(self.lock_open()?.policies.get(tag))
    }
}
