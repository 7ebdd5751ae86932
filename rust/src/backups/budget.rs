//! The host budget: a cap on the pinned host memory the store holds for backups (`held()`: arenas backups point
//! into plus the cached one), set with `set_host_budget` or `CUMEM_RS_HOST_BUDGET`. Unlike the host guard
//! (pin_ahead.rs), which refuses to pin more than the host can still give, the budget bounds what is held at
//! any time, so several processes on one node can each be given a share. What passes it goes to the file tier
//! where a spill directory is set (file_tier.rs); without one, the sleep is refused before anything is released.

use super::BackupStore;
use crate::error::{Error, Result};
use crate::error_log::ErrorLog;

/// The environment variable read into the engine's configuration (bytes; `K`, `M`, `G` suffixes).
pub const BUDGET_ENV: &str = "CUMEM_RS_HOST_BUDGET";

impl BackupStore {
    /// The host budget, if one is set.
    pub fn host_budget(&self) -> Option<usize> {
        self.budget
    }

    /// Set (or with None remove) the host budget. Host memory already held above a new, lower budget stays until
    /// the backups in it are woken or freed; a pin-ahead worker pinning past it stops, and the cached arena (its
    /// buffer included) is returned at once.
    pub fn set_host_budget(&mut self, budget: Option<usize>, log: &mut ErrorLog) -> Result<()> {
        self.budget = budget;
        if budget.is_some_and(|b| self.held() > b) {
            self.stop_pin_ahead(log);
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
