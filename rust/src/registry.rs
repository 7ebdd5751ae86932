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

/// Live allocations by start address.
#[derive(Default)]
pub struct Registry {
    allocs: BTreeMap<DevPtr, Allocation>,
}

impl Registry {
    pub fn insert(&mut self, a: Allocation) {
        debug_assert!(
            self.containing(a.addr, 1).is_none(),
            "overlapping allocation at {:#x}",
            a.addr
        );
        self.allocs.insert(a.addr, a);
    }

    pub fn remove(&mut self, addr: DevPtr) -> Option<Allocation> {
        self.allocs.remove(&addr)
    }

    pub fn get(&self, addr: DevPtr) -> Option<&Allocation> {
        self.allocs.get(&addr)
    }

    pub fn get_mut(&mut self, addr: DevPtr) -> Option<&mut Allocation> {
        self.allocs.get_mut(&addr)
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
        self.allocs
            .values()
            .filter(|a| a.is_awake() && device.is_none_or(|d| d == a.device))
            .map(|a| a.size)
            .sum()
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
