//! Sleep and discard: back up what is offloaded, release the physical memory, keep the addresses.

use std::sync::Arc;
use std::time::Instant;

use super::{tag_set, Engine, Inner, Report};
use crate::driver::DevPtr;
use crate::error::Result;
use crate::host::HostBuffer;
use crate::registry::{Allocation, Backup, State};
use crate::transfer;

impl Engine {
    /// Back up awake allocations whose tag is in `offload_tags`, then release the physical memory of every awake
    /// allocation. Allocations already asleep keep their state and backup.
    ///
    /// Order: synchronize; fingerprint the allocations with a retained backup; queue every other backup copy
    /// (pinning a cold arena cell by cell meanwhile); queue the copies of changed chunks into retained backups;
    /// release the allocations that need no backup while those copies run; then, cell by cell as the copies
    /// finish, release the backed-up allocations. An allocation is released only once its whole backup is known to be on the
    /// host, so after any failure each offloaded allocation is either awake with its data or asleep with a
    /// complete backup. Allocations of other tags are released without backup as asked, failure or not.
    pub fn sleep<S: AsRef<str>>(&self, offload_tags: &[S]) -> Result<Report> {
        let start = Instant::now();
        let offload = tag_set(offload_tags);
        let mut inner = self.lock_open()?;
        self.retry_pending(&mut inner);
        let targets = inner.reg.select(Allocation::is_awake);
        if targets.is_empty() {
            return Ok(Report::default());
        }
        self.synchronize_devices(&inner, &targets)?;
        let (mut backed, bare): (Vec<DevPtr>, Vec<DevPtr>) = targets
            .iter()
            .partition(|a| offload.contains(&*inner.reg.get(**a).expect("selected").tag));
        let mut report = Report::default();
        // Not offloaded this time: a retained backup of these would go stale.
        Self::drop_retained(&mut inner, &bare);
        let retained = Self::split_retained(&inner, &mut backed);

        // 1. The host arena for the backups made now (the only step that may still return early: nothing is
        //    queued yet).
        let (jobs, total) = transfer::layout(backed.iter().map(|a| {
            let a = inner.reg.get(*a).expect("selected");
            (a.device, a.addr, a.size)
        }));
        let mut cold = false;
        let mut buf = None;
        if total > 0 {
            inner.largest_backup = inner.largest_backup.max(total);
            buf = Some(match inner.host.take_cached(total) {
                Some(buf) => buf,
                None => {
                    cold = true;
                    inner.host.trim()?;
                    HostBuffer::map_unpinned(&self.driver, total)?
                }
            });
        }

        // 2. Fingerprint every offloaded allocation, first on the copy streams so that the result does not wait
        //    for the copies: the retained ones to find their changed chunks, all to let the next sleep skip.
        let mut prints = self.begin_sleep_prints(&mut inner, retained, &backed);

        // 3. Queue the backup copies (pinning a cold arena cell by cell meanwhile).
        let mut arena = None;
        // After `arena`, so that it is dropped (waiting for every queued copy) first, panics included.
        let mut issued = None;
        let mut first_err = None;
        if let Some(mut buf) = buf {
            let mut absorbed = Vec::new();
            let (cells, result) = transfer::issue_copy_out(
                &*self.driver,
                &mut buf,
                &jobs,
                inner.pin_chunk,
                &mut absorbed,
            );
            for e in absorbed {
                Self::record(
                    &mut inner,
                    "pinning host backup memory (copying through pageable memory)",
                    &e,
                );
            }
            for e in std::mem::take(&mut buf.notes) {
                Self::record(&mut inner, super::THREAD_REFUSED, &e);
            }
            if let Err(e) = result {
                first_err = Some(e);
            }
            issued = Some(cells);
            let buf = Arc::new(buf);
            inner.arenas.push(buf.clone());
            arena = Some(buf);
        }

        // 4. Compare the fingerprints; queue the copies of changed chunks into the retained backups.
        let changed_queued = self.issue_changed_chunks(&mut inner, &mut prints, &mut report);
        let changed_ok = changed_queued.is_ok();
        if let Err(e) = changed_queued {
            first_err.get_or_insert(e);
        }

        // 5. While the copies run, release what needs no backup.
        for addr in bare {
            if let Err(e) = self.release_to_sleep(&mut inner, addr, None, &mut report) {
                first_err.get_or_insert(e);
            }
        }

        // 6. As cells finish, release the allocations whose backup is complete. `missing` counts each job's
        //    cells on the whole grid, so a job with a cell that was never queued (after an error) stays awake.
        let cell_size = inner.pin_chunk;
        let mut missing: Vec<usize> = jobs
            .iter()
            .map(|j| (j.offset + j.size - 1) / cell_size - j.offset / cell_size + 1)
            .collect();
        let mut copies_ok = true;
        while let Some((cell_jobs, waited)) =
            issued.as_mut().and_then(transfer::InFlight::next_cell)
        {
            if let Err(e) = waited {
                copies_ok = false; // release nothing more, but wait for every cell
                first_err.get_or_insert(e);
            }
            for j in cell_jobs {
                missing[j] -= 1;
                if missing[j] == 0 && copies_ok {
                    let backup = Backup {
                        arena: arena.clone().expect("jobs imply an arena"),
                        offset: jobs[j].offset,
                    };
                    match self.release_to_sleep(&mut inner, jobs[j].addr, Some(backup), &mut report)
                    {
                        Ok(()) => report.copied_bytes += jobs[j].size,
                        Err(e) => {
                            first_err.get_or_insert(e);
                        }
                    }
                }
            }
        }
        drop(issued); // after a failure: waits for the copy streams too
                      // 7. Once their changed chunks are on the host, release the allocations with a retained backup.
        self.finish_sleep_prints(&mut inner, prints, changed_ok, &mut report, &mut first_err);
        drop(arena);
        self.collect_unused_arenas(&mut inner);
        report.seconds = start.elapsed().as_secs_f64();
        log::debug!(
            "engine sleep: {} allocations, {} bytes backed up ({}), {} bytes released without backup, {:.3} s",
            report.allocations,
            report.copied_bytes,
            if cold { "cold: arena pinned during the copies" } else { "steady: cached arena" },
            report.discarded_bytes,
            report.seconds
        );
        inner.stats.sleeps += 1;
        inner.stats.last_sleep = Some(report.clone());
        first_err.map_or(Ok(report), Err)
    }

    /// Unmap and release one awake allocation and mark it asleep with `backup`. A failed unmap leaves it awake.
    pub(super) fn release_to_sleep(
        &self,
        inner: &mut Inner,
        addr: DevPtr,
        backup: Option<Backup>,
        report: &mut Report,
    ) -> Result<()> {
        let a = inner.reg.get(addr).expect("selected");
        let State::Awake { handle } = a.state else {
            unreachable!("selected awake")
        };
        let size = a.size;
        self.unmap_release(inner, addr, size, handle)?;
        if backup.is_none() {
            report.discarded_bytes += size;
        }
        report.allocations += 1;
        inner.reg.set_state(addr, State::Asleep { backup });
        Ok(())
    }
    /// Release awake allocations whose tag is in `tags`, without backup. Other tags are untouched.
    pub fn discard<S: AsRef<str>>(&self, tags: &[S]) -> Result<Report> {
        let start = Instant::now();
        let wanted = tag_set(tags);
        let mut inner = self.lock_open()?;
        self.retry_pending(&mut inner);
        let targets = inner
            .reg
            .select(|a| a.is_awake() && wanted.contains(&*a.tag));
        if targets.is_empty() {
            return Ok(Report::default());
        }
        self.synchronize_devices(&inner, &targets)?;
        let mut report = Report::default();
        let mut first_err = None;
        for addr in targets {
            let a = inner.reg.get(addr).expect("selected").clone();
            let State::Awake { handle } = a.state else {
                unreachable!("selected awake")
            };
            match self.unmap_release(&mut inner, a.addr, a.size, handle) {
                Ok(()) => {
                    inner.reg.set_state(addr, State::Asleep { backup: None });
                    Self::drop_retained(&mut inner, &[addr]);
                    report.allocations += 1;
                    report.discarded_bytes += a.size;
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.collect_unused_arenas(&mut inner);
        report.seconds = start.elapsed().as_secs_f64();
        first_err.map_or(Ok(report), Err)
    }
}
