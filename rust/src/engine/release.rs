//! Releases after the point of no return: failed unmaps, releases and address frees are queued and retried by
//! later calls, so nothing leaks once the driver recovers. Also the per-device synchronize/wait helpers and the
//! return of host arenas nothing points into any more.

use std::sync::Arc;

use super::{Engine, Inner};
use crate::driver::{DevPtr, PhysHandle};
use crate::error::Result;

/// A driver release that failed after the point of no return, retried by later calls.
#[derive(Debug, Clone, Copy)]
pub(super) enum Pending {
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

impl Engine {
    pub(super) fn unmap_or_queue(&self, inner: &mut Inner, addr: DevPtr, size: usize) {
        if let Err(e) = self.driver.unmap(addr, size) {
            Self::record(inner, &format!("unmap {addr:#x} (queued for retry)"), &e);
            inner.pending.push(Pending::Unmap { addr, size });
        }
    }

    pub(super) fn release_or_queue(&self, inner: &mut Inner, handle: PhysHandle) {
        if let Err(e) = self.driver.release(handle) {
            Self::record(inner, "release of a physical handle (queued for retry)", &e);
            inner.pending.push(Pending::Release(handle));
        }
    }

    pub(super) fn free_range_or_queue(&self, inner: &mut Inner, addr: DevPtr, size: usize) {
        if let Err(e) = self.driver.free_range(addr, size) {
            Self::record(
                inner,
                &format!("address free {addr:#x} (queued for retry)"),
                &e,
            );
            inner.pending.push(Pending::FreeRange { addr, size });
        }
    }

    /// Give [addr, addr+size) back to the address space; a slab it empties is freed (or queued for retry).
    /// While an unmap of any of it is still queued the addresses are not free: the return is queued behind it.
    pub(super) fn return_address(&self, inner: &mut Inner, addr: DevPtr, size: usize) {
        if still_mapped(&inner.pending, addr, size) {
            inner.pending.push(Pending::ReturnAddress { addr, size });
            return;
        }
        if let Some((base, slab_size)) = inner.vas.free(addr, size) {
            self.free_range_or_queue(inner, base, slab_size);
        }
    }

    /// Queue the whole release of an allocation whose unmap could not be done now: unmap, release of its
    /// handle, return of its addresses, retried in that order by later calls.
    pub(super) fn queue_release(
        &self,
        inner: &mut Inner,
        addr: DevPtr,
        size: usize,
        handle: PhysHandle,
    ) {
        inner.pending.extend([
            Pending::Unmap { addr, size },
            Pending::Release(handle),
            Pending::ReturnAddress { addr, size },
        ]);
    }

    /// Retry queued releases in order (unmaps before releases before address frees); keep those that fail again.
    pub(super) fn retry_pending(&self, inner: &mut Inner) {
        if inner.pending.is_empty() {
            return;
        }
        let mut queued = std::mem::take(&mut inner.pending);
        queued.sort_by_key(|p| match p {
            Pending::Unmap { .. } => 0,
            Pending::Release(_) => 1,
            Pending::ReturnAddress { .. } => 2,
            Pending::FreeRange { .. } => 3,
        });
        for p in queued {
            let r = match p {
                Pending::Unmap { addr, size } => self.driver.unmap(addr, size),
                Pending::Release(h) => self.driver.release(h),
                Pending::ReturnAddress { addr, size } => {
                    // Queued again if its unmap failed again above (unmaps are retried first).
                    self.return_address(inner, addr, size);
                    Ok(())
                }
                Pending::FreeRange { addr, size } => self.driver.free_range(addr, size),
            };
            if r.is_err() {
                inner.pending.push(p);
            }
        }
    }

    /// Finish all work that may touch the memory of these allocations' devices.
    pub(super) fn synchronize_devices(&self, inner: &Inner, addrs: &[DevPtr]) -> Result<()> {
        for device in Self::devices_of(inner, addrs) {
            self.driver.synchronize(device, 0)?;
        }
        Ok(())
    }

    pub(super) fn devices_of(inner: &Inner, addrs: &[DevPtr]) -> Vec<i32> {
        let mut devices: Vec<i32> = addrs
            .iter()
            .map(|a| inner.reg.get(*a).expect("selected").device)
            .collect();
        devices.sort_unstable();
        devices.dedup();
        devices
    }

    pub(super) fn wait_devices(
        &self,
        inner: &Inner,
        addrs: &[DevPtr],
        mut result: Result<()>,
    ) -> Result<()> {
        for device in Self::devices_of(inner, addrs) {
            if let Err(e) = self.driver.wait(device) {
                if result.is_ok() {
                    result = Err(e);
                }
            }
        }
        result
    }

    /// Arenas no asleep allocation points into any more go back to the host pool; then the host memory held is
    /// brought back within its bound (hostmem.rs).
    pub(super) fn collect_unused_arenas(&self, inner: &mut Inner) {
        self.give_back_unused_arenas(inner);
        self.bound_host_memory(inner);
    }

    pub(super) fn give_back_unused_arenas(&self, inner: &mut Inner) {
        for arena in std::mem::take(&mut inner.arenas) {
            match Arc::try_unwrap(arena) {
                Ok(buf) => {
                    if let Err(e) = inner.host.give_back(buf) {
                        Self::record(inner, "returning host backup memory", &e);
                    }
                }
                Err(still_used) => inner.arenas.push(still_used),
            }
        }
    }
}

/// Whether an unmap still queued in `pending` overlaps [addr, addr+size).
fn still_mapped(pending: &[Pending], addr: DevPtr, size: usize) -> bool {
    pending.iter().any(|p| match *p {
        Pending::Unmap { addr: a, size: n } => a < addr + size as u64 && addr < a + n as u64,
        _ => false,
    })
}
