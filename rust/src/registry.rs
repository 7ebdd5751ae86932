//! Allocation records and the per-thread tag stacks. Pure bookkeeping: no driver calls happen here, so every
//! state transition stays in `engine.rs`.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
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
/// on every malloc for the peak) cost O(devices), not O(allocations); likewise the bytes asleep with a backup.
#[derive(Default)]
pub struct Registry {
    allocs: BTreeMap<DevPtr, Allocation>,
    mapped: HashMap<i32, usize>,
    backed_up: usize,
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
        let counter = match a.state {
            State::Awake { .. } => self.mapped.entry(a.device).or_insert(0),
            State::Asleep { backup: Some(_) } => &mut self.backed_up,
            State::Asleep { backup: None } => return,
        };
        *counter = if add {
            *counter + a.size
        } else {
            *counter - a.size
        };
    }

    /// Bytes of the allocations asleep with a backup (the host memory their backups need).
    pub fn backed_up_bytes(&self) -> usize {
        self.backed_up
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

/// One engine's tag stack on one thread, with that engine's liveness flag.
struct TagStack {
    alive: Arc<AtomicBool>,
    tags: Vec<Arc<str>>,
}

/// Beyond this many tag stacks on one thread, the next push drops the stacks of closed or dropped engines.
const PRUNE_ABOVE: usize = 16;

thread_local! {
    /// Tag stacks of this thread, one per engine (keyed by engine id), so that several allocators in one process
    /// (a simulated one in tests beside the CUDA one) do not see each other's tags. Bounded: an emptied stack is
    /// removed, a closing engine removes its stack on the closing thread, and stacks that closed engines left on
    /// other threads are dropped once a thread holds more than PRUNE_ABOVE.
    static TAG_STACKS: RefCell<HashMap<u64, TagStack>> = RefCell::new(HashMap::new());
}

/// Push `tag` on this thread's stack for `engine`; `alive` turns false when that engine is closed or dropped.
pub fn push_tag(engine: u64, alive: &Arc<AtomicBool>, tag: Arc<str>) {
    TAG_STACKS.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() > PRUNE_ABOVE {
            s.retain(|_, st| st.alive.load(Ordering::Relaxed));
        }
        s.entry(engine)
            .or_insert_with(|| TagStack {
                alive: alive.clone(),
                tags: Vec::new(),
            })
            .tags
            .push(tag);
    });
}

pub fn pop_tag(engine: u64) -> Option<Arc<str>> {
    TAG_STACKS.with(|s| {
        let mut s = s.borrow_mut();
        let st = s.get_mut(&engine)?;
        let tag = st.tags.pop();
        if st.tags.is_empty() {
            s.remove(&engine);
        }
        tag
    })
}

/// Innermost tag of this thread for `engine`, or "default".
pub fn current_tag(engine: u64) -> Arc<str> {
    TAG_STACKS
        .with(|s| {
            s.borrow()
                .get(&engine)
                .and_then(|st| st.tags.last().cloned())
        })
        .unwrap_or_else(|| Arc::from(DEFAULT_TAG))
}

/// Drop this thread's stack for `engine` (it was closed).
pub fn forget_tags(engine: u64) {
    // try_with: an engine dropped while this thread's locals are torn down has nothing left to forget.
    let _ = TAG_STACKS.try_with(|s| s.borrow_mut().remove(&engine));
}

/// How many engines have a tag stack on this thread (bounded; see TAG_STACKS).
pub fn tag_stacks_on_this_thread() -> usize {
    TAG_STACKS.with(|s| s.borrow().len())
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
        r.set_state(0x10000, State::Asleep { backup: None });
        assert_eq!((r.mapped_bytes(Some(1)), r.mapped_bytes(None)), (0, 0x1000));
        r.remove(0x10000); // asleep: nothing mapped to subtract
        r.set_state(0x1000, State::Asleep { backup: None });
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

    #[test]
    fn tag_stacks_are_per_engine_and_per_thread() {
        let alive = Arc::new(AtomicBool::new(true));
        push_tag(1, &alive, Arc::from("weights"));
        push_tag(2, &alive, Arc::from("kv_cache"));
        assert_eq!(&*current_tag(1), "weights");
        assert_eq!(&*current_tag(2), "kv_cache");
        std::thread::spawn(|| assert_eq!(&*current_tag(1), DEFAULT_TAG))
            .join()
            .unwrap();
        assert_eq!(pop_tag(1).as_deref(), Some("weights"));
        assert_eq!(&*current_tag(1), DEFAULT_TAG);
        assert_eq!(pop_tag(1), None);
        assert_eq!(pop_tag(2).as_deref(), Some("kv_cache"));
        assert_eq!(tag_stacks_on_this_thread(), 0, "emptied stacks are removed");
    }

    #[test]
    fn stacks_of_closed_engines_do_not_pile_up() {
        let closed = Arc::new(AtomicBool::new(false));
        let live = Arc::new(AtomicBool::new(true));
        push_tag(0, &live, Arc::from("kept"));
        for engine in 1..1000 {
            push_tag(engine, &closed, Arc::from("t"));
        }
        assert!(tag_stacks_on_this_thread() <= PRUNE_ABOVE + 1);
        assert_eq!(
            &*current_tag(0),
            "kept",
            "a live engine's stack survives pruning"
        );
        forget_tags(0);
        assert_eq!(&*current_tag(0), DEFAULT_TAG);
    }
}
