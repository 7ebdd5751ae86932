//! The emulator's copy streams, ordered as CUDA orders them: a copy, fill or fingerprint batch is queued on its
//! device's stream and runs only when the stream is waited for (`wait`, `synchronize`, `wait_marker` of a
//! marker recorded after it), in the order queued. So a path that releases memory before waiting for the work
//! that uses it fails here as it fails on a GPU, instead of passing because the work already ran at queue time.
//!
//! What CUDA reports as CUDA_ERROR_ILLEGAL_ADDRESS (700), sticky for the whole context, the emulator reports the
//! same way (`State::poison`): every later call fails with it, and the first message (printed to stderr once)
//! names the work and the ranges involved:
//! - queued work that finds, when it runs, its device range unmapped or its pinned host range unpinned;
//! - `unmap` of device memory, `host_unregister` / `host_free` of host memory, that queued work still touches
//!   (caught where it happens, so the message says which call was early);
//! - the user touching device memory (`Driver::user_device_access`: the engine's read, write and prints) that
//!   queued work writes, or writes to it while queued work reads it: a call returned before its copies finished;
//! - a fingerprint batch taken before the stream passed it.
//!
//! With `SimConfig::stream_order` off, every piece of work runs as it is queued (the emulator's old behaviour).

use std::collections::VecDeque;

use super::{cuda_err, State};
use crate::driver::{DevPtr, Op};
use crate::error::{cuda_code, Error, Result};
use crate::fingerprint::{self, Fingerprint};

/// One piece of work on a copy stream. `pinned`: the host side lay in pinned memory when it was queued, so it
/// must still when it runs (pageable memory cannot be checked).
pub(super) enum Work {
    D2H {
        dst: usize,
        src: DevPtr,
        size: usize,
        pinned: bool,
    },
    H2D {
        dst: DevPtr,
        src: usize,
        size: usize,
        pinned: bool,
    },
    Memset {
        addr: DevPtr,
        size: usize,
    },
    Fingerprints {
        chunks: Vec<(DevPtr, usize)>,
    },
    Marker(u64),
}

/// A fingerprint batch: queued, or computed once its stream passed it.
pub(super) enum Batch {
    Queued,
    Done(Vec<Fingerprint>),
}

fn overlaps(a: u64, alen: usize, b: u64, blen: usize) -> bool {
    a < b + blen as u64 && b < a + alen as u64
}

impl Work {
    /// The device ranges it touches, each with whether it writes them.
    fn device_ranges(&self) -> Vec<(DevPtr, usize, bool)> {
        match self {
            Work::D2H { src, size, .. } => vec![(*src, *size, false)],
            Work::H2D { dst, size, .. } => vec![(*dst, *size, true)],
            Work::Memset { addr, size } => vec![(*addr, *size, true)],
            Work::Fingerprints { chunks } => chunks.iter().map(|&(a, l)| (a, l, false)).collect(),
            Work::Marker(_) => Vec::new(),
        }
    }

    /// The host range it touches, if any, with whether it writes it.
    fn host_range(&self) -> Option<(usize, usize, bool)> {
        match self {
            Work::D2H { dst, size, .. } => Some((*dst, *size, true)),
            Work::H2D { src, size, .. } => Some((*src, *size, false)),
            _ => None,
        }
    }

    /// The host range of a copy whose host side lay in pinned memory when it was queued: it must still be pinned
    /// when the copy runs.
    fn pinned_host_range(&self) -> Option<(usize, usize)> {
        match self {
            Work::D2H {
                dst,
                size,
                pinned: true,
                ..
            } => Some((*dst, *size)),
            Work::H2D {
                src,
                size,
                pinned: true,
                ..
            } => Some((*src, *size)),
            _ => None,
        }
    }

    fn describe(&self) -> String {
        match self {
            Work::D2H { dst, src, size, .. } => {
                format!("copy_d2h of device [{src:#x}, +{size:#x}) to host {dst:#x}")
            }
            Work::H2D { dst, src, size, .. } => {
                format!("copy_h2d of host [{src:#x}, +{size:#x}) to device {dst:#x}")
            }
            Work::Memset { addr, size } => format!("memset_zero of device [{addr:#x}, +{size:#x})"),
            Work::Fingerprints { chunks } => {
                let lo = chunks.iter().map(|c| c.0).min().unwrap_or(0);
                let hi = chunks.iter().map(|c| c.0 + c.1 as u64).max().unwrap_or(0);
                format!(
                    "fingerprint batch of {} chunks in device [{lo:#x}, {hi:#x})",
                    chunks.len()
                )
            }
            Work::Marker(m) => format!("marker {m}"),
        }
    }
}

/// What `run` runs up to.
#[derive(Clone, Copy)]
pub(super) enum Until {
    /// Everything queued.
    Idle,
    /// Up to and including this marker (nothing when it is not queued: the stream passed it already).
    Marker(u64),
}

impl State {
    /// Fail `op` with the sticky error if the emulated context is poisoned.
    pub(super) fn live(&self, op: Op) -> Result<()> {
        match &self.sticky {
            None => Ok(()),
            Some(first) => Err(cuda_err(
                op,
                cuda_code::ILLEGAL_ADDRESS,
                &format!("sticky since: {first}"),
            )),
        }
    }

    /// Poison the emulated context (CUDA's sticky CUDA_ERROR_ILLEGAL_ADDRESS) with `what`, which says where:
    /// queued work is dropped (a dead context runs nothing more), the first cause is printed once, and `op`'s
    /// error is returned.
    pub(super) fn poison(&mut self, op: Op, what: String) -> Error {
        if self.sticky.is_none() {
            eprintln!(
                "cumem_rs sim: CUDA_ERROR_ILLEGAL_ADDRESS in {}: {what}",
                op.name()
            );
            self.sticky = Some(format!("{}: {what}", op.name()));
        }
        for q in &mut self.streams {
            q.clear();
        }
        cuda_err(op, cuda_code::ILLEGAL_ADDRESS, &what)
    }

    /// Queue `work` on `device`'s stream (a checked device index); without stream order it runs at once.
    pub(super) fn queue(&mut self, op: Op, device: usize, work: Work, ordered: bool) -> Result<()> {
        self.streams[device].push_back(work);
        if ordered {
            Ok(())
        } else {
            self.run(op, device, Until::Idle)
        }
    }

    /// Run `device`'s stream up to `until`, in order; the first piece that touches memory no longer there poisons
    /// the context (the error of `op`, the waiting call).
    pub(super) fn run(&mut self, op: Op, device: usize, until: Until) -> Result<()> {
        if let Until::Marker(m) = until {
            if !self.streams[device]
                .iter()
                .any(|w| matches!(w, Work::Marker(x) if *x == m))
            {
                return Ok(());
            }
        }
        while let Some(work) = self.streams[device].pop_front() {
            if let Work::Marker(m) = work {
                if matches!(until, Until::Marker(x) if x == m) {
                    break;
                }
                continue;
            }
            if let Err(why) = self.execute(device, &work) {
                let what = format!(
                    "{} queued on device {device}'s copy stream ran after {why}",
                    work.describe()
                );
                return Err(self.poison(op, what));
            }
        }
        Ok(())
    }

    /// Do `work` now, or say why it touches memory that is gone.
    fn execute(&mut self, device: usize, work: &Work) -> std::result::Result<(), String> {
        for (addr, len, _) in work.device_ranges() {
            if !self.accessible(addr, len.max(1)) {
                return Err(format!("device [{addr:#x}, +{len:#x}) was unmapped"));
            }
        }
        if let Some((host, len)) = work.pinned_host_range() {
            if !self.host.pinned_covers(host, len) {
                return Err(format!("host [{host:#x}, +{len:#x}) was unpinned or freed"));
            }
        }
        match *work {
            Work::D2H { dst, src, size, .. } => {
                // SAFETY: the source is mapped read-write (checked above under the state lock, which unmap also
                // takes); the destination is valid for `size` bytes of writes until the stream passed this copy
                // (the contract of `copy_d2h`, the unsafe fn that queued it).
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, size) };
            }
            Work::H2D { dst, src, size, .. } => {
                // SAFETY: as for D2H, with the roles swapped (`copy_h2d`'s contract).
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, size) };
            }
            Work::Memset { addr, size } => {
                // SAFETY: the range is mapped read-write (checked above under the lock).
                unsafe { std::ptr::write_bytes(addr as *mut u8, 0, size) };
            }
            Work::Fingerprints { ref chunks } => {
                let prints = chunks
                    .iter()
                    .map(|&(addr, len)| {
                        // SAFETY: [addr, addr+len) is mapped and accessible (checked above under the lock), so
                        // the bytes are readable while it is held.
                        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
                        fingerprint::fingerprint(bytes)
                    })
                    .collect();
                self.fingerprints.insert(device as i32, Batch::Done(prints));
            }
            Work::Marker(_) => {}
        }
        Ok(())
    }

    /// Poison the context (as `op`, "unmap") when queued work touches device memory [addr, addr+size).
    pub(super) fn nothing_queued_on_device(
        &mut self,
        op: Op,
        addr: DevPtr,
        size: usize,
    ) -> Result<()> {
        match self.queued_on_device(addr, size, |_| true) {
            None => Ok(()),
            Some(work) => {
                let what = format!(
                    "{} of device [{addr:#x}, +{size:#x}) while {work} is unfinished",
                    op.name()
                );
                Err(self.poison(op, what))
            }
        }
    }

    /// Poison the context (as `op`: host_unregister, host_free) when queued work touches host [ptr, ptr+len).
    pub(super) fn nothing_queued_on_host(&mut self, op: Op, ptr: usize, len: usize) -> Result<()> {
        match self.queued_on_host(ptr, len, |_| true) {
            None => Ok(()),
            Some(work) => {
                let name = if op == Op::HostAlloc {
                    "host_free"
                } else {
                    op.name()
                };
                let what =
                    format!("{name} of host [{ptr:#x}, +{len:#x}) while {work} is unfinished");
                Err(self.poison(op, what))
            }
        }
    }

    /// Poison the context when the user's read (or `write`) of device [addr, addr+len) races with queued work:
    /// reading what it writes, or writing what it reads or writes.
    pub(super) fn no_race_with_user(
        &mut self,
        addr: DevPtr,
        len: usize,
        write: bool,
    ) -> Result<()> {
        match self.queued_on_device(addr, len.max(1), |w| w || write) {
            None => Ok(()),
            Some(work) => {
                let how = if write { "write" } else { "read" };
                let what = format!(
                    "data race: the user's {how} of device [{addr:#x}, +{len:#x}) while {work} is unfinished (a \
                     call returned before its copies finished)"
                );
                Err(self.poison(Op::Synchronize, what))
            }
        }
    }

    /// As `no_race_with_user`, for host memory [ptr, ptr+len) the user is handed (a view of a backup).
    pub(super) fn no_race_with_user_on_host(
        &mut self,
        ptr: usize,
        len: usize,
        write: bool,
    ) -> Result<()> {
        match self.queued_on_host(ptr, len.max(1), |w| w || write) {
            None => Ok(()),
            Some(work) => {
                let how = if write { "writable view" } else { "view" };
                let what = format!(
                    "data race: a {how} of host [{ptr:#x}, +{len:#x}) handed to the user while {work} is \
                     unfinished (a call returned before its copies finished)"
                );
                Err(self.poison(Op::Synchronize, what))
            }
        }
    }

    /// The first queued work (with its device) that touches device memory [addr, addr+size) in a way `conflicts`
    /// (given whether the work writes) says matters.
    fn queued_on_device(
        &self,
        addr: DevPtr,
        size: usize,
        conflicts: impl Fn(bool) -> bool,
    ) -> Option<String> {
        self.streams.iter().enumerate().find_map(|(d, q)| {
            q.iter()
                .find(|w| {
                    w.device_ranges()
                        .iter()
                        .any(|&(a, l, writes)| conflicts(writes) && overlaps(a, l, addr, size))
                })
                .map(|w| format!("{} queued on device {d}", w.describe()))
        })
    }

    /// The first queued work (with its device) whose host side overlaps [ptr, ptr+size).
    fn queued_on_host(
        &self,
        ptr: usize,
        size: usize,
        conflicts: impl Fn(bool) -> bool,
    ) -> Option<String> {
        self.streams.iter().enumerate().find_map(|(d, q)| {
            q.iter()
                .find(|w| {
                    w.host_range().is_some_and(|(p, l, writes)| {
                        conflicts(writes) && overlaps(p as u64, l, ptr as u64, size)
                    })
                })
                .map(|w| format!("{} queued on device {d}", w.describe()))
        })
    }

    /// Pieces of work queued on every stream (markers included), for counts.
    pub(super) fn queued(&self) -> usize {
        self.streams.iter().map(VecDeque::len).sum()
    }
}
