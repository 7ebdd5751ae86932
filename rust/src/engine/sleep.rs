//! Sleep and discard: back up what is offloaded, release the physical memory, keep the addresses.

use std::sync::Arc;
use std::time::Instant;

use super::{pin_ahead, tag_set, Engine, Inner, Report};
use crate::driver::DevPtr;
use crate::error::{Error, Result};
use crate::host::HostBuffer;
use crate::registry::{Allocation, Backing, Backup, State};
use crate::transfer;

impl Engine {
    /// Back up awake allocations whose tag is in `offload_tags`, then release the physical memory of every awake
    /// allocation. Allocations already asleep keep their state and backup.
    ///
    /// Order: synchronize; take the host arena (the last point that may fail with nothing queued); fingerprint
    /// every offloaded allocation; queue the backup copies of those without a retained backup (pinning a cold
    /// arena cell by cell meanwhile, or releasing finished cells as it goes into a pinned one); queue the copies
    /// of changed chunks into retained backups; release the allocations that need no backup while those copies
    /// run; then, as the copies finish, release the backed-up allocations. An allocation is released only once
    /// its whole backup is known to be on the host, so after any failure each offloaded allocation is either
    /// awake with its data or asleep with a complete backup. Allocations of other tags are released without
    /// backup as asked, failure or not.
    pub fn sleep<S: AsRef<str>>(&self, offload_tags: &[S]) -> Result<Report> {
        let start = Instant::now();
        let offload = tag_set(offload_tags);
        let mut inner = self.lock_open()?;
        self.retry_pending(&mut inner);
        let (backed, bare) = Self::split_awake(&inner, |_| true, |a| offload.contains(&*a.tag));
        self.sleep_targets(&mut inner, backed, bare, start)
    }

    /// The awake allocations for which `wanted` holds, split into those to back up (`backup` holds) and the rest.
    pub(super) fn split_awake(
        inner: &Inner,
        wanted: impl Fn(&Allocation) -> bool,
        backup: impl Fn(&Allocation) -> bool,
    ) -> (Vec<DevPtr>, Vec<DevPtr>) {
        let (mut backed, mut bare) = (Vec::new(), Vec::new());
        for a in inner.reg.iter().filter(|a| a.is_awake() && wanted(a)) {
            if backup(a) { &mut backed } else { &mut bare }.push(a.addr);
        }
        (backed, bare)
    }

    /// Back up `backed`, then release `backed` and `bare` (awake allocations): the body of `sleep`, shared with
    /// `pause` and `sleep_by_policy`, with the ordering and guarantees described at `sleep`.
    pub(super) fn sleep_targets(
        &self,
        inner: &mut Inner,
        mut backed: Vec<DevPtr>,
        bare: Vec<DevPtr>,
        start: Instant,
    ) -> Result<Report> {
        let targets: Vec<DevPtr> = backed.iter().chain(&bare).copied().collect();
        if targets.is_empty() {
            return Ok(Report::default());
        }
        self.synchronize_devices(inner, &targets)?;
        let mut report = Report::default();
        // Not offloaded this time: a retained backup of these would go stale.
        Self::drop_retained(inner, &bare);
        let retained = Self::split_retained(inner, &mut backed);

        // 1. The host arena for the backups made now (the only step that may still return early: nothing is
        //    queued yet).
        let (mut jobs, total) = transfer::layout(backed.iter().map(|a| {
            let a = inner.reg.get(*a).expect("selected");
            (a.device, a.addr, a.size)
        }));
        for i in 1..jobs.len() {
            let prev = jobs[i - 1];
            jobs[i].joins_previous = inner.vas.continues(prev.addr, prev.size, jobs[i].addr);
        }
        let mut cold = false;
        let mut buf = None;
        if total > 0 {
            inner.largest_backup = inner.largest_backup.max(total);
            // A buffer pinned ahead (whole or in part) is cached from here on.
            self.stop_pin_ahead(inner);
            let cached = inner.host.take_cached(total);
            if cached.is_none() {
                inner.host.trim()?;
            }
            // The host guard: what is still to pin must fit in what the host can give.
            let to_pin = cached.as_ref().map_or(total, |b| b.unpinned_below(total));
            if let Err(e) = pin_ahead::check_room(
                &*self.driver,
                to_pin,
                "sleep (refused before anything was released: every allocation stays awake)",
            ) {
                if let Some(b) = cached {
                    let _ = inner.host.cache(b); // as it was; a refused unpin keeps it cached anyway
                }
                return Err(e);
            }
            cold = to_pin > 0;
            buf = Some(match cached {
                Some(buf) => buf,
                None => HostBuffer::map_unpinned(&self.driver, total)?,
            });
        }

        // 2. Fingerprint every offloaded allocation, first on the copy streams so that the result does not wait
        //    for the copies: the retained ones to find their changed chunks, all to let the next sleep skip.
        let mut prints = self.begin_sleep_prints(inner, retained, &backed);

        // 3. Queue the backup copies. A steady (wholly pinned) arena is filled a bounded number of copies ahead,
        //    releasing each cell's finished allocations as it goes; a cold one is pinned cell by cell meanwhile.
        let cell_size = inner.pin_chunk;
        let mut first_err = None;
        let mut cells: Option<CellRelease> = None;
        // After `cells` (which holds the arena), so that it is dropped (waiting for every queued copy) first,
        // panics included.
        let mut issued: Option<transfer::InFlight> = None;
        if let Some(mut buf) = buf {
            if transfer::all_pinned(&buf, &jobs, cell_size) {
                let buf = Arc::new(buf);
                inner.arenas.push(buf.clone());
                let mut rel = CellRelease::new(&jobs, cell_size, buf.clone());
                let (in_flight, result) = transfer::issue_copy_out_pinned(
                    &*self.driver,
                    &buf,
                    &jobs,
                    cell_size,
                    |done, waited| {
                        rel.finish(self, inner, done, waited, &mut report, &mut first_err)
                    },
                );
                if let Err(e) = result {
                    first_err.get_or_insert(e);
                }
                issued = Some(in_flight);
                cells = Some(rel);
            } else {
                let mut absorbed = Vec::new();
                let (in_flight, result) = transfer::issue_copy_out(
                    &*self.driver,
                    &mut buf,
                    &jobs,
                    cell_size,
                    &mut absorbed,
                );
                for e in absorbed {
                    Self::record(
                        inner,
                        "pinning host backup memory (copying through pageable memory)",
                        &e,
                    );
                }
                for e in std::mem::take(&mut buf.notes) {
                    Self::record(inner, super::THREAD_REFUSED, &e);
                }
                if let Err(e) = result {
                    first_err.get_or_insert(e);
                }
                issued = Some(in_flight);
                let buf = Arc::new(buf);
                inner.arenas.push(buf.clone());
                cells = Some(CellRelease::new(&jobs, cell_size, buf));
            }
        }

        // 4. Compare the fingerprints; queue the copies of changed chunks into the retained backups.
        let changed_queued = self.issue_changed_chunks(inner, &mut prints, &mut report);
        let changed_ok = changed_queued.is_ok();
        if let Err(e) = changed_queued {
            first_err.get_or_insert(e);
        }

        // 5. While the copies run, release what needs no backup.
        for addr in bare {
            if let Err(e) = self.release_to_sleep(inner, addr, None, &mut report) {
                first_err.get_or_insert(e);
            }
        }

        // 6. As the remaining cells finish, release the allocations whose backup is complete.
        if let (Some(rel), Some(flight)) = (cells.as_mut(), issued.as_mut()) {
            while let Some((done, waited)) = flight.next_cell() {
                rel.finish(self, inner, done, waited, &mut report, &mut first_err);
            }
        }
        drop(issued); // after a failure: waits for the copy streams too

        // 7. Once their changed chunks are on the host, release the allocations with a retained backup.
        self.finish_sleep_prints(inner, prints, changed_ok, &mut report, &mut first_err);
        Self::abandon_incomplete_groups(inner);
        drop(cells);
        self.collect_unused_arenas(inner);
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

    /// Unmap and release one awake allocation and mark it asleep with `backup`. A failed unmap leaves it awake. A
    /// wake-group member is only marked released until its whole group is (group.rs).
    pub(super) fn release_to_sleep(
        &self,
        inner: &mut Inner,
        addr: DevPtr,
        backup: Option<Backup>,
        report: &mut Report,
    ) -> Result<()> {
        let a = inner.reg.get(addr).expect("selected");
        let State::Awake { backing } = a.state else {
            unreachable!("selected awake")
        };
        let handle = match backing {
            Backing::Own(handle) => handle,
            Backing::Group(id) => return self.release_member(inner, id, addr, backup, report),
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
        for addr in &targets {
            if let Err(e) = self.release_to_sleep(&mut inner, *addr, None, &mut report) {
                first_err.get_or_insert(e);
            }
        }
        Self::abandon_incomplete_groups(&mut inner);
        // Only what really went to sleep loses its retained backup (a group member whose group stayed mapped
        // after a failure is still awake with its data).
        let released: Vec<DevPtr> = targets
            .into_iter()
            .filter(|a| !inner.reg.get(*a).expect("selected").is_awake())
            .collect();
        Self::drop_retained(&mut inner, &released);
        self.collect_unused_arenas(&mut inner);
        report.seconds = start.elapsed().as_secs_f64();
        first_err.map_or(Ok(report), Err)
    }
}

/// Releases the backed-up allocations of a sleep as the cells holding their backup finish. `missing` counts each
/// job's cells on the whole grid, so a job with a cell that was never queued (after an error) stays awake.
struct CellRelease {
    jobs: Vec<transfer::Job>,
    missing: Vec<usize>,
    arena: Arc<HostBuffer>,
    /// False after a failed wait: nothing more is released, but every marker is still waited for.
    copies_ok: bool,
}

impl CellRelease {
    fn new(jobs: &[transfer::Job], cell_size: usize, arena: Arc<HostBuffer>) -> Self {
        CellRelease {
            jobs: jobs.to_vec(),
            missing: jobs
                .iter()
                .map(|j| (j.offset + j.size - 1) / cell_size - j.offset / cell_size + 1)
                .collect(),
            arena,
            copies_ok: true,
        }
    }

    /// After waiting for a cell (`waited`), release every allocation whose last cell it was.
    fn finish(
        &mut self,
        engine: &Engine,
        inner: &mut Inner,
        cell_jobs: Vec<usize>,
        waited: Result<()>,
        report: &mut Report,
        first_err: &mut Option<Error>,
    ) {
        if let Err(e) = waited {
            self.copies_ok = false; // release nothing more; the caller still waits for every cell
            first_err.get_or_insert(e);
        }
        for j in cell_jobs {
            self.missing[j] -= 1;
            if self.missing[j] == 0 && self.copies_ok {
                let job = self.jobs[j];
                let backup = Backup {
                    arena: self.arena.clone(),
                    offset: job.offset,
                };
                match engine.release_to_sleep(inner, job.addr, Some(backup), report) {
                    Ok(()) => report.copied_bytes += job.size,
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
    }
}
