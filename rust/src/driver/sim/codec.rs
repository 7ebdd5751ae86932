//! The emulator's `DeviceCodec`: the host codec of `sim_codec.rs` over the emulator's own checked copies.
//!
//! The host side is checked as the CUDA codec's copies would be: a sleep copies each blob (in pieces) into the
//! place the store gave, and a wake copies blobs that `joins_previous` says lie back to back as one range, so each
//! such range must stay inside one host registration (CUDA refuses an async copy that spans two).

use super::{cuda_err, Emulator};
use crate::driver::codec::{DataKind, DeviceCodec, DoneFn, PlaceFn, ReadyFn, RestoreItem, Stored};
use crate::driver::sim_codec::{compress_ranges, decompress_items};
use crate::driver::{DevPtr, Op};
use crate::error::{cuda_code, Result};

impl Emulator {
    /// The host range `[ptr, ptr+len)` as one async copy of `op` would see it.
    fn check_host_range(&self, op: Op, ptr: usize, len: usize) -> Result<()> {
        if self.state.lock().host.range_ok(ptr, len) {
            Ok(())
        } else {
            Err(cuda_err(
                op,
                cuda_code::INVALID_VALUE,
                "blob spans host registrations",
            ))
        }
    }
}

/// The emulator's codec (`Driver::codec` hands it out while `SimConfig::compress` is on).
impl DeviceCodec for Emulator {
    fn describe(&self) -> String {
        "sim: zstd level 1 on the host, 16-bit byte split for bf16/fp16".to_string()
    }

    fn compress_to_host(
        &self,
        device: i32,
        ranges: &[(DevPtr, usize)],
        kind: DataKind,
        place: &mut PlaceFn<'_>,
        done: &mut DoneFn<'_>,
    ) -> Result<Vec<Stored>> {
        let mut checked = |i: usize, len: usize| {
            let dst = place(i, len)?;
            self.check_host_range(Op::Compress, dst.0, len)?;
            Ok(dst)
        };
        compress_ranges(
            self,
            self.codec_counts(),
            device,
            ranges,
            kind,
            &mut checked,
            done,
        )
    }

    fn decompress_from_host(
        &self,
        device: i32,
        items: &[RestoreItem],
        ready: &mut ReadyFn<'_>,
    ) -> Result<()> {
        // Each run of joined blobs, as the CUDA codec copies it.
        let mut run: Option<(usize, usize)> = None;
        for it in items {
            let joined = run.filter(|(start, len)| it.joins_previous && start + len == it.src.0);
            if it.joins_previous && joined.is_none() {
                return Err(cuda_err(
                    Op::Decompress,
                    cuda_code::INVALID_VALUE,
                    "a blob said to join the previous one does not follow it",
                ));
            }
            let (start, len) = match joined {
                Some((start, len)) => (start, len + it.stored.len),
                None => (it.src.0, it.stored.len),
            };
            self.check_host_range(Op::Decompress, start, len)?;
            run = Some((start, len));
        }
        decompress_items(self, self.codec_counts(), device, items, ready)
    }
}
