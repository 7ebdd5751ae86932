//! Releases after the point of no return: failed unmaps, releases and address frees are queued and retried by
//! later calls, so nothing leaks once the driver recovers.

use crate::address_space::AddressSpace;
use crate::driver::{DevPtr, Driver, PhysHandle};
use crate::error::Error;
use crate::error_log::ErrorLog;

/// A driver release that failed after the point of no return, retried by later calls.
#[derive(Debug, Clone, Copy)]
enum Pending {
    Unmap {
        addr: DevPtr,
        size: usize,
    },
    Release(PhysHandle),
    /// Give an allocation's addresses back to the address space (after its queued unmap).
    ReturnAddress {
        addr: DevPtr,
        size: usize,
    },
    /// Free a whole reservation (an emptied slab).
    FreeRange {
        addr: DevPtr,
        size: usize,
    },
}

impl Pending {
    /// Retry order: unmaps before releases before address returns before address frees.
    fn rank(&self) -> u8 {
        match self {
            Pending::Unmap { .. } => 0,
            Pending::Release(_) => 1,
            Pending::ReturnAddress { .. } => 2,
            Pending::FreeRange { .. } => 3,
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct PendingReleases {
    queue: Vec<Pending>,
}

impl PendingReleases {
    pub(super) fn len(&self) -> usize {
        self.queue.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    pub(super) fn unmap_or_queue(
        &mut self,
        driver: &dyn Driver,
        log: &mut ErrorLog,
        addr: DevPtr,
        size: usize,
    ) {
        if let Err(e) = driver.unmap(addr, size) {
            log.record(&format!("unmap {addr:#x} (queued for retry)"), &e);
            self.queue.push(Pending::Unmap { addr, size });
        }
    }

    pub(super) fn release_or_queue(
        &mut self,
        driver: &dyn Driver,
        log: &mut ErrorLog,
        handle: PhysHandle,
    ) {
        if let Err(e) = driver.release(handle) {
            self.retry_release(log, handle, &e);
        }
    }

    /// A release of `handle` that failed with `e`: recorded, and queued for retry.
    pub(super) fn retry_release(&mut self, log: &mut ErrorLog, handle: PhysHandle, e: &Error) {
        log.record("release of a physical handle (queued for retry)", e);
        self.queue.push(Pending::Release(handle));
    }

    /// Give [addr, addr+size) back to the address space; a slab it empties is freed (or queued for retry).
    /// While an unmap of any of it is still queued the addresses are not free: the return is queued behind it.
    pub(super) fn return_address(
        &mut self,
        driver: &dyn Driver,
        log: &mut ErrorLog,
        vas: &mut AddressSpace,
        addr: DevPtr,
        size: usize,
    ) {
        if self.still_mapped(addr, size) {
            self.queue.push(Pending::ReturnAddress { addr, size });
            return;
        }
        if let Some((base, slab_size)) = vas.free(addr, size) {
            if let Err(e) = driver.free_range(base, slab_size) {
                log.record(&format!("address free {base:#x} (queued for retry)"), &e);
                self.queue.push(Pending::FreeRange {
                    addr: base,
                    size: slab_size,
                });
            }
        }
    }

    /// Queue the whole release of an allocation whose unmap could not be done now: unmap, release of its
    /// handle, return of its addresses, retried in that order by later calls.
    pub(super) fn queue_release(&mut self, addr: DevPtr, size: usize, handle: PhysHandle) {
        self.queue.extend([
            Pending::Unmap { addr, size },
            Pending::Release(handle),
            Pending::ReturnAddress { addr, size },
        ]);
    }

    /// Retry queued releases in order (unmaps before releases before address frees); keep those that fail again.
    pub(super) fn retry(
        &mut self,
        driver: &dyn Driver,
        log: &mut ErrorLog,
        vas: &mut AddressSpace,
    ) {
        if self.queue.is_empty() {
            return;
        }
        let mut queued = std::mem::take(&mut self.queue);
        queued.sort_by_key(Pending::rank);
        for p in queued {
            let r = match p {
                Pending::Unmap { addr, size } => driver.unmap(addr, size),
                Pending::Release(h) => driver.release(h),
                Pending::ReturnAddress { addr, size } => {
                    // Queued again if its unmap failed again above (unmaps are retried first).
                    self.return_address(driver, log, vas, addr, size);
                    Ok(())
                }
                Pending::FreeRange { addr, size } => driver.free_range(addr, size),
            };
            if r.is_err() {
                self.queue.push(p);
            }
        }
    }

    /// Whether an unmap still queued overlaps [addr, addr+size).
    fn still_mapped(&self, addr: DevPtr, size: usize) -> bool {
        self.queue.iter().any(|p| match *p {
            Pending::Unmap { addr: a, size: n } => a < addr + size as u64 && addr < a + n as u64,
            _ => false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::{SimConfig, SimDriver};
    use crate::driver::Op;

    const GRAN: usize = 64 << 10;

    #[test]
    fn a_refused_release_is_retried_in_order_and_addresses_wait_for_their_unmap() {
        let sim = SimDriver::new(SimConfig {
            granularity: GRAN,
            ..SimConfig::default()
        })
        .unwrap();
        let (mut q, mut log, mut vas) = (
            PendingReleases::default(),
            ErrorLog::default(),
            AddressSpace::default(),
        );
        let addr = vas.alloc(&sim, 0, GRAN, GRAN).unwrap();
        let h = sim.create(0, GRAN).unwrap();
        sim.map(addr, GRAN, h).unwrap();
        sim.inject_fault(Op::Unmap, 1, 999).unwrap();
        q.unmap_or_queue(&sim, &mut log, addr, GRAN);
        q.release_or_queue(&sim, &mut log, h);
        q.return_address(&sim, &mut log, &mut vas, addr, GRAN);
        assert_eq!(q.len(), 2, "unmap queued, return queued behind it");
        assert_eq!(log.recorded(), 1);
        // The addresses are not handed out again while their unmap is queued.
        let other = vas.alloc(&sim, 0, GRAN, GRAN).unwrap();
        assert_ne!(other, addr);
        q.retry(&sim, &mut log, &mut vas);
        assert!(q.is_empty());
        assert_eq!(
            vas.alloc(&sim, 0, GRAN, GRAN).unwrap(),
            addr,
            "returned after the retry"
        );
    }
}
