//! What is mapped where, as the emulator's calls check it: the reserved range of an address, whether a range is
//! wholly mapped and accessible (what CUDA requires of every copy, fill and kernel), the host side of a copy, the
//! host budget, and when a released handle's memory goes back.

use super::{cuda_err, Range, State};
use crate::driver::{DevPtr, Op};
use crate::error::{cuda_code, Result};

impl State {
    /// The reserved range that wholly contains [addr, addr+size).
    pub(super) fn range_of(&self, addr: u64, size: usize) -> Option<(u64, &Range)> {
        let (&start, range) = self.ranges.range(..=addr).next_back()?;
        (addr + size as u64 <= start + range.size as u64).then_some((start, range))
    }

    /// True when [addr, addr+size) is covered by accessible mappings without holes.
    pub(super) fn accessible(&self, addr: u64, size: usize) -> bool {
        let Some((_, range)) = self.range_of(addr, size) else {
            return false;
        };
        let end = addr + size as u64;
        let mut cursor = addr;
        if let Some((&s, m)) = range.maps.range(..=addr).next_back() {
            if s + m.size as u64 > addr && m.accessible {
                cursor = s + m.size as u64;
            } else {
                return false;
            }
        }
        for (&s, m) in range.maps.range(addr + 1..end) {
            if s != cursor || !m.accessible {
                return false;
            }
            cursor = s + m.size as u64;
        }
        cursor >= end
    }

    /// What both copy directions check, as CUDA would reject them: the device side (`role`: "source" or
    /// "destination") is mapped and accessible, and the host side stays inside one registration.
    pub(super) fn check_copy(
        &self,
        op: Op,
        device_side: DevPtr,
        role: &str,
        host: usize,
        size: usize,
    ) -> Result<()> {
        if !self.accessible(device_side, size) {
            return Err(cuda_err(
                op,
                cuda_code::INVALID_VALUE,
                &format!("{role} not mapped"),
            ));
        }
        if !self.host.range_ok(host, size) {
            return Err(cuda_err(
                op,
                cuda_code::INVALID_VALUE,
                "host range spans registrations",
            ));
        }
        Ok(())
    }

    /// Fail `op` as CUDA does when pinning `size` more host bytes would pass the budget.
    pub(super) fn check_host_budget(
        &self,
        op: Op,
        size: usize,
        budget: Option<usize>,
    ) -> Result<()> {
        match budget {
            Some(b) if self.host.pinned().saturating_add(size) > b => Err(cuda_err(
                op,
                cuda_code::OUT_OF_MEMORY,
                "simulated host memory budget",
            )),
            _ => Ok(()),
        }
    }

    pub(super) fn drop_handle_if_done(&mut self, handle: u64) {
        let done = self
            .handles
            .get(&handle)
            .is_some_and(|h| h.released && h.map_count == 0);
        if done {
            let h = self.handles.remove(&handle).expect("checked above");
            self.used[h.device as usize] -= h.size;
            self.slices[h.device as usize].give_back(h.offset, h.size);
        }
    }
}
