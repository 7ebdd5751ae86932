//! Allocation records and the per-thread tag stacks. Pure bookkeeping: no driver calls happen here, so every
//! state transition stays in `engine.rs`.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::driver::{DevPtr, PhysHandle};
use crate::host::HostBuffer;

pub const DEFAULT_TAG: &str = "default";

/// Where an asleep allocation's contents are: `len` bytes at `offset` of a shared host arena.
#[derive(Clone)]
pub struct Backup {
    pub arena: Arc<HostBuffer>,
    pub offset: usize,
}

#[derive(Clone)]
pub enum State {
    /// Physical memory mapped and accessible.
    Awake { handle: PhysHandle },
    /// Physical memory released; the range stays reserved. `backup` is None for discarded contents.
    Asleep { backup: Option<Backup> },
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
        if a.is_awake() {
            let m = self.mapped.entry(a.device).or_insert(0);
            *m = if add { *m + a.size } else { *m - a.size };
        }
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

thread_local! {
    /// Tag stacks of this thread, one per engine (keyed by engine id), so that several allocators in one process
    /// (a simulated one in tests beside the CUDA one) do not see each other's tags.
    static TAG_STACKS: RefCell<HashMap<u64, Vec<Arc<str>>>> = RefCell::new(HashMap::new());
}

pub fn push_tag(engine: u64, tag: Arc<str>) {
    TAG_STACKS.with(|s| s.borrow_mut().entry(engine).or_default().push(tag));
}

pub fn pop_tag(engine: u64) -> Option<Arc<str>> {
    TAG_STACKS.with(|s| s.borrow_mut().get_mut(&engine).and_then(Vec::pop))
}

/// Innermost tag of this thread for `engine`, or "default".
pub fn current_tag(engine: u64) -> Arc<str> {
    TAG_STACKS
        .with(|s| s.borrow().get(&engine).and_then(|v| v.last().cloned()))
        .unwrap_or_else(|| Arc::from(DEFAULT_TAG))
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
                handle: PhysHandle(addr),
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
        r.set_state(0x10000, State::Asleep { backup: None });
        assert_eq!((r.mapped_bytes(Some(1)), r.mapped_bytes(None)), (0, 0x1000));
        r.remove(0x10000); // asleep: nothing mapped to subtract
        r.set_state(0x1000, State::Asleep { backup: None });
        r.set_state(
            0x1000,
            State::Awake {
                handle: PhysHandle(9),
            },
        );
        assert_eq!(r.mapped_bytes(None), 0x1000);
        r.remove(0x1000);
        assert_eq!(r.mapped_bytes(None), 0);
    }

    #[test]
    fn tag_stacks_are_per_engine_and_per_thread() {
        push_tag(1, Arc::from("weights"));
        push_tag(2, Arc::from("kv_cache"));
        assert_eq!(&*current_tag(1), "weights");
        assert_eq!(&*current_tag(2), "kv_cache");
        std::thread::spawn(|| assert_eq!(&*current_tag(1), DEFAULT_TAG))
            .join()
            .unwrap();
        assert_eq!(pop_tag(1).as_deref(), Some("weights"));
        assert_eq!(&*current_tag(1), DEFAULT_TAG);
        assert_eq!(pop_tag(1), None);
        assert_eq!(pop_tag(2).as_deref(), Some("kv_cache"));
    }
}
