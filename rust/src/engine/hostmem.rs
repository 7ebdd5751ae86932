//! The bound on host backup memory: what the engine holds (arenas that backups point into, plus the cached one)
//! stays within the bytes of the backups still referenced (of allocations asleep with a backup, and the retained
//! ones of awake allocations, see retain.rs) plus one spare arena no larger than the largest backup a sleep made
//! (or `reserve_host` asked for).
//!
//! Why it needs enforcing: a wake of some tags leaves holes in the arena the others still use, and the next
//! sleep needs a new arena for what it backs up, so rounds of sleep and partial wake would multiply the memory
//! held. After every call that can free a backup or make an arena (sleep, wake, free), when the bound is
//! exceeded: first the cached arena goes back to the OS; if that is not enough, the backups still referenced
//! from arenas with holes are moved (a host memcpy, with no device copy in flight) into one arena of exactly
//! their size, and the old arenas are given back. A moved retained backup keeps its fingerprints: same bytes.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Engine, Inner};
use crate::driver::DevPtr;
use crate::error::Result;
use crate::registry::{Backup, State};

impl Engine {
    /// Bring the host memory held back within its bound (see the module comment). Failures are recorded: the
    /// backups stay where they are, correct, and the next call tries again.
    pub(super) fn bound_host_memory(&self, inner: &mut Inner) {
        if Self::within_bound(inner) {
            return;
        }
        if let Err(e) = inner.host.trim() {
            Self::record(inner, "returning cached host backup memory", &e);
        }
        if Self::within_bound(inner) {
            return;
        }
        if let Err(e) = self.compact_backups(inner) {
            Self::record(
                inner,
                "compacting host backups (host memory stays above its bound until a later call)",
                &e,
            );
        }
        self.give_back_unused_arenas(inner);
        if !Self::within_bound(inner) {
            if let Err(e) = inner.host.trim() {
                Self::record(inner, "returning cached host backup memory", &e);
            }
        }
    }

    /// Host bytes held: arenas in use plus cached ones.
    pub(super) fn host_held(inner: &Inner) -> usize {
        inner.arenas.iter().map(|a| a.len()).sum::<usize>() + inner.host.cached_bytes()
    }

    fn within_bound(inner: &Inner) -> bool {
        let held = Self::host_held(inner);
        // Cheap first: with nothing asleep or retained this is all a free needs to look at.
        if held <= inner.largest_backup {
            return true;
        }
        let referenced = inner.reg.backed_up_bytes() + Self::retained_bytes(inner);
        held <= referenced.saturating_add(inner.largest_backup)
    }

    /// Every backup still referenced: (allocation, its size, the backup, retained by an awake allocation).
    fn referenced_backups(inner: &Inner) -> Vec<(DevPtr, usize, Backup, bool)> {
        let asleep = inner.reg.iter().filter_map(|a| match &a.state {
            State::Asleep { backup: Some(b) } => Some((a.addr, a.size, b.clone(), false)),
            _ => None,
        });
        let retained = inner.retained.iter().filter_map(|(addr, b)| {
            let a = inner.reg.get(*addr)?;
            Some((*addr, a.size, b.clone(), true))
        });
        asleep.chain(retained).collect()
    }

    /// Move the backups in arenas with unused bytes into one new arena of exactly their size.
    fn compact_backups(&self, inner: &mut Inner) -> Result<()> {
        let mut moves = Self::referenced_backups(inner);
        let mut used: HashMap<usize, usize> = HashMap::new(); // arena address -> bytes of backups in it
        for (_, size, b, _) in &moves {
            *used.entry(Arc::as_ptr(&b.arena) as usize).or_default() += size;
        }
        moves.retain(|(_, _, b, _)| used[&(Arc::as_ptr(&b.arena) as usize)] < b.arena.len());
        let total: usize = moves.iter().map(|m| m.1).sum();
        if total == 0 {
            return Ok(());
        }
        let acquired = inner.host.acquire(total);
        self.record_host_fallbacks(inner);
        let mut buf = acquired?;
        let mut offset = 0;
        let mut placed = Vec::with_capacity(moves.len());
        for (addr, size, b, retained) in moves {
            buf.copy_from(offset, &b.arena, b.offset, size);
            placed.push((addr, offset, retained));
            offset += size;
        }
        let arena = Arc::new(buf);
        for (addr, offset, retained) in placed {
            let backup = Backup {
                arena: arena.clone(),
                offset,
            };
            if retained {
                inner.retained.insert(addr, backup);
            } else {
                let backup = Some(backup);
                inner.reg.set_state(addr, State::Asleep { backup });
            }
        }
        inner.arenas.push(arena);
        log::debug!("engine: moved {total} bytes of host backups out of arenas with holes");
        Ok(())
    }
}
