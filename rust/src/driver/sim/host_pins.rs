//! The simulated driver's pinned host memory: registrations (`host_register`) and its own pinned allocations
//! (`host_alloc`), by start address, so that the check every copy makes ("does the host side stay inside the
//! registration it starts in?") is a logarithmic lookup, not a scan of every registration: with a small pin
//! chunk an arena is hundreds of thousands of registrations.

use std::collections::BTreeMap;

#[derive(Default)]
pub(super) struct HostPins {
    /// Registered ranges, start -> length. They never overlap (`register` refuses overlaps, as CUDA does).
    registered: BTreeMap<usize, usize>,
    /// `host_alloc` allocations, start -> length; fresh mappings of the driver's own, so they overlap nothing.
    allocated: BTreeMap<usize, usize>,
    /// Bytes of both, kept as a sum so that the budget check does not walk them either.
    pinned: usize,
    /// The most `pinned` has been: what a memory cgroup would have charged at the worst moment.
    peak: usize,
}

/// The range of `map` that contains `ptr`, if any (ranges in `map` do not overlap).
fn containing(map: &BTreeMap<usize, usize>, ptr: usize) -> Option<(usize, usize)> {
    let (&start, &len) = map.range(..=ptr).next_back()?;
    (ptr < start + len).then_some((start, len))
}

impl HostPins {
    /// Host bytes pinned now (registered plus allocated).
    pub(super) fn pinned(&self) -> usize {
        self.pinned
    }

    /// The most host bytes pinned at once so far.
    pub(super) fn peak(&self) -> usize {
        self.peak
    }

    /// (registrations, allocations) live now.
    pub(super) fn counts(&self) -> (usize, usize) {
        (self.registered.len(), self.allocated.len())
    }

    /// Record a registration of [ptr, ptr+size); false (nothing recorded) when it overlaps one already made.
    pub(super) fn register(&mut self, ptr: usize, size: usize) -> bool {
        let end = ptr.saturating_add(size.max(1));
        let overlaps = self
            .registered
            .range(..end)
            .next_back()
            .is_some_and(|(&start, &len)| start + len > ptr);
        if overlaps {
            return false;
        }
        self.registered.insert(ptr, size);
        self.pinned += size;
        self.peak = self.peak.max(self.pinned);
        true
    }

    /// Forget the registration that starts at `ptr`; false when there is none.
    pub(super) fn unregister(&mut self, ptr: usize) -> bool {
        let Some(size) = self.registered.remove(&ptr) else {
            return false;
        };
        self.pinned -= size;
        true
    }

    pub(super) fn add_allocation(&mut self, ptr: usize, size: usize) {
        self.allocated.insert(ptr, size);
        self.pinned += size;
        self.peak = self.peak.max(self.pinned);
    }

    /// Forget the allocation that starts at `ptr`; its size, None when there is none.
    pub(super) fn remove_allocation(&mut self, ptr: usize) -> Option<usize> {
        let size = self.allocated.remove(&ptr)?;
        self.pinned -= size;
        Some(size)
    }

    /// The live allocations (start, length), for the driver's drop.
    pub(super) fn allocations(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.allocated.iter().map(|(&p, &l)| (p, l))
    }

    /// Whether [ptr, ptr+size) lies wholly inside one registration or allocation (pinned memory).
    pub(super) fn pinned_covers(&self, ptr: usize, size: usize) -> bool {
        containing(&self.registered, ptr)
            .or_else(|| containing(&self.allocated, ptr))
            .is_some_and(|(start, len)| ptr + size <= start + len)
    }

    /// The length of the registration that starts at `ptr`.
    pub(super) fn registered_len(&self, ptr: usize) -> Option<usize> {
        self.registered.get(&ptr).copied()
    }

    /// The length of the allocation that starts at `ptr`.
    pub(super) fn allocated_len(&self, ptr: usize) -> Option<usize> {
        self.allocated.get(&ptr).copied()
    }

    /// As on CUDA, the host side of a copy that starts in pinned memory must stay inside that one registration
    /// or allocation (a copy spanning two fails with CUDA_ERROR_INVALID_VALUE); pageable memory is fine.
    pub(super) fn range_ok(&self, ptr: usize, size: usize) -> bool {
        containing(&self.registered, ptr)
            .or_else(|| containing(&self.allocated, ptr))
            .is_none_or(|(start, len)| ptr + size <= start + len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_must_stay_inside_the_registration_it_starts_in() {
        let mut h = HostPins::default();
        assert!(h.register(0x1000, 0x1000));
        assert!(h.register(0x2000, 0x1000)); // adjacent, not overlapping
        h.add_allocation(0x10000, 0x800);
        assert!(h.range_ok(0x1000, 0x1000), "the whole first registration");
        assert!(h.range_ok(0x1800, 0x800), "its second half");
        assert!(
            !h.range_ok(0x1800, 0x801),
            "one byte into the next registration"
        );
        assert!(h.range_ok(0x2fff, 1));
        assert!(!h.range_ok(0x2fff, 2), "past the last registration's end");
        assert!(
            h.range_ok(0x3000, 1 << 20),
            "pageable memory after it: no constraint"
        );
        assert!(
            h.range_ok(0x800, 0x2000),
            "starting in pageable memory: no constraint"
        );
        assert!(h.range_ok(0x10000, 0x800));
        assert!(
            !h.range_ok(0x10400, 0x401),
            "past the end of a host_alloc allocation"
        );
        assert_eq!(h.pinned(), 0x2800);
    }

    #[test]
    fn overlapping_registrations_are_refused_and_bytes_are_counted() {
        let mut h = HostPins::default();
        assert!(h.register(0x1000, 0x2000));
        assert!(!h.register(0x1000, 0x1000), "same start");
        assert!(!h.register(0x2000, 0x1000), "inside");
        assert!(!h.register(0x800, 0x1000), "overlapping its start");
        assert!(h.register(0x3000, 0x1000));
        assert_eq!(h.counts(), (2, 0));
        assert_eq!(h.pinned(), 0x3000);
        assert!(h.unregister(0x1000));
        assert!(!h.unregister(0x1000), "only once");
        assert!(!h.unregister(0x3800), "not the start of a registration");
        assert_eq!(h.pinned(), 0x1000);
        h.add_allocation(0x9000, 0x100);
        assert_eq!(h.remove_allocation(0x9000), Some(0x100));
        assert_eq!(h.remove_allocation(0x9000), None);
        assert_eq!(h.pinned(), 0x1000);
    }
}
