//! Sleep and discard: back up what is offloaded, release the physical memory, keep the addresses.

use std::sync::Arc;
use std::time::Instant;

use crate::timing::Phases;

use super::policy::Policies;
use super::{tag_set, Engine, Inner, Report};
use crate::backups::{
    Backup, FileRewrite, FileSleep, SleepArena, SleepPrints, NOTHING_RELEASED, THREAD_REFUSED,
};
use crate::driver::DevPtr;
use crate::error::{Error, Result};
use crate::host::HostBuffer;
use crate::registry::{Allocation, Backing, State};
use crate::transfer::{self, InFlight, Job};

/// The backup copies of one sleep in flight, and the releases waiting for them. `issued` is declared first so
/// that it is dropped (waiting for every queued copy, panics included) before the arena's last holder.
#[derive(Default)]
struct SleepCopies<'d> {
    issued: Option<InFlight<'d>>,
    cells: Option<CellRelease>,
}

impl Engine {
    /// Back up awake allocations whose tag is in `offload_tags`, then release the physical memory of every awake
    /// allocation. Allocations already asleep keep their state and backup.
    pub fn sleep<S: AsRef<str>>(&self, offload_tags: &[S]) -> Result<Report> {
        let offload = tag_set(offload_tags);
        self.sleep_where(|_| true, |_, a| offload.contains(&*a.tag))
    }

    /// Sleep without naming tags: each tag is backed up per its policy (unset: only "default" is, vLLM's rule),
    /// then every awake allocation is released. Same ordering and guarantees as `sleep`.
    pub fn sleep_by_policy(&self) -> Result<Report> {
        self.sleep_where(|_| true, |p, a| p.sleep_backup(&a.tag))
    }

    /// The one sleep entry (sleep, sleep by policy, pause): the awake allocations for which `wanted` holds are
    /// released, those for which `backup` holds backed up first.
    pub(super) fn sleep_where(
        &self,
        wanted: impl Fn(&Allocation) -> bool,
        backup: impl Fn(&Policies, &Allocation) -> bool,
    ) -> Result<Report> {
        let start = Instant::now();
        let mut locked = self.lock_open()?;
        let inner = &mut *locked;
        self.retry_pending(inner);
        let (mut backed, mut bare) = (Vec::new(), Vec::new());
        for a in inner.reg.iter().filter(|a| a.is_awake() && wanted(a)) {
            if backup(&inner.policies, a) {
                &mut backed
            } else {
                &mut bare
            }
            .push(a.addr);
        }
        self.sleep_targets(inner, backed, bare, start)
    }

    /// Back up `backed`, then release `backed` and `bare` (awake allocations).
    ///
    /// Order: synchronize; choose each backup's tier (files past the host budget: space, file and staging ring
    /// had here); compress the host backups of tags that compress, releasing each of those allocations as soon as
    /// its backup is complete; take the host arena for the rest (the last points that may fail with nothing more
    /// queued: what the codec put to sleep stays asleep with its complete backup); fingerprint
    /// every offloaded allocation; queue the backup copies of those without a retained backup (pinning a cold
    /// arena cell by cell meanwhile, or releasing finished cells as it goes into a pinned one); queue the copies
    /// of changed chunks into retained host backups; release the allocations that need no backup while those
    /// copies run; then, as the copies finish, release the backed-up allocations; then write the file-tier
    /// backups through the staging ring, releasing each allocation once its bytes are in the file, and the
    /// changed chunks of retained file backups at their offsets. An allocation is
    /// released only once its whole backup is known to be on the host or in its file, so after any failure each
    /// offloaded allocation is either awake with its data or asleep with a complete backup. Allocations of other
    /// tags are released without backup as asked, failure or not.
    fn sleep_targets(
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
        let mut phases = Phases::new("engine sleep");
        let t = Instant::now();
        self.synchronize_devices(inner, &targets)?;
        let t = phases.add("synchronize", t);
        // Not offloaded this time: a retained backup of these would go stale.
        inner.backups.drop_retained(&bare);
        let mut retained = inner.backups.split_retained(&mut backed);
        // Retained compressed file backups are kept only if nothing in them changed (checked now, with one
        // fingerprint pass): a changed one is backed up afresh, planned with the others.
        let changed =
            (inner.backups).split_changed_file_packed(&inner.reg, &mut retained, &mut inner.log);
        if !changed.is_empty() {
            backed.extend(changed);
            backed.sort_unstable();
        }
        // A retained backup in the other tier than its tag's policy now says ("host", "file") is dropped: a fresh
        // backup goes where the policy says.
        let (retier, kept): (Vec<DevPtr>, Vec<DevPtr>) = retained.into_iter().partition(|a| {
            let tag = &inner.reg.get(*a).expect("selected").tag;
            (inner.backups).retained_in_other_tier(*a, inner.policies.backup_tier(tag))
        });
        retained = kept;
        // Allocations with a retained compressed backup: `pack` (below) compresses their changed chunks.
        let packed_retained = inner.backups.split_packed(&mut retained);
        if !retier.is_empty() {
            inner.backups.drop_retained(&retier);
            backed.extend(retier);
            backed.sort_unstable();
        }

        // 0. Which of the others go to a spill file (tag policies, the host budget): the directory's space, the
        //    file and the staging ring are had here, before anything is released.
        let (backed, spill) = Self::plan_tiers(inner, &backed)?;
        let t = phases.add("plan", t);

        // 0b. Compress the host backups of tags that compress, without a host budget releasing each as its
        //     backup is complete (then asleep when it returns; what the codec did not finish is copied raw below).
        let mut report = Report::default();
        let mut first_err = None;
        let (mut backed, packed, unplanned) =
            self.pack_backups(inner, backed, packed_retained, &mut report, &mut first_err);
        let t = phases.add("compress", t);
        let mut spill = spill;
        if !unplanned.is_empty() {
            // Allocations whose retained compressed backup was dropped (a failed compression, a tag that no
            // longer compresses) are copied raw, which the plan did not count: planned again with them, their
            // blob arenas given back first (the first plan's file goes unused).
            let mut again: Vec<DevPtr> = (backed.iter().copied())
                .chain(spill.iter().flat_map(|p| p.jobs.iter().map(|j| j.addr)))
                .chain(unplanned)
                .collect();
            again.sort_unstable();
            drop(spill.take());
            match Self::plan_tiers(inner, &again) {
                Ok(plan) => (backed, spill) = plan,
                Err(e) => return Err(Self::refuse_after_codec(inner, packed, e)),
            }
        }

        // 1. The host arena for the backups made now (with step 0, the only steps that may still return early).
        let (jobs, total) = self.sleep_jobs(inner, &backed);
        let arena = match total {
            0 => None,
            _ => match inner.backups.sleep_arena(total, &mut inner.log) {
                Ok(arena) => Some(arena),
                Err(e) => return Err(Self::refuse_after_codec(inner, packed, e)),
            },
        };
        let cold = arena.as_ref().is_some_and(|b| b.unpinned_below(total) > 0);
        let t = phases.add("arena", t);

        // 2. Fingerprint every offloaded allocation, first on the copy streams so that the result does not wait
        //    for the copies: the retained ones to find their changed chunks, all to let the next sleep skip.
        //    Those going to a file too: their backup is retained by the wake like a host one.
        let fresh: Vec<DevPtr> = (backed.iter().copied())
            .chain(spill.iter().flat_map(|p| p.jobs.iter().map(|j| j.addr)))
            .collect();
        let mut prints =
            inner
                .backups
                .begin_sleep_prints(&inner.reg, retained, &fresh, &mut inner.log);

        let t = phases.add("prints", t);
        // 3. Queue the backup copies.
        let mut copies = SleepCopies::default();
        if let Some(arena) = arena {
            copies = self.issue_backups(inner, arena, &jobs, &mut report, &mut first_err);
        }

        // 4. Compare the fingerprints; queue the copies of changed chunks into the retained backups.
        let changed_queued =
            inner
                .backups
                .issue_changed_chunks(&inner.reg, &mut prints, &mut inner.log);
        let changed_ok = changed_queued.is_ok();
        let t = phases.add("queue copies", t);
        if let Err(e) = changed_queued {
            first_err.get_or_insert(e);
        }

        // 5. While the copies run, release what needs no backup; keep the prints of the compressed ones asleep.
        for addr in bare {
            if let Err(e) = self.release_to_sleep(inner, addr, None, &mut report) {
                first_err.get_or_insert(e);
            }
        }
        let retaining = inner.backups.retaining();
        let packed_prints = self.finish_packed(inner, packed, &mut report, &mut first_err);
        for (addr, fps) in packed_prints {
            prints.add_packed(addr, fps, retaining);
        }
        let t = phases.add("release", t);

        // 6. As the remaining cells finish, release the allocations whose backup is complete.
        if let (Some(rel), Some(flight)) = (copies.cells.as_mut(), copies.issued.as_mut()) {
            while let Some((done, waited)) = flight.next_cell() {
                rel.finish(self, inner, done, waited, &mut report, &mut first_err);
            }
        }
        drop(copies.issued.take()); // after a failure: waits for the copy streams too
        let t = phases.add("copies and releases", t);

        // 6b. The file tier, once the host copies are done (nothing more after a failure): device -> staging ring
        //     -> file, each allocation released once all its bytes are written.
        if let Some(mut plan) = spill.filter(|_| first_err.is_none()) {
            if plan.compresses() {
                // As for host backups: not what the codec could not shrink last time (counted).
                for job in &mut plan.jobs {
                    let tag = &inner.reg.get(job.addr).expect("selected").tag;
                    job.kind = (inner.policies.compress_kind(tag))
                        .filter(|_| !inner.backups.skips_codec(job.addr));
                }
            }
            self.write_files(inner, &plan, &mut report, &mut first_err);
        }

        // 6c. Retained file backups (nothing more after a failure: they stay awake and lose them): only their
        //     changed chunks go device -> ring -> file, each allocation released once they are written.
        let rewrites = prints.take_file_rewrites();
        if !rewrites.is_empty() && first_err.is_none() {
            self.rewrite_files(inner, rewrites, &mut report, &mut first_err);
        }

        // 7. Once their changed chunks are on the host, release the allocations with a retained backup.
        self.release_retained(inner, prints, changed_ok, &mut report, &mut first_err);
        Self::abandon_incomplete_groups(inner);
        let t = phases.add("files and retained", t);
        drop(copies);
        inner.backups.collect_unused(&mut inner.log);
        phases.add("collect unused", t);
        phases.log();
        report.seconds = start.elapsed().as_secs_f64();
        log::debug!(
            "engine sleep: {} allocations, {} bytes backed up ({}), {} bytes released without backup, {:.3} s",
            report.allocations,
            report.copied_bytes,
            if cold { "cold: arena pinned during the copies" } else { "steady: cached arena" },
            report.discarded_bytes,
            report.seconds
        );
        inner.counters.sleeps += 1;
        inner.counters.last_sleep = Some(report.clone());
        first_err.map_or(Ok(report), Err)
    }

    /// Refuse a sleep (`e`) at one of the points after its codec ran (the second tier plan, the host arena),
    /// with nothing more released: the compressed backups not yet asleep go unused (their allocations stay awake
    /// with their data), no wake group keeps members marked ready for a release that will not come, arenas the
    /// retained backups dropped before left unused are collected, and where the codec had put allocations to
    /// sleep (released as their backups were complete) the refusal, which says every allocation stays awake,
    /// says how many did not (and the log).
    fn refuse_after_codec(
        inner: &mut Inner,
        packed: super::compress::PackedBackups,
        e: Error,
    ) -> Error {
        Self::abandon_incomplete_groups(inner);
        let n = packed.asleep.len();
        drop(packed);
        inner.backups.collect_unused(&mut inner.log);
        if n == 0 {
            return e;
        }
        let what = format!(
            "sleep refused after {n} allocations had gone to sleep with their compressed backups (they stay asleep)"
        );
        inner.log.record(&what, &e);
        let after =
            format!("refused after {n} allocations went to sleep with their compressed backups");
        let said = |s: String| {
            (s.replace(
                &format!("{NOTHING_RELEASED}: every allocation stays awake"),
                &format!("{after}: the others stay awake"),
            ))
            .replace(
                &format!("{NOTHING_RELEASED}:"),
                &format!("{after} (the others stay awake):"),
            )
        };
        match e {
            Error::OutOfMemory { what } => Error::OutOfMemory { what: said(what) },
            Error::InvalidState(s) => Error::InvalidState(said(s)),
            Error::InvalidArgument(s) => Error::InvalidArgument(said(s)),
            other => other,
        }
    }

    /// Which of `backed` go to a spill file (`BackupStore::plan_tiers`): (host tier, planned file sleep).
    fn plan_tiers(
        inner: &mut Inner,
        backed: &[DevPtr],
    ) -> Result<(Vec<DevPtr>, Option<FileSleep>)> {
        let wanted: Vec<_> = (backed.iter())
            .map(|addr| {
                let a = inner.reg.get(*addr).expect("selected");
                (a.addr, a.device, a.size, inner.policies.backup_tier(&a.tag))
            })
            .collect();
        inner.backups.plan_tiers(&wanted, &mut inner.log)
    }

    /// The backups to make, laid out back to back in one arena, neighbours in one reservation marked so that
    /// their copies merge.
    fn sleep_jobs(&self, inner: &Inner, backed: &[DevPtr]) -> (Vec<Job>, usize) {
        let (mut jobs, total) = transfer::layout(backed.iter().map(|a| {
            let a = inner.reg.get(*a).expect("selected");
            (a.device, a.addr, a.size)
        }));
        for i in 1..jobs.len() {
            let prev = jobs[i - 1];
            jobs[i].joins_previous = inner.vas.continues(prev.addr, prev.size, jobs[i].addr);
        }
        (jobs, total)
    }

    /// Queue the backup copies of `jobs` into `arena`. A steady (wholly pinned) arena, or a hole of one in use
    /// (the jobs laid out from its offset), is filled a bounded number of copies ahead, releasing each cell's
    /// finished allocations as it goes; a cold one is pinned cell by cell meanwhile (its releases come as the
    /// caller drains the cells).
    fn issue_backups(
        &self,
        inner: &mut Inner,
        arena: SleepArena,
        jobs: &[Job],
        report: &mut Report,
        first_err: &mut Option<Error>,
    ) -> SleepCopies<'_> {
        let cell_size = inner.backups.pin_chunk();
        let mut arena = match arena {
            SleepArena::Hole { arena, offset } => {
                let jobs: Vec<Job> = (jobs.iter())
                    .map(|j| Job {
                        offset: j.offset + offset,
                        ..*j
                    })
                    .collect();
                return self.issue_pinned(inner, arena, &jobs, report, first_err);
            }
            SleepArena::Own(buf) => buf,
        };
        if transfer::all_pinned(&arena, jobs, cell_size) {
            let arena = inner.backups.adopt(arena, &mut inner.log);
            return self.issue_pinned(inner, arena, jobs, report, first_err);
        }
        let mut absorbed = Vec::new();
        let (in_flight, result) =
            transfer::issue_copy_out(&*self.driver, &mut arena, jobs, cell_size, &mut absorbed);
        for e in absorbed {
            inner.log.record(
                "pinning host backup memory (copying through pageable memory)",
                &e,
            );
        }
        if let Err(e) = result {
            first_err.get_or_insert(e);
        }
        let arena = inner.backups.adopt(arena, &mut inner.log);
        SleepCopies {
            issued: Some(in_flight),
            cells: Some(CellRelease::new(jobs, cell_size, arena)),
        }
    }

    /// Queue the backup copies of `jobs` into the wholly pinned `arena` (held by the store), releasing each
    /// cell's finished allocations as it goes.
    fn issue_pinned(
        &self,
        inner: &mut Inner,
        arena: Arc<HostBuffer>,
        jobs: &[Job],
        report: &mut Report,
        first_err: &mut Option<Error>,
    ) -> SleepCopies<'_> {
        let cell_size = inner.backups.pin_chunk();
        let mut rel = CellRelease::new(jobs, cell_size, arena.clone());
        let (in_flight, result) = transfer::issue_copy_out_pinned(
            &*self.driver,
            &arena,
            jobs,
            cell_size,
            |done, waited| rel.finish(self, inner, done, waited, report, first_err),
        );
        if let Err(e) = result {
            first_err.get_or_insert(e);
        }
        SleepCopies {
            issued: Some(in_flight),
            cells: Some(rel),
        }
    }

    /// Write the file-tier backups of `plan`, releasing each allocation whose backup is complete.
    fn write_files(
        &self,
        inner: &mut Inner,
        plan: &FileSleep,
        report: &mut Report,
        first_err: &mut Option<Error>,
    ) {
        let start = Instant::now();
        let mut copied = 0;
        let (mut refused, mut fell_back) = (None, None);
        let written = plan.write_out(
            &*self.driver,
            &mut refused,
            &mut fell_back,
            |job, backup| {
                let stored = backup.is_compressed().then(|| backup.stored_len());
                if job.kind.is_some() {
                    inner.backups.note_codec_result(job.addr, stored.is_none());
                }
                match self.release_to_sleep(inner, job.addr, Some(backup), report) {
                    Ok(()) => {
                        copied += job.size;
                        if let Some(stored) = stored {
                            report.raw_bytes += job.size;
                            report.stored_bytes += stored;
                        }
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            },
        );
        if let Some(e) = fell_back {
            // Written raw for a failure of the codec, not for what the codec made of them: tried again next time.
            inner.log.record(super::compress::COMPRESS_FELL_BACK, &e);
            for job in plan.jobs.iter().filter(|j| j.kind.is_some()) {
                inner.backups.note_codec_result(job.addr, false);
            }
        }
        report.copied_bytes += copied;
        Self::account_file_pass(inner, start, refused, written, report, first_err);
    }

    /// Write the changed chunks of retained file backups, releasing each allocation whose backup is complete.
    fn rewrite_files(
        &self,
        inner: &mut Inner,
        rewrites: Vec<FileRewrite>,
        report: &mut Report,
        first_err: &mut Option<Error>,
    ) {
        let start = Instant::now();
        let plan = match inner.backups.plan_rewrites(rewrites, &mut inner.log) {
            Ok(Some(plan)) => plan,
            Ok(None) => return,
            Err(e) => {
                first_err.get_or_insert(e);
                return;
            }
        };
        let mut refused = None;
        let written = plan.write_out(&*self.driver, &mut refused, |addr, backup| {
            if let Err(e) = self.release_to_sleep(inner, addr, Some(backup), report) {
                first_err.get_or_insert(e);
            }
        });
        Self::account_file_pass(inner, start, refused, written, report, first_err);
    }

    /// After a pass of file writes begun at `start`: record a refused I/O thread, add the time and the bytes
    /// written to the report, keep the first error.
    fn account_file_pass(
        inner: &mut Inner,
        start: Instant,
        refused: Option<Error>,
        written: Result<usize>,
        report: &mut Report,
        first_err: &mut Option<Error>,
    ) {
        if let Some(e) = refused {
            inner.log.record(THREAD_REFUSED, &e);
        }
        report.file_seconds += start.elapsed().as_secs_f64();
        match written {
            Ok(n) => report.written_bytes += n,
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }

    /// Sleep, last step: wait for the changed-chunk copies (always, failure or not), release the retained
    /// allocations whose backup is complete (`copies_ok`: everything was queued), then keep the new prints of
    /// every allocation now asleep with a backup. Retained allocations not released stay awake and lose their
    /// retained backup.
    fn release_retained(
        &self,
        inner: &mut Inner,
        mut prints: SleepPrints,
        copies_ok: bool,
        report: &mut Report,
        first_err: &mut Option<Error>,
    ) {
        // After a failure release nothing more, but wait for every marker.
        let mut ok = copies_ok;
        if let Err(e) = prints.wait_leftover_markers(&*self.driver) {
            ok = false;
            first_err.get_or_insert(e);
        }
        while let Some((addr, backup, waited)) = prints.next_changed(&*self.driver) {
            if let Err(e) = waited {
                ok = false;
                first_err.get_or_insert(e);
            }
            if ok {
                if let Err(e) = self.release_to_sleep(inner, addr, Some(backup), report) {
                    first_err.get_or_insert(e);
                }
            }
        }
        report.chunks_checked += prints.chunks_checked;
        report.skipped_bytes += prints.skipped_bytes;
        report.copied_bytes += prints.copied_bytes;
        report.fingerprint_seconds = prints.seconds;
        inner.backups.keep_sleep_prints(prints);
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
        Self::mark_asleep(inner, addr, backup);
        Ok(())
    }

    /// Release awake allocations whose tag is in `tags`, without backup. Other tags are untouched.
    pub fn discard<S: AsRef<str>>(&self, tags: &[S]) -> Result<Report> {
        let start = Instant::now();
        let wanted = tag_set(tags);
        let mut locked = self.lock_open()?;
        let inner = &mut *locked;
        self.retry_pending(inner);
        let targets = inner
            .reg
            .select(|a| a.is_awake() && wanted.contains(&*a.tag));
        if targets.is_empty() {
            return Ok(Report::default());
        }
        self.synchronize_devices(inner, &targets)?;
        let mut report = Report::default();
        let mut first_err = None;
        for addr in &targets {
            if let Err(e) = self.release_to_sleep(inner, *addr, None, &mut report) {
                first_err.get_or_insert(e);
            }
        }
        Self::abandon_incomplete_groups(inner);
        // Only what really went to sleep loses its retained backup (a group member whose group stayed mapped
        // after a failure is still awake with its data).
        let released: Vec<DevPtr> = targets
            .into_iter()
            .filter(|a| !inner.reg.get(*a).expect("selected").is_awake())
            .collect();
        inner.backups.drop_retained(&released);
        inner.backups.collect_unused(&mut inner.log);
        report.seconds = start.elapsed().as_secs_f64();
        first_err.map_or(Ok(report), Err)
    }
}

/// Releases the backed-up allocations of a sleep as the cells holding their backup finish. `missing` counts each
/// job's cells on the whole grid, so a job with a cell that was never queued (after an error) stays awake.
struct CellRelease {
    jobs: Vec<Job>,
    missing: Vec<usize>,
    arena: Arc<HostBuffer>,
    /// False after a failed wait: nothing more is released, but every marker is still waited for.
    copies_ok: bool,
}

impl CellRelease {
    fn new(jobs: &[Job], cell_size: usize, arena: Arc<HostBuffer>) -> Self {
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
                let backup = Backup::in_arena(&self.arena, job.offset, job.size);
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
