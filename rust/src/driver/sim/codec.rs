//! The emulator's `DeviceCodec`: the host codec of `sim_codec.rs` over the emulator's own checked copies.

use super::Emulator;
use crate::driver::codec::{DataKind, DeviceCodec, PlaceFn, ReadyFn, RestoreItem, Stored};
use crate::driver::sim_codec::{compress_ranges, decompress_items};
use crate::driver::DevPtr;
use crate::error::Result;

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
    ) -> Result<Vec<Stored>> {
        compress_ranges(self, self.codec_counts(), device, ranges, kind, place)
    }

    fn decompress_from_host(
        &self,
        device: i32,
        items: &[RestoreItem],
        ready: &mut ReadyFn<'_>,
    ) -> Result<()> {
        decompress_items(self, self.codec_counts(), device, items, ready)
    }
}
