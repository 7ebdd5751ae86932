//! Device address space: allocations are placed side by side inside large shared reservations ("slabs") instead
//! of one reservation each.
//!
//! Why: the driver's map, set-access and unmap calls cost tens of microseconds per *mapping*, whatever its size
//! (measured on an H200: `cuMemSetAccess` ~27 us per 2 MiB mapping even when one call covers 512 of them). A
//! wake of thousands of small allocations is bound by those calls unless neighbours share one physical handle
//! and one mapping (`engine/group.rs`), and one mapping can only cover addresses of one reservation. Placing
//! allocations in order inside a slab makes neighbours in time neighbours in address. As a side effect malloc
//! and free skip the reserve and address-free calls while the slab lives.
//!
//! Pure bookkeeping except for the reserve that creates a slab; the caller frees the slabs `free` hands back
//! (so that a refused address free can be queued with the engine's other retries).

use std::collections::BTreeMap;

use crate::driver::{DevPtr, Driver};
use crate::error::Result;

/// Size of a shared reservation. Address space is plentiful (47+ bits); a slab costs no memory.
pub const SLAB_BYTES: usize = 1 << 31;

struct Slab {
    device: i32,
    size: usize,
    used: usize,
    /// Free extents: start -> length, coalesced (no two touch).
    free: BTreeMap<DevPtr, usize>,
}

impl Slab {
    fn end(&self, base: DevPtr) -> DevPtr {
        base + self.size as u64
    }
}

#[derive(Default)]
pub struct AddressSpace {
    slabs: BTreeMap<DevPtr, Slab>,
}

impl AddressSpace {
    /// `size` bytes (a multiple of `granularity`) of address space on `device`: the lowest free place in the
    /// device's slabs, or the start of a new slab (of `SLAB_BYTES`, or exactly `size` when larger).
    pub fn alloc(
        &mut self,
        driver: &dyn Driver,
        device: i32,
        size: usize,
        granularity: usize,
    ) -> Result<DevPtr> {
        debug_assert!(size > 0 && size.is_multiple_of(granularity));
        let found = self
            .slabs
            .iter()
            .filter(|(_, s)| s.device == device && s.size - s.used >= size)
            .find_map(|(_, s)| {
                s.free
                    .iter()
                    .find(|(_, len)| **len >= size)
                    .map(|(start, _)| *start)
            });
        if let Some(addr) = found {
            self.take(addr, size);
            return Ok(addr);
        }
        let slab_size = SLAB_BYTES.next_multiple_of(granularity).max(size);
        let base = driver.reserve(device, slab_size)?;
        self.slabs.insert(
            base,
            Slab {
                device,
                size: slab_size,
                used: 0,
                free: BTreeMap::from([(base, slab_size)]),
            },
        );
        self.take(base, size);
        Ok(base)
    }

    /// Cut [addr, addr+size) out of the free extent that starts at `addr`.
    fn take(&mut self, addr: DevPtr, size: usize) {
        let slab = self.slab_mut(addr).expect("inside a slab");
        let len = slab.free.remove(&addr).expect("a free extent starts here");
        debug_assert!(len >= size);
        if len > size {
            slab.free.insert(addr + size as u64, len - size);
        }
        slab.used += size;
    }

    /// Give back [addr, addr+size), which was handed out (by one `alloc` or several adjacent ones). Returns the
    /// slab it emptied, `(base, size)`, for the caller to free with the driver; the slab is forgotten here.
    pub fn free(&mut self, addr: DevPtr, size: usize) -> Option<(DevPtr, usize)> {
        let base = self.slab_base(addr)?;
        let slab = self.slabs.get_mut(&base).expect("found");
        debug_assert!(addr + size as u64 <= slab.end(base));
        let mut start = addr;
        let mut len = size;
        if let Some((&s, &l)) = slab.free.range(..addr).next_back() {
            debug_assert!(
                s + l as u64 <= addr,
                "double free of address space at {addr:#x}"
            );
            if s + l as u64 == addr {
                slab.free.remove(&s);
                start = s;
                len += l;
            }
        }
        if let Some(l) = slab.free.remove(&(addr + size as u64)) {
            len += l;
        }
        slab.free.insert(start, len);
        slab.used -= size;
        if slab.used == 0 {
            let size = slab.size;
            self.slabs.remove(&base);
            return Some((base, size));
        }
        None
    }

    fn slab_base(&self, addr: DevPtr) -> Option<DevPtr> {
        let (&base, slab) = self.slabs.range(..=addr).next_back()?;
        (addr < slab.end(base)).then_some(base)
    }

    fn slab_mut(&mut self, addr: DevPtr) -> Option<&mut Slab> {
        let base = self.slab_base(addr)?;
        self.slabs.get_mut(&base)
    }

    /// Whether two addresses lie in the same reservation (one mapping may cover both).
    pub fn same_slab(&self, a: DevPtr, b: DevPtr) -> bool {
        self.slab_base(a)
            .is_some_and(|s| Some(s) == self.slab_base(b))
    }

    /// Whether `next` starts where [prev, prev+prev_size) ends, in the same reservation (so on the same device):
    /// one mapping, or one copy, may cover both.
    pub fn continues(&self, prev: DevPtr, prev_size: usize, next: DevPtr) -> bool {
        prev + prev_size as u64 == next && self.same_slab(prev, next)
    }

    /// How many slabs are reserved.
    pub fn slabs(&self) -> usize {
        self.slabs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::{SimConfig, SimDriver};

    const G: usize = 2 << 20;

    #[test]
    fn allocations_in_order_are_neighbours_and_share_a_slab() {
        let sim = SimDriver::new(SimConfig::default()).unwrap();
        let mut vas = AddressSpace::default();
        let a = vas.alloc(&sim, 0, G, G).unwrap();
        let b = vas.alloc(&sim, 0, 3 * G, G).unwrap();
        let c = vas.alloc(&sim, 0, G, G).unwrap();
        assert_eq!((b, c), (a + G as u64, a + 4 * G as u64));
        assert!(vas.same_slab(a, c));
        assert_eq!(vas.slabs(), 1);
        // A hole is reused first-fit; freeing coalesces so a bigger request fits where two were.
        assert_eq!(vas.free(b, 3 * G), None);
        assert_eq!(vas.alloc(&sim, 0, G, G).unwrap(), b);
        assert_eq!(vas.free(b, G), None);
        assert_eq!(vas.free(a, G), None);
        assert_eq!(vas.alloc(&sim, 0, 4 * G, G).unwrap(), a, "a..c coalesced");
        assert_eq!(vas.free(a, 4 * G), None);
        let slab = vas.free(c, G).expect("the last free empties the slab");
        assert_eq!(slab, (a, SLAB_BYTES));
        assert_eq!(vas.slabs(), 0);
        sim.free_range(slab.0, slab.1).unwrap();
    }

    #[test]
    fn devices_and_large_allocations_get_their_own_slabs() {
        let sim = SimDriver::new(SimConfig {
            devices: 2,
            ..SimConfig::default()
        })
        .unwrap();
        let mut vas = AddressSpace::default();
        let a = vas.alloc(&sim, 0, G, G).unwrap();
        let b = vas.alloc(&sim, 1, G, G).unwrap();
        assert!(!vas.same_slab(a, b));
        let big = vas.alloc(&sim, 0, SLAB_BYTES + G, G).unwrap();
        assert!(!vas.same_slab(a, big));
        assert_eq!(vas.slabs(), 3);
        assert_eq!(vas.free(big, SLAB_BYTES + G), Some((big, SLAB_BYTES + G)));
        for (addr, base) in [(a, vas.free(a, G)), (b, vas.free(b, G))] {
            let (base, size) = base.expect("emptied");
            assert_eq!((base, size), (addr, SLAB_BYTES));
            sim.free_range(base, size).unwrap();
        }
        sim.free_range(big, SLAB_BYTES + G).unwrap();
    }

    #[test]
    fn a_refused_reserve_changes_nothing() {
        let sim = SimDriver::new(SimConfig::default()).unwrap();
        let mut vas = AddressSpace::default();
        sim.inject_fault(crate::driver::Op::Reserve, 1, 2).unwrap();
        assert!(vas.alloc(&sim, 0, G, G).is_err());
        assert_eq!(vas.slabs(), 0);
        let a = vas.alloc(&sim, 0, G, G).unwrap();
        let (base, size) = vas.free(a, G).unwrap();
        sim.free_range(base, size).unwrap();
    }
}
