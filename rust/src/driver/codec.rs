//! Lossless compression of backed-up device memory, as a driver offers it (`Driver::codec`).
//!
//! A codec turns device ranges into stored blobs in host memory at sleep and back at wake. It lives at the
//! driver layer because the real one (nvCOMP's batched ANS, `cuda_codec.rs`) works on device pointers and the
//! driver's streams; the simulated driver's works on the host. The backup store decides what to compress and
//! where the blobs go (its arenas); it never looks inside a blob.
//!
//! A blob is private to the codec that wrote it (its own header, its own sub-chunks): only the same codec
//! instance restores it. A range that does not shrink below `RAW_RATIO` of its size is stored raw, and the
//! blob says so (`Stored::raw`), so incompressible data costs one copy, as without a codec.

use super::{DevPtr, HostPtr};
use crate::error::Result;

/// Above this ratio of stored to raw bytes a range is stored raw: compressing it would save too little to pay
/// for the decompression at wake.
pub const RAW_RATIO: f64 = 0.95;

/// What the bytes of a range hold, which picks the codec's mode (nvCOMP's ANS: 16-bit for bf16/fp16, 8-bit for
/// fp8, bytes for anything else). A wrong kind costs ratio, never correctness.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DataKind {
    /// Any data: entropy coded byte by byte.
    Bytes,
    /// 16-bit floats (bf16, fp16): the high byte (sign, exponent) and the low byte coded apart.
    Bits16,
    /// 8-bit floats (fp8 e4m3/e5m2).
    Bits8,
}

/// One range as stored: `len` bytes written at the host address the store gave for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    /// Bytes of the blob in host memory (the raw size when `raw`).
    pub len: usize,
    /// The range's bytes as they are, uncompressed (the codec restores them with a plain copy).
    pub raw: bool,
}

/// `decompress_from_host`'s hook: called with an item's index before its range is written.
pub type ReadyFn<'a> = dyn FnMut(usize) -> Result<()> + 'a;

/// One blob to restore at wake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreItem {
    /// Where the blob is in host memory.
    pub src: HostPtr,
    /// What `compress_to_host` returned for it.
    pub stored: Stored,
    /// The device range it restores (the same length as the range it was made from).
    pub dst: DevPtr,
    pub raw_len: usize,
    pub kind: DataKind,
    /// The blob starts where the previous item's ends, in the same pinned host piece: the codec may copy both
    /// in one copy (one that spanned two registrations would be refused).
    pub joins_previous: bool,
}

/// Where a codec's blob goes: asked once per range, in order, with the blob's length; returns the host address
/// to write it to (pinned memory of the store's, live until the store drops the backup).
pub type PlaceFn<'a> = dyn FnMut(usize, usize) -> Result<HostPtr> + 'a;

/// `compress_to_host`'s hook: called with a range's index and what it was stored as once its blob is wholly in
/// host memory (its copies finished), in order, once per range. From then on the caller may release the range's
/// device memory, though the call goes on with the ranges after it. An error from it ends the call with that error.
pub type DoneFn<'a> = dyn FnMut(usize, Stored) -> Result<()> + 'a;

/// Compression of device ranges into host memory and back. Both calls are synchronous: they return when every
/// byte is where it belongs (they may pipeline inside, over a bounded staging ring of their own).
pub trait DeviceCodec: Send + Sync {
    /// What it is and where it comes from, for `info()` and logs ("nvCOMP 6.0.0 ANS from /path/libnvcomp.so.6").
    fn describe(&self) -> String;

    /// Device memory on `device` the codec holds for itself (its staging ring, temporary buffers), part of
    /// `Driver::own_device_bytes`.
    fn own_device_bytes(&self, _device: i32) -> usize {
        0
    }

    /// Compress the device ranges `ranges` ((addr, len) on `device`, each at most 2 MiB; the device work that
    /// wrote them has finished) and write each blob where `place(index, blob_len)` says, telling `done` of each
    /// blob as it is complete. On error the blobs `done` was told of are complete and usable; nothing else placed
    /// may be used (the caller falls back to raw copies for those ranges).
    fn compress_to_host(
        &self,
        device: i32,
        ranges: &[(DevPtr, usize)],
        kind: DataKind,
        place: &mut PlaceFn<'_>,
        done: &mut DoneFn<'_>,
    ) -> Result<Vec<Stored>>;

    /// Restore every item's blob into its device range. `ready(i)` is called for each item, in order, before
    /// anything that writes item `i`'s range is queued: the caller may map that range only then, so that its maps
    /// run while the items before it are copied and decompressed; an error from it ends the call with that
    /// error. On error the device ranges hold undefined bytes (the caller fails the wake and keeps the blobs); the
    /// blobs themselves are never changed.
    fn decompress_from_host(
        &self,
        device: i32,
        items: &[RestoreItem],
        ready: &mut ReadyFn<'_>,
    ) -> Result<()>;
}
