//! The per-thread tag stacks: which tag an allocation made on this thread gets (the innermost
//! `use_memory_pool(tag)` / `push_tag`), kept per engine so that several allocators in one process do not see
//! each other's tags.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub const DEFAULT_TAG: &str = "default";

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
