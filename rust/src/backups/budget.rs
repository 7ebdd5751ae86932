//! The host budget: a cap on the pinned host memory the store holds for backups (`held()`: arenas backups point
//! into plus the cached one), set with `set_host_budget` or `CUMEM_RS_HOST_BUDGET`. Unlike the host guard
//! (pin_ahead.rs), which refuses to pin more than the host can still give, the budget bounds what is held at
//! any time, so several processes on one node can each be given a share. What passes it goes into a hole of an
//! arena in use when one takes it (bound.rs), else to the file tier where a spill directory is set
//! (file_tier.rs); without one, the sleep is refused before anything is released.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::BackupStore;
use crate::driver::DevPtr;
use crate::error::{Error, Result};
use crate::error_log::ErrorLog;
use crate::host::HostBuffer;

/// The environment variable read into the engine's configuration (bytes; `K`, `M`, `G` suffixes).
pub const BUDGET_ENV: &str = "CUMEM_RS_HOST_BUDGET";

impl BackupStore {
    /// The host budget, if one is set.
    pub fn host_budget(&self) -> Option<usize> {
        self.budget
    }

    /// Set (or with None remove) the host budget. Host memory already held above a new, lower budget for the
    /// backups of asleep allocations stays until they are woken or freed; a pin-ahead worker pinning past it
    /// stops, the cached arena (its buffer included) is returned at once, and so are retained host backups
    /// while they hold memory past it (`drop_retained_past_budget`).
    pub fn set_host_budget(&mut self, budget: Option<usize>, log: &mut ErrorLog) -> Result<()> {
        self.budget = budget;
        let Some(budget) = budget.filter(|b| self.held() > *b) else {
            return Ok(());
        };
        self.stop_pin_ahead(log);
        self.host.trim()?;
        self.drop_retained_past_budget(budget, log)
    }

    /// While the store holds more than `budget`: drop the retained host backups of arenas that no asleep
    /// allocation's backup uses, largest arena first, and return each arena. A retained backup is a second copy
    /// of an awake allocation's data, kept only so that its next sleep copies less, so dropping it loses nothing;
    /// kept, the next sleep would reuse it and the memory past the budget would be held for good. Those sharing an
    /// arena with asleep backups stay: dropping them would free no memory.
    fn drop_retained_past_budget(&mut self, budget: usize, log: &mut ErrorLog) -> Result<()> {
        let key = |a: &Arc<HostBuffer>| Arc::as_ptr(a) as usize;
        let asleep_in: HashSet<usize> = (self.asleep.values())
            .filter_map(|b| b.arena().map(|(a, _)| key(a)))
            .collect();
        let mut by_arena: HashMap<usize, (usize, Vec<DevPtr>)> = HashMap::new();
        for (addr, b) in self.retention.backups() {
            if let Some((arena, _)) = b.arena().filter(|(a, _)| !asleep_in.contains(&key(a))) {
                let entry = by_arena
                    .entry(key(arena))
                    .or_insert((arena.len(), Vec::new()));
                entry.1.push(addr);
            }
        }
        let mut order: Vec<(usize, Vec<DevPtr>)> = by_arena.into_values().collect();
        order.sort_by_key(|(len, _)| std::cmp::Reverse(*len));
        // Retained compressed backups last, all together: their blobs lie in blob arenas that several backups
        // share, so only dropping them all frees those arenas (the ones no asleep backup uses are given back).
        let packed: Vec<DevPtr> = (self.retention.backups())
            .filter(|(_, b)| b.packed().is_some())
            .map(|(addr, _)| addr)
            .collect();
        order.extend((!packed.is_empty()).then_some((0, packed)));
        for (_, addrs) in order {
            if self.held() <= budget {
                break;
            }
            log::debug!(
                "backup store: dropping {} retained backups past the host budget",
                addrs.len()
            );
            self.retention.drop(&addrs);
            self.give_back_unused(log);
            self.host.trim()?;
        }
        Ok(())
    }

    /// Host bytes the budget still lets backups take once the cached arena is given back (None: no budget).
    pub fn budget_room(&self) -> Option<usize> {
        self.budget.map(|b| b.saturating_sub(self.arena_bytes()))
    }

    /// Err(OutOfMemory) naming the budget when holding `extra` more bytes beside the arenas in use would pass it.
    pub(super) fn check_budget(&self, extra: usize, what: &str) -> Result<()> {
        match self.budget {
            Some(budget) if self.arena_bytes().saturating_add(extra) > budget => Err(Error::OutOfMemory {
                what: format!(
                    "{what} needs {extra} bytes of host memory beside the {} bytes held, past the host budget of \
                     {budget} bytes (set_host_budget, {BUDGET_ENV}; a spill directory takes what does not fit)",
                    self.arena_bytes()
                ),
            }),
            _ => Ok(()),
        }
    }
}
