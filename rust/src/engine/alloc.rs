//! Malloc and free: an allocation's first and last transitions.

use super::{Engine, Inner};
use crate::driver::DevPtr;
use crate::error::{Error, Result};
use crate::registry::{Allocation, Backing, State};
use crate::tags;

impl Engine {
    /// Allocate `size` bytes on `device` under this thread's current tag. A failed malloc leaves nothing behind.
    pub fn malloc(&self, size: usize, device: i32, stream: u64) -> Result<DevPtr> {
        let gran = self.granularity(device)?;
        if size == 0 {
            return Err(Error::invalid("size must be positive"));
        }
        let rounded = size
            .checked_next_multiple_of(gran)
            .filter(|r| *r <= isize::MAX as usize)
            .ok_or_else(|| Error::OutOfMemory {
                what: format!("malloc of {size} bytes"),
            })?;
        let tag = tags::current_tag(self.id);
        let mut locked = self.lock_open()?;
        let inner = &mut *locked;
        self.retry_pending(inner);
        let addr = inner.vas.alloc(&*self.driver, device, rounded, gran)?;
        let handle = match self.map_new(inner, device, addr, rounded) {
            Ok(h) => h,
            Err(e) => {
                self.return_address(inner, addr, rounded);
                return Err(e);
            }
        };
        inner.reg.insert(Allocation {
            addr,
            size: rounded,
            requested: size,
            device,
            tag,
            stream,
            state: State::Awake {
                backing: Backing::Own(handle),
            },
        });
        inner.counters.mallocs += 1;
        Self::note_peak(inner);
        Ok(addr)
    }

    /// Free a live allocation, awake or asleep. A release that fails after the unmap is queued and recorded, not
    /// raised: the allocation is gone either way. A failed synchronize or unmap is raised with the allocation
    /// still live (the caller may try again).
    pub fn free(&self, addr: DevPtr) -> Result<()> {
        let mut locked = self.lock_open()?;
        let inner = &mut *locked;
        self.retry_pending(inner);
        self.free_locked(inner, addr, false)
    }

    /// Free for a caller that forgets the pointer whatever happens (torch, through `my_free`). Where `free` would
    /// raise with the allocation still live, this records the failure in `errors()` and queues the unmap,
    /// release and address free for retry by later calls: the allocation is gone either way, so it is never
    /// backed up again, and nothing leaks once the driver recovers. Fails only when nothing was done (unknown
    /// address, closed or poisoned allocator).
    pub fn free_or_queue(&self, addr: DevPtr) -> Result<()> {
        let mut locked = self.lock_open()?;
        let inner = &mut *locked;
        self.retry_pending(inner);
        self.free_locked(inner, addr, true)
    }

    pub(super) fn free_locked(
        &self,
        inner: &mut Inner,
        addr: DevPtr,
        queue_failures: bool,
    ) -> Result<()> {
        let a = inner
            .reg
            .get(addr)
            .ok_or(Error::UnknownAddress(addr))?
            .clone();
        // Asleep: nothing is mapped. A group member's addresses go back with its group.
        let mut return_address = true;
        if let State::Awake { backing } = a.state {
            // The caller's work on this memory must be finished before it is unmapped (a no-op during capture).
            let done = self
                .driver
                .synchronize(a.device, a.stream)
                .and_then(|()| match backing {
                    Backing::Own(_) => self.driver.unmap(a.addr, a.size),
                    Backing::Group(id) => self.free_member(inner, id, a.addr, a.size),
                });
            return_address = matches!((&done, backing), (Ok(()), Backing::Own(_)));
            match (done, backing) {
                (Ok(()), Backing::Own(handle)) => self.release_or_queue(inner, handle),
                (Ok(()), Backing::Group(_)) => {}
                (Err(e), _) if !queue_failures => return Err(e),
                (Err(e), Backing::Own(handle)) => {
                    inner.log.record(
                        &format!("free {addr:#x} (its unmap, release and address free are queued for retry)"),
                        &e,
                    );
                    inner.pending.queue_release(a.addr, a.size, handle);
                }
                (Err(e), Backing::Group(id)) => {
                    self.drop_member_queued(inner, id, a.addr, a.size, &e)
                }
            }
        }
        inner.reg.remove(addr);
        if return_address {
            self.return_address(inner, a.addr, a.size);
        }
        inner.counters.frees += 1;
        // Its backup if asleep, its retained backup and prints if awake; arenas nothing uses go back.
        inner.backups.forget(&[addr], &mut inner.log);
        Ok(())
    }
}
