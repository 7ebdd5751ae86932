//! Allocation records. Pure bookkeeping: no driver calls happen here, so every
//! state transition stays in `engine.rs`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::driver::{DevPtr, PhysHandle};

/// The physical memory under an awake allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// A handle of its own, mapped over exactly its range.
    Own(PhysHandle),
    /// Its part of a wake group's handle (the engine's group table, by id), shared with its neighbours.
    Group(u64),
}

#[derive(Clone)]
pub enum State {
    /// Physical memory mapped and accessible.
    Awake { backing: Backing },
    /// Physical memory released; the range stays reserved. Whether its contents were backed up, and where, is
    /// the backup store's to say (`crate::backups`).
    Asleep,
}

#[derive(Clone)]
pub struct Allocation {
    pub addr: DevPtr,
    /// Rounded to the granularity: the reserved and mapped size.
    pub size: usize,
    /// What the caller asked for.
    pub requested: usize,
    pub device: i32,
    pub tag: Arc<str>,
    /// The caller's stream at malloc (0 = none), synchronized before unmapping at free.
    pub stream: u64,
    pub state: State,
}

impl Allocation {
    pub fn is_awake(&self) -> bool {
        matches!(self.state, State::Awake { .. })
    }

    pub fn end(&self) -> u64 {
        self.addr + self.size as u64
    }
}

/// Live allocations by start address, with mapped bytes per device kept up to date so that usage queries (made
/// on every malloc for the peak) cost O(devices), not O(allocations).
#[derive(Default)]
pub struct Registry {
    allocs: BTreeMap<DevPtr, Allocation>,
    mapped: HashMap<i32, usize>,
}

impl Registry {
    pub fn insert(&mut self, a: Allocation) {
        debug_assert!(
            self.containing(a.addr, 1).is_none(),
            "overlapping allocation at {:#x}",
            a.addr
        );
        self.count(&a, true);
        self.allocs.insert(a.addr, a);
    }

    pub fn remove(&mut self, addr: DevPtr) -> Option<Allocation> {
        let a = self.allocs.remove(&addr)?;
        self.count(&a, false);
        Some(a)
    }

    /// Change an allocation's state (the only way to, so the mapped-bytes counters stay right).
    pub fn set_state(&mut self, addr: DevPtr, state: State) {
        let mut a = self
            .allocs
            .remove(&addr)
            .expect("set_state of a live allocation");
        self.count(&a, false);
        a.state = state;
        self.count(&a, true);
        self.allocs.insert(addr, a);
    }

    fn count(&mut self, a: &Allocation, add: bool) {
        let State::Awake { .. } = a.state else {
            return;
        };
        let counter = self.mapped.entry(a.device).or_insert(0);
        *counter = if add {
            *counter + a.size
        } else {
            *counter - a.size
        };
    }

    pub fn get(&self, addr: DevPtr) -> Option<&Allocation> {
        self.allocs.get(&addr)
    }

    /// The allocation that wholly contains [addr, addr+len).
    pub fn containing(&self, addr: DevPtr, len: usize) -> Option<&Allocation> {
        let (_, a) = self.allocs.range(..=addr).next_back()?;
        (addr.checked_add(len as u64)? <= a.end()).then_some(a)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Allocation> {
        self.allocs.values()
    }

    /// Addresses of the allocations matching `pred`, in address order.
    pub fn select(&self, pred: impl Fn(&Allocation) -> bool) -> Vec<DevPtr> {
        self.allocs
            .values()
            .filter(|a| pred(a))
            .map(|a| a.addr)
            .collect()
    }

    pub fn len(&self) -> usize {
        self.allocs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.allocs.is_empty()
    }

    /// Mapped bytes, on one device or all.
    pub fn mapped_bytes(&self, device: Option<i32>) -> usize {
        match device {
            Some(d) => self.mapped.get(&d).copied().unwrap_or(0),
            None => self.mapped.values().sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(addr: u64, size: usize) -> Allocation {
        Allocation {
            addr,
            size,
            requested: size,
            device: 0,
            tag: Arc::from("t"),
            stream: 0,
            state: State::Awake {
                backing: Backing::Own(PhysHandle(addr)),
            },
        }
    }

    #[test]
    fn containing_finds_interior_ranges_only() {
        let mut r = Registry::default();
        r.insert(alloc(0x1000, 0x1000));
        r.insert(alloc(0x3000, 0x1000));
        assert_eq!(r.containing(0x1000, 0x1000).map(|a| a.addr), Some(0x1000));
        assert_eq!(r.containing(0x1800, 0x10).map(|a| a.addr), Some(0x1000));
        assert!(r.containing(0x1800, 0x1000).is_none(), "crosses the end");
        assert!(r.containing(0x2000, 1).is_none(), "gap");
        assert!(r.containing(0x500, 1).is_none(), "before everything");
        assert_eq!(r.mapped_bytes(None), 0x2000);
        assert_eq!(r.mapped_bytes(Some(1)), 0);
    }

    #[test]
    fn mapped_counters_follow_state_changes_and_removal() {
        let mut r = Registry::default();
        let mut b = alloc(0x10000, 0x2000);
        b.device = 1;
        r.insert(alloc(0x1000, 0x1000));
        r.insert(b);
        assert_eq!(
            (r.mapped_bytes(Some(0)), r.mapped_bytes(Some(1))),
            (0x1000, 0x2000)
        );
        r.set_state(0x10000, State::Asleep);
        assert_eq!((r.mapped_bytes(Some(1)), r.mapped_bytes(None)), (0, 0x1000));
        r.remove(0x10000); // asleep: nothing mapped to subtract
        r.set_state(0x1000, State::Asleep);
        r.set_state(
            0x1000,
            State::Awake {
                backing: Backing::Own(PhysHandle(9)),
            },
        );
        assert_eq!(r.mapped_bytes(None), 0x1000);
        r.remove(0x1000);
        assert_eq!(r.mapped_bytes(None), 0);
    }
}
