//! Wake: map new physical memory at the same addresses and restore the backups; all or nothing.

use std::time::Instant;

use super::{tag_set, Engine, Inner, Report};
use crate::driver::{DevPtr, PhysHandle};
use crate::error::Result;
use crate::registry::{Backup, State};

impl Engine {
    /// Map new physical memory at the same addresses for asleep allocations whose tag is in `tags` (None: all),
    /// and copy their backups back. All or nothing.
    ///
    /// Order: map every backed-up allocation (all devices), queue all their copies (one stream per device, so
    /// devices copy in parallel), then map the allocations without backup while those copies run, and wait once
    /// per device. Interleaving maps with copies instead was measured to serialize two GPUs (0.61x of their
    /// aggregate copy bandwidth): maps on one device waited for the copies already queued.
    pub fn wake<S: AsRef<str>>(&self, tags: Option<&[S]>) -> Result<Report> {
        let start = Instant::now();
        let wanted = tags.map(tag_set);
        let mut inner = self.lock_open()?;
        self.retry_pending(&mut inner);
        let mut targets = inner
            .reg
            .select(|a| !a.is_awake() && wanted.as_ref().is_none_or(|w| w.contains(&*a.tag)));
        if targets.is_empty() {
            return Ok(Report::default());
        }
        targets.sort_by_key(|a| {
            !matches!(
                inner.reg.get(*a).expect("selected").state,
                State::Asleep { backup: Some(_) }
            )
        });

        let mut report = Report {
            allocations: targets.len(),
            ..Report::default()
        };
        let mut mapped: Vec<(DevPtr, PhysHandle)> = Vec::with_capacity(targets.len());
        let backed = targets
            .iter()
            .filter(|a| Self::backup_of(&inner, **a).is_some())
            .count();
        let result = (|| {
            for addr in &targets[..backed] {
                mapped.push((*addr, self.map_at(&mut inner, *addr)?));
            }
            for addr in &targets[..backed] {
                let a = inner.reg.get(*addr).expect("selected");
                let b = Self::backup_of(&inner, *addr).expect("sorted first");
                self.copy_back(a.device, a.addr, a.size, b)?;
                report.copied_bytes += a.size;
            }
            for addr in &targets[backed..] {
                mapped.push((*addr, self.map_at(&mut inner, *addr)?));
                report.discarded_bytes += inner.reg.get(*addr).expect("selected").size;
            }
            Ok(())
        })();
        // Wait even after a failure: no copy may still be writing when the rollback unmaps.
        let result = self.wait_devices(&inner, &targets, result);
        if let Err(e) = result {
            self.rollback_wake(&mut inner, &mapped);
            return Err(e);
        }
        let restored: Vec<(DevPtr, Backup)> = targets[..backed]
            .iter()
            .filter_map(|a| Self::backup_of(&inner, *a).map(|b| (*a, b.clone())))
            .collect();
        for (addr, handle) in mapped {
            inner.reg.set_state(addr, State::Awake { handle });
        }
        self.keep_restored_backups(&mut inner, restored);
        self.collect_unused_arenas(&mut inner);
        Self::note_peak(&mut inner);
        report.seconds = start.elapsed().as_secs_f64();
        log::debug!(
            "engine wake: {} allocations, {} bytes restored, {} bytes mapped without contents, {:.3} s",
            report.allocations,
            report.copied_bytes,
            report.discarded_bytes,
            report.seconds
        );
        inner.stats.wakes += 1;
        inner.stats.last_wake = Some(report.clone());
        Ok(report)
    }

    pub(super) fn backup_of(inner: &Inner, addr: DevPtr) -> Option<&Backup> {
        match &inner.reg.get(addr).expect("selected").state {
            State::Asleep { backup } => backup.as_ref(),
            State::Awake { .. } => None,
        }
    }

    /// Map new physical memory under one asleep allocation's range.
    pub(super) fn map_at(&self, inner: &mut Inner, addr: DevPtr) -> Result<PhysHandle> {
        let a = inner.reg.get(addr).expect("selected");
        let (device, size) = (a.device, a.size);
        self.map_new(inner, device, addr, size)
    }

    /// Queue the copy of one backup to its allocation, split at the arena's pinned pieces.
    pub(super) fn copy_back(
        &self,
        device: i32,
        addr: DevPtr,
        size: usize,
        b: &Backup,
    ) -> Result<()> {
        for (off, len) in b.arena.split_at_pieces(b.offset, size) {
            b.arena
                .queue_to_device(device, addr + (off - b.offset) as u64, off, len)?;
        }
        Ok(())
    }

    pub(super) fn rollback_wake(&self, inner: &mut Inner, mapped: &[(DevPtr, PhysHandle)]) {
        for &(addr, handle) in mapped {
            let size = inner.reg.get(addr).expect("selected").size;
            self.unmap_or_queue(inner, addr, size);
            self.release_or_queue(inner, handle);
        }
    }
}
