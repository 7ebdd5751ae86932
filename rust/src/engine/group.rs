//! Wake groups: neighbouring small allocations woken together share one physical handle and one mapping.
//!
//! Why: the driver's create, map, set-access, unmap and release calls cost tens of microseconds per handle or
//! mapping whatever its size (H200: ~20 + 5 + 27 us at wake, ~18 + 17 us at sleep per 2 MiB allocation, even
//! when one set-access or unmap call covers hundreds of mappings). At thousands of allocations those calls, not
//! the copies, bound the wake and the sleep. A run of adjacent asleep allocations of one tag on one device
//! (adjacent because `address_space` places allocations side by side) is therefore mapped at wake as one
//! handle of their total size, mapped once and made accessible once; the next sleep unmaps and releases it once.
//!
//! The cost, and what keeps it small: physical memory of a handle is returned only as a whole. A member freed
//! while its neighbours live keeps its memory (and its addresses) until the last member of the group is freed
//! or the group sleeps; `Stats::unreturned_bytes` shows how much that is. Groups are capped at
//! `DEFAULT_GROUP_BYTES` (and can be turned off with `set_wake_group_bytes(0)`), so at most one group's worth
//! minus one member is held per partly freed group; across groups there is no bound (a pool that frees all but
//! one 2 MiB member of every group holds 16x its live bytes until the next sleep). Remapping the surviving
//! members to return the memory at once is not done: it would move live memory other streams may be using.
//! Every member has one tag, so sleep, discard and pause, which select by tag, always release a group whole.

use std::collections::HashMap;

use super::pending::PendingReleases;
use super::{Engine, Inner, Report};
use crate::backups::Backup;
use crate::driver::{DevPtr, Driver, PhysHandle};
use crate::error::{Error, Result};
use crate::error_log::ErrorLog;
use crate::registry::Registry;
use crate::registry::{Backing, State};

/// Largest group formed at wake (bytes). 32 MiB turns 6144 allocations of 2 MiB into 384 handles (measured
/// enough for their wake and sleep to run at the copy limit) while a partly freed group holds little.
pub const DEFAULT_GROUP_BYTES: usize = 32 << 20;

pub(super) struct Group {
    pub addr: DevPtr,
    pub size: usize,
    pub handle: PhysHandle,
    /// Live members (in the registry, awake on this group).
    pub live: usize,
    /// Members freed while the group lived: their addresses go back to the address space with the group.
    pub freed: Vec<(DevPtr, usize)>,
    /// Members a sleep (or discard) has released so far, with the backup each goes to sleep with; the group is
    /// unmapped when every live member is in here. Emptied at the end of the call if it stayed incomplete.
    pub ready: Vec<(DevPtr, Option<Backup>)>,
}

pub(super) struct Groups {
    next: u64,
    by_id: HashMap<u64, Group>,
    /// Largest run one wake maps on one handle (bytes; 0: no groups).
    limit: usize,
}

impl Groups {
    pub fn new(limit: usize) -> Groups {
        Groups {
            next: 0,
            by_id: HashMap::new(),
            limit,
        }
    }

    pub fn insert(&mut self, g: Group) -> u64 {
        self.next += 1;
        self.by_id.insert(self.next, g);
        self.next
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// The live group `id`.
    pub fn get(&self, id: u64) -> Option<&Group> {
        self.by_id.get(&id)
    }

    /// Bytes of freed members still held by live groups.
    pub fn unreturned(&self) -> usize {
        self.by_id
            .values()
            .flat_map(|g| &g.freed)
            .map(|(_, n)| n)
            .sum()
    }

    /// A freed member leaves its group while others live (its memory stays with the group): true. The last
    /// live member does not leave (false): the caller dissolves the group.
    fn leave(&mut self, id: u64, addr: DevPtr, size: usize) -> bool {
        let g = self.by_id.get_mut(&id).expect("live group");
        if g.live == 1 {
            return false;
        }
        g.live -= 1;
        g.freed.push((addr, size));
        true
    }
}

/// What a wake mapped: one allocation on its own handle, or a run of them on one shared handle.
pub(super) struct Mapped {
    pub addr: DevPtr,
    pub size: usize,
    pub handle: PhysHandle,
    pub members: Vec<DevPtr>,
}

impl Engine {
    /// Largest run of neighbours a later wake maps on one handle; 0 maps every allocation on its own (each
    /// free then returns its memory at once). Groups already formed are kept.
    pub fn set_wake_group_bytes(&self, bytes: usize) -> Result<()> {
        self.lock_open()?.groups.limit = bytes;
        Ok(())
    }

    pub fn wake_group_bytes(&self) -> usize {
        self.inner.lock().groups.limit
    }

    /// Split `addrs` (asleep allocations in address order) into the runs one wake maps together: adjacent
    /// addresses in one reservation, one device, one tag, at most `group_bytes` in all. Allocations that fit no
    /// run are runs of one.
    pub(super) fn wake_runs(inner: &Inner, addrs: &[DevPtr]) -> Vec<Vec<DevPtr>> {
        let limit = inner.groups.limit;
        let mut runs: Vec<Vec<DevPtr>> = Vec::new();
        let mut run_bytes = 0;
        for &addr in addrs {
            let a = inner.reg.get(addr).expect("selected");
            let joins = runs.last().is_some_and(|run| {
                let last = inner
                    .reg
                    .get(*run.last().expect("non-empty"))
                    .expect("selected");
                inner.vas.continues(last.addr, last.size, a.addr)
                    && last.tag == a.tag
                    && run_bytes + a.size <= limit
            });
            if joins {
                runs.last_mut().expect("joins").push(addr);
                run_bytes += a.size;
            } else {
                runs.push(vec![addr]);
                run_bytes = a.size;
            }
        }
        runs
    }

    /// Map new physical memory under one run of asleep allocations: their own handle for a run of one, else one
    /// handle of the run's total size mapped once over it. Undoes its own steps on failure.
    pub(super) fn map_run(&self, inner: &mut Inner, run: &[DevPtr]) -> Result<Mapped> {
        let Inner {
            reg, pending, log, ..
        } = inner;
        map_run_in(&*self.driver, reg, pending, log, run)
    }

    /// Mark a wake's mapped runs awake: a run of one on its own handle, a longer run as a new group.
    pub(super) fn commit_mapped(&self, inner: &mut Inner, mapped: Vec<Mapped>) {
        for m in mapped {
            let backing = if m.members.len() == 1 {
                Backing::Own(m.handle)
            } else {
                Backing::Group(inner.groups.insert(Group {
                    addr: m.addr,
                    size: m.size,
                    handle: m.handle,
                    live: m.members.len(),
                    freed: Vec::new(),
                    ready: Vec::new(),
                }))
            };
            for addr in m.members {
                inner.reg.set_state(addr, State::Awake { backing });
            }
        }
    }

    /// Release one member of a group for sleep or discard. The group is unmapped and released, and its members
    /// marked asleep, once every live member was released; until then nothing changes but the ready list. A
    /// failed unmap leaves every member awake.
    pub(super) fn release_member(
        &self,
        inner: &mut Inner,
        id: u64,
        addr: DevPtr,
        backup: Option<Backup>,
        report: &mut Report,
    ) -> Result<()> {
        let driver = &*self.driver;
        self.release_member_with(inner, id, addr, backup, report, |g| {
            driver.unmap(g.addr, g.size).map(|()| None)
        })
    }

    /// `release_member` with the group's unmap done by `unmap`, which says whether it released the handle too
    /// (`Some`: with that result) or left that to the group's dissolving (`None`). A compressed sleep unmaps and
    /// releases a group whose members' backups are all complete while the codec still runs, and passes on what
    /// came of it.
    pub(super) fn release_member_with(
        &self,
        inner: &mut Inner,
        id: u64,
        addr: DevPtr,
        backup: Option<Backup>,
        report: &mut Report,
        unmap: impl FnOnce(&Group) -> Result<Option<Result<()>>>,
    ) -> Result<()> {
        let g = inner.groups.by_id.get_mut(&id).expect("live group");
        g.ready.push((addr, backup));
        if g.ready.len() < g.live {
            return Ok(());
        }
        let released = match unmap(g) {
            Ok(released) => released,
            Err(e) => {
                g.ready.clear();
                return Err(e);
            }
        };
        for (a, backup) in self.dissolve(inner, id, released) {
            let size = inner.reg.get(a).expect("member").size;
            if backup.is_none() {
                report.discarded_bytes += size;
            }
            report.allocations += 1;
            Self::mark_asleep(inner, a, backup);
        }
        Ok(())
    }

    /// After the group's unmap: forget it, release its handle (unless `released` says how that went already),
    /// give back the addresses of its freed members; returns its ready list.
    fn dissolve(
        &self,
        inner: &mut Inner,
        id: u64,
        released: Option<Result<()>>,
    ) -> Vec<(DevPtr, Option<Backup>)> {
        let g = inner.groups.by_id.remove(&id).expect("live group");
        match released {
            None => self.release_or_queue(inner, g.handle),
            Some(Ok(())) => {}
            Some(Err(e)) => (inner.pending).retry_release(&mut inner.log, g.handle, &e),
        }
        for (a, n) in g.freed {
            self.return_address(inner, a, n);
        }
        g.ready
    }

    /// End of a sleep or discard: groups left incomplete (a member's backup failed) keep every member awake.
    pub(super) fn abandon_incomplete_groups(inner: &mut Inner) {
        for g in inner.groups.by_id.values_mut() {
            g.ready.clear();
        }
    }

    /// Free one awake member (its caller's work on it is finished). The last live member unmaps and releases
    /// the group and returns every member's addresses; an earlier one only leaves the group, its memory held
    /// until then. A failed unmap is returned with nothing changed.
    pub(super) fn free_member(
        &self,
        inner: &mut Inner,
        id: u64,
        addr: DevPtr,
        size: usize,
    ) -> Result<()> {
        if inner.groups.leave(id, addr, size) {
            return Ok(());
        }
        let g = inner.groups.by_id.get(&id).expect("live group");
        self.driver.unmap(g.addr, g.size)?;
        self.dissolve(inner, id, None);
        self.return_address(inner, addr, size);
        Ok(())
    }

    /// Where `free_member` failed (or was not tried) for a caller that forgets the pointer whatever happens: the
    /// member leaves its group; if it was the last, the group's unmap, release and address return are queued for
    /// retry and recorded.
    pub(super) fn drop_member_queued(
        &self,
        inner: &mut Inner,
        id: u64,
        addr: DevPtr,
        size: usize,
        e: &Error,
    ) {
        if inner.groups.leave(id, addr, size) {
            inner.log.record(
                &format!("free {addr:#x} (freed anyway; its memory goes with its wake group)"),
                e,
            );
            return;
        }
        // Its range covers every member's: the queued return gives back the freed members' addresses too.
        let g = inner.groups.by_id.remove(&id).expect("live group");
        inner.log.record(
            &format!("free {addr:#x} (its group's unmap, release and address return are queued for retry)"),
            e,
        );
        inner.pending.queue_release(g.addr, g.size, g.handle);
    }
}

/// `Engine::map_run` on the parts of the engine state it uses (see `map_new_in`).
pub(super) fn map_run_in(
    driver: &dyn Driver,
    reg: &Registry,
    pending: &mut PendingReleases,
    log: &mut ErrorLog,
    run: &[DevPtr],
) -> Result<Mapped> {
    let first = reg.get(run[0]).expect("selected");
    let (device, addr) = (first.device, first.addr);
    let size = run
        .iter()
        .map(|a| reg.get(*a).expect("selected").size)
        .sum();
    let handle = super::map_new_in(driver, pending, log, device, addr, size)?;
    Ok(Mapped {
        addr,
        size,
        handle,
        members: run.to_vec(),
    })
}
