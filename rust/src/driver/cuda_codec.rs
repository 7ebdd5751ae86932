//! The CUDA driver's `DeviceCodec`: nvCOMP's batched ANS (`nvcomp.rs`) over a bounded device staging ring.
//!
//! Each device that nvCOMP serves gets, at set-up (with the fingerprint kernel's buffer, before its first
//! allocation, counted in `own_device_bytes`), one device allocation cut into `SLOTS` slots, a temporary area
//! for nvCOMP, a pinned host table per slot and a stream of its own for nvCOMP's kernels. A slot holds one batch:
//! up to `chunks` nvCOMP chunks of `CHUNK` raw bytes (a 2 MiB range is 8 of them), their compressed bytes and
//! the device tables nvCOMP reads (chunk pointers, sizes) and writes (sizes, statuses).
//!
//! Sleep (`compress`): per batch of whole ranges, compress on the codec stream into a slot, read the compressed
//! sizes back, then queue the device->host copies of each blob (our header + the chunks, `blob.rs`)
//! on the copy stream to where the store's `place` says, and go on with the next batch in the next slot while
//! those copies run. A range whose blob would not be below `RAW_RATIO` of its size is copied raw from where it
//! lies. Wake (`decompress`): every blob's header is checked on the host first; then per batch the blobs are
//! copied host->device into a slot on the copy stream while the codec stream decompresses the previous slot
//! straight into the destination ranges. A slot is reused only once the work that used it has finished
//! (an event per slot), so the ring bounds the device memory whatever the size of the sleep.
//!
//! Every nvCOMP status and every actual size is checked: any failure is an `Err` naming the operation. On any
//! error both streams are drained before returning, so no copy still writes into memory the caller reclaims.

use std::ffi::c_void;

use cudarc::driver::sys;
use parking_lot::Mutex;

mod blob;
mod copies;
mod sleep;
mod wake;

use super::codec::{DataKind, RestoreItem};
use super::cuda_check::check;
use super::nvcomp::{self, NvComp};
use super::{DevPtr, HostPtr};
use crate::error::{cuda_code, Error, Result};
use blob::{round_up, ALIGN};

/// Raw bytes per nvCOMP chunk unless `CUMEM_RS_NVCOMP_CHUNK_KIB` says otherwise. The H200 prototype: 64 KiB gave
/// ratio 0.685 on bf16, 256 KiB 0.666 and faster kernels both ways. The whole cycle on the H200 (15 GiB of bf16,
/// session 8): 1 MiB woke in 207 ms against 240 ms at 256 KiB (1.41x of the link against 1.21x), slept as fast,
/// held the same host bytes, and a quarter of the copies again.
const DEFAULT_CHUNK_KIB: usize = 1024;

/// Raw bytes per nvCOMP chunk, for the process (read once): a power of two from 64 KiB to 2 MiB.
pub(super) fn chunk() -> usize {
    static CHUNK: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CHUNK.get_or_init(|| {
        let kib = crate::env::process_var(crate::env::NVCOMP_CHUNK_KIB);
        match kib.as_deref().map(|v| v.trim().parse::<usize>()) {
            None => DEFAULT_CHUNK_KIB << 10,
            Some(Ok(k)) if k.is_power_of_two() && (64..=2048).contains(&k) => k << 10,
            Some(_) => {
                log::warn!(
                    "CUMEM_RS_NVCOMP_CHUNK_KIB is not a power of two from 64 to 2048; using {DEFAULT_CHUNK_KIB}"
                );
                DEFAULT_CHUNK_KIB << 10
            }
        }
    })
}
/// Slots of the ring: one being filled, one being copied, one spare so the copy stream never waits for the CPU.
const SLOTS: usize = 3;
/// Device bytes of the ring unless `CUMEM_RS_NVCOMP_RING_MIB` says otherwise: about 32 MiB of raw bytes per
/// batch, so a copy (0.6 ms at 55 GB/s) is long against the few tens of microseconds a batch costs the CPU.
const DEFAULT_RING_MIB: usize = 96;
/// A slot holds at least one whole 2 MiB range.
fn min_slot_chunks() -> usize {
    (2 << 20) / chunk()
}
/// Alignment of every device area; blobs are copied to such offsets, so their 16-byte offsets stay aligned.
const DEVICE_ALIGN: usize = 256;
/// Per chunk of a slot, room beyond its compressed bytes for the blob header and the alignment of the blob
/// that holds it (a wake batch packs whole blobs).
const SLACK_PER_CHUNK: usize = 2 * DEVICE_ALIGN;
/// Host table fields, in u64 words of `chunks` entries each; statuses (i32) follow.
const IN_PTRS: usize = 0;
const IN_BYTES: usize = 1;
const OUT_PTRS: usize = 2;
const OUT_BYTES: usize = 3;
const ACTUAL: usize = 4;
const STATUS_FIELD: usize = 5;

const OP_COMPRESS: &str = "nvcomp compress";
const OP_DECOMPRESS: &str = "nvcomp decompress";

/// The nvCOMP data type of a kind, and the byte width every chunk's length must be a multiple of.
fn data_type(kind: DataKind) -> (i32, usize) {
    match kind {
        DataKind::Bytes => (nvcomp::TYPE_CHAR, 1),
        DataKind::Bits8 => (nvcomp::TYPE_FLOAT8_E4M3, 1),
        DataKind::Bits16 => (nvcomp::TYPE_FLOAT16, 2),
    }
}

fn codec_error(op: &'static str, why: String) -> Error {
    Error::driver(op, cuda_code::UNKNOWN, why)
}

/// One slot of the ring.
struct Slot {
    /// Compressed chunks: `chunks` strides of `stride` bytes, plus slack.
    area: u64,
    /// Device copy of the table.
    table: u64,
    /// Pinned host table (same layout).
    host: *mut u8,
    /// Recorded after the last work that uses the slot (its copies out at sleep, its decompression at wake).
    done: sys::CUevent,
    /// Wake: recorded on the copy stream once the slot's blobs are on the device.
    loaded: sys::CUevent,
    /// Wake: the raw size each chunk of the slot's batch must decompress to, checked once `done` passed.
    pending: Vec<usize>,
    /// The device's address of `host` (pinned memory is mapped): at sleep nvCOMP writes the compressed sizes and
    /// statuses straight there, so reading them back waits for the kernel alone, not for a copy queued behind
    /// the previous batches' device->host copies (which a table copy would be: H200, 0.28 ms per batch, the
    /// sleep bound by that wait instead of the link).
    host_dev: u64,
}

/// The ring's geometry and memory; the mutex makes one sleep or wake at a time use it.
struct Work {
    slots: Vec<Slot>,
}

/// The codec's state on one device. Lives as long as the device state (the process); dropping it (a set-up that
/// failed half-way) gives everything back.
pub(super) struct CodecRing {
    nv: &'static NvComp,
    /// The device (ordinal), for the copies' location hints.
    ordinal: i32,
    /// Whether a sleep batch's copies go out in one `cuMemcpyBatchAsync` (`copies.rs`).
    batch_copies: bool,
    /// Whether nvCOMP writes a sleep's sizes and statuses into the mapped host table (`Slot::host_dev`); off when
    /// the self-check failed that way or `CUMEM_RS_NVCOMP_MAPPED_SIZES=0`.
    mapped_sizes: bool,
    /// nvCOMP's kernels run here, so that they overlap the copy stream's copies.
    stream: sys::CUstream,
    /// Chunks per slot.
    chunks: usize,
    /// Device bytes between two chunks' outputs in a slot (nvCOMP's maximum output of a chunk, aligned).
    stride: usize,
    /// Bytes of a slot's area.
    area_bytes: usize,
    temp: u64,
    temp_bytes: usize,
    /// The one device allocation (0 while not taken) and its size; the pinned host tables.
    device_base: u64,
    device_bytes: usize,
    host_base: *mut u8,
    work: Mutex<Work>,
}

// SAFETY: the raw handles are process-wide CUDA objects; the host tables and slots are only touched under `work`.
unsafe impl Send for CodecRing {}
// SAFETY: as above: every mutation goes through the mutex.
unsafe impl Sync for CodecRing {}

fn ring_bytes() -> usize {
    let mib =
        crate::env::process_var(crate::env::NVCOMP_RING_MIB).map(|v| v.trim().parse::<usize>());
    match mib {
        None => DEFAULT_RING_MIB << 20,
        Some(Ok(m)) if m > 0 => m << 20,
        Some(_) => {
            log::warn!("CUMEM_RS_NVCOMP_RING_MIB is not a positive number of MiB; using {DEFAULT_RING_MIB}");
            DEFAULT_RING_MIB << 20
        }
    }
}

impl CodecRing {
    /// Take the ring on the device whose context is current and check nvCOMP round-trips a chunk of each data
    /// type through it (which also makes nvCOMP load its kernels now, not inside the first sleep). Any failure
    /// gives back what was taken: the device then has no codec.
    pub(super) fn prepare(nv: &'static NvComp, ordinal: i32) -> Result<CodecRing> {
        let types = [
            nvcomp::TYPE_CHAR,
            nvcomp::TYPE_FLOAT8_E4M3,
            nvcomp::TYPE_FLOAT16,
        ];
        let mut max_out = 0;
        for ty in types {
            let a = nv.alignments(ty)?;
            if a.input > ALIGN || a.output > DEVICE_ALIGN || a.temp > DEVICE_ALIGN {
                return Err(codec_error(
                    "nvcomp set-up",
                    format!("nvCOMP asks for alignments {a:?}, more than the codec provides"),
                ));
            }
            max_out = max_out.max(nv.max_output_chunk_size(chunk(), ty)?);
        }
        let stride = round_up(max_out, DEVICE_ALIGN);
        let chunks = (ring_bytes() / SLOTS / (stride + SLACK_PER_CHUNK)).max(min_slot_chunks());
        let mut temp_bytes = 0;
        for ty in types {
            temp_bytes = temp_bytes.max(nv.temp_size(chunks, chunk(), ty)?);
        }
        let area_bytes = chunks * (stride + SLACK_PER_CHUNK);
        let table_bytes = round_up(table_len(chunks), DEVICE_ALIGN);
        let device_bytes =
            SLOTS * (area_bytes + table_bytes) + round_up(temp_bytes.max(1), DEVICE_ALIGN);

        let mut ring = CodecRing {
            nv,
            ordinal,
            batch_copies: copies::batch_available(),
            mapped_sizes: crate::env::flag(crate::env::NVCOMP_MAPPED_SIZES, true),
            stream: std::ptr::null_mut(),
            chunks,
            stride,
            area_bytes,
            temp: 0,
            temp_bytes,
            device_base: 0,
            device_bytes,
            host_base: std::ptr::null_mut(),
            work: Mutex::new(Work { slots: Vec::new() }),
        };
        // From here on a failure drops `ring`, which frees whatever was taken so far.
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the device's context is current (set-up).
        unsafe {
            check(
                "cuStreamCreate",
                sys::cuStreamCreate(
                    &mut ring.stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                ),
            )?;
            check(
                "cuMemAlloc",
                sys::cuMemAlloc_v2(&mut ring.device_base, device_bytes),
            )?;
            check(
                "cuMemAllocHost",
                sys::cuMemAllocHost_v2(&mut host, SLOTS * table_bytes),
            )?;
        }
        ring.host_base = host as *mut u8;
        let mut host_dev: sys::CUdeviceptr = 0;
        // SAFETY: `host` is our pinned allocation; valid out-pointer.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut host_dev, host, 0) };
        if mapped != sys::CUresult::CUDA_SUCCESS {
            ring.mapped_sizes = false;
        }
        ring.temp = ring.device_base + (SLOTS * (area_bytes + table_bytes)) as u64;
        let work = ring.work.get_mut();
        for s in 0..SLOTS {
            let mut slot = Slot {
                area: ring.device_base + (s * area_bytes) as u64,
                table: ring.device_base + (SLOTS * area_bytes + s * table_bytes) as u64,
                // SAFETY: inside the pinned allocation of SLOTS * table_bytes bytes.
                host: unsafe { ring.host_base.add(s * table_bytes) },
                host_dev: host_dev + (s * table_bytes) as u64,
                done: std::ptr::null_mut(),
                loaded: std::ptr::null_mut(),
                pending: Vec::new(),
            };
            let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
            // SAFETY: valid out-pointers. Pushed before checking, so that Drop destroys whichever was made.
            let made = unsafe {
                check("cuEventCreate", sys::cuEventCreate(&mut slot.done, flags)).and_then(|()| {
                    check("cuEventCreate", sys::cuEventCreate(&mut slot.loaded, flags))
                })
            };
            work.slots.push(slot);
            made?;
        }
        if ring.mapped_sizes {
            if let Err(e) = ring.self_check() {
                log::info!("nvCOMP: sizes written to mapped host memory failed the self-check ({e}); read back by copy");
                ring.mapped_sizes = false;
            }
        }
        if !ring.mapped_sizes {
            ring.self_check()?;
        }
        Ok(ring)
    }

    /// Device bytes the ring holds.
    pub(super) fn device_bytes(&self) -> usize {
        self.device_bytes
    }

    /// A round trip of one small range in each data type through the real paths: a device range inside the last
    /// slot (single batches use only the first) compressed into host memory and restored next to it, compared.
    fn self_check(&self) -> Result<()> {
        // A full chunk and a short one: nvCOMP may pick kernels by chunk size, and every kernel a sleep or wake
        // will launch should be loaded (its memory taken) now, at set-up.
        let n = chunk() + (64 << 10);
        let base = self.work.lock().slots[SLOTS - 1].area;
        let (src, dst) = (base, base + n as u64);
        let pattern = weight_like_pattern(n);
        // SAFETY: [src, src+n) is inside our allocation; `pattern` holds n bytes; synchronous copy.
        unsafe {
            check(
                "cuMemcpyHtoD",
                sys::cuMemcpyHtoD_v2(src, pattern.as_ptr() as *const c_void, n),
            )?
        };
        // Pinned, as the store's memory is, so that the copies take the path of a real sleep.
        let host = PinnedScratch::new(n)?;
        let host_ptr = HostPtr(host.0 as usize);
        for kind in [DataKind::Bytes, DataKind::Bits8, DataKind::Bits16] {
            let stored = self.compress(
                self.stream,
                &[(src, n)],
                kind,
                &mut |_, _| Ok(host_ptr),
                &mut |_, _| Ok(()),
            )?;
            if stored[0].raw {
                return Err(codec_error(
                    OP_COMPRESS,
                    format!("self-check: {kind:?} did not compress"),
                ));
            }
            let item = RestoreItem {
                src: host_ptr,
                stored: stored[0],
                dst,
                raw_len: n,
                kind,
                joins_previous: false,
            };
            self.decompress(self.stream, &[item], &mut |_| Ok(()))?;
            let mut back = vec![0u8; n];
            // SAFETY: `back` holds n bytes; synchronous copy from our allocation.
            unsafe {
                check(
                    "cuMemcpyDtoH",
                    sys::cuMemcpyDtoH_v2(back.as_mut_ptr() as *mut c_void, dst, n),
                )?
            };
            if back != pattern {
                return Err(codec_error(
                    OP_DECOMPRESS,
                    format!("self-check: {kind:?} round trip differs"),
                ));
            }
        }
        Ok(())
    }

    /// Chunks of `range` when compressed, or 0 when it is stored raw without trying: empty, not aligned for
    /// nvCOMP, not whole elements of the data type, or larger than a slot (the trait's ranges never are).
    fn chunks_of(&self, (addr, len): (DevPtr, usize), width: usize) -> usize {
        let n = len.div_ceil(chunk());
        let fits = len > 0 && len <= u32::MAX as usize && n <= self.chunks;
        if fits && (addr as usize).is_multiple_of(ALIGN) && len.is_multiple_of(width) {
            n
        } else {
            0
        }
    }

    /// Wait for both streams (the copy stream first: the codec stream may wait on it), keep the first error.
    fn drain(&self, _work: &mut Work, copy: sys::CUstream) -> Result<()> {
        // SAFETY: our own streams.
        let (a, b) = unsafe {
            (
                sys::cuStreamSynchronize(copy),
                sys::cuStreamSynchronize(self.stream),
            )
        };
        check("cuStreamSynchronize", a).and(check("cuStreamSynchronize", b))
    }

    fn put(&self, slot: &Slot, field: usize, i: usize, v: u64) {
        assert!(field < STATUS_FIELD && i < self.chunks);
        // SAFETY: inside the slot's pinned table (table_len(chunks) bytes); the caller owns the slot (ring lock,
        // its `done` passed), so no copy reads or writes the table now.
        unsafe {
            (slot.host as *mut u64)
                .add(field * self.chunks + i)
                .write(v)
        }
    }

    fn get(&self, slot: &Slot, field: usize, i: usize) -> u64 {
        assert!(field < STATUS_FIELD && i < self.chunks);
        // SAFETY: as in `put`; read once the stream that wrote it has passed.
        unsafe {
            (slot.host as *const u64)
                .add(field * self.chunks + i)
                .read()
        }
    }

    fn status(&self, slot: &Slot, i: usize) -> nvcomp::Status {
        assert!(i < self.chunks);
        // SAFETY: statuses (i32) follow the u64 fields inside the slot's pinned table; read after the stream passed.
        unsafe {
            (slot.host.add(STATUS_FIELD * 8 * self.chunks) as *const i32)
                .add(i)
                .read()
        }
    }

    /// Queue on the codec stream the copy of table fields [first, end) to the device.
    ///
    /// # Safety
    /// The slot's host table is not written until the codec stream passed the copy.
    unsafe fn h2d_table(&self, slot: &Slot, first: usize, end: usize) -> Result<()> {
        let (off, len) = (first * 8 * self.chunks, (end - first) * 8 * self.chunks);
        // SAFETY: both ranges lie inside the slot's tables (the caller's contract for the host side).
        unsafe {
            h2d(
                slot.table + off as u64,
                slot.host as usize + off,
                len,
                self.stream,
            )
        }
    }

    /// Queue on the codec stream the copy of table fields [first, STATUS] (sizes, statuses) back to the host.
    ///
    /// # Safety
    /// The slot's host table is not read until the codec stream passed the copy.
    unsafe fn d2h_table(&self, slot: &Slot, first: usize) -> Result<()> {
        let off = first * 8 * self.chunks;
        let len = table_len(self.chunks) - off;
        // SAFETY: both ranges lie inside the slot's tables (the caller's contract for the host side).
        unsafe {
            d2h(
                slot.host as usize + off,
                slot.table + off as u64,
                len,
                self.stream,
            )
        }
    }
}

impl Drop for CodecRing {
    fn drop(&mut self) {
        // SAFETY: only what `prepare` took, once; nothing is in flight once the stream is synchronized (the
        // copy stream's work on the ring was drained by every call). Errors cannot be acted upon here.
        unsafe {
            if !self.stream.is_null() {
                sys::cuStreamSynchronize(self.stream);
            }
            for slot in &self.work.get_mut().slots {
                for ev in [slot.done, slot.loaded] {
                    if !ev.is_null() {
                        sys::cuEventDestroy_v2(ev);
                    }
                }
            }
            if !self.host_base.is_null() {
                sys::cuMemFreeHost(self.host_base as *mut c_void);
            }
            if self.device_base != 0 {
                sys::cuMemFree_v2(self.device_base);
            }
            if !self.stream.is_null() {
                sys::cuStreamDestroy_v2(self.stream);
            }
        }
    }
}

/// Pinned host memory for the self-check, freed when dropped.
struct PinnedScratch(*mut c_void);

impl PinnedScratch {
    fn new(len: usize) -> Result<Self> {
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer; a context is current (set-up).
        unsafe { check("cuMemAllocHost", sys::cuMemAllocHost_v2(&mut p, len))? };
        Ok(PinnedScratch(p))
    }
}

impl Drop for PinnedScratch {
    fn drop(&mut self) {
        // SAFETY: allocated by `new`, freed once; the self-check's calls are synchronous, so no copy uses it.
        unsafe { sys::cuMemFreeHost(self.0) };
    }
}

/// Bytes like small bf16 weights (high bytes from a few exponents, low bytes varied), which compress in every
/// mode: the self-check's data.
fn weight_like_pattern(n: usize) -> Vec<u8> {
    let mut x: u32 = 0x9e37_79b9;
    (0..n)
        .map(|i| {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let r = (x >> 24) as u8;
            if i % 2 == 1 {
                [0x3c, 0xbc, 0x3b, 0xbb][(r & 3) as usize]
            } else {
                r
            }
        })
        .collect()
}

/// Bytes of one slot's table: five u64 fields and the i32 statuses, `chunks` entries each.
fn table_len(chunks: usize) -> usize {
    STATUS_FIELD * 8 * chunks + 4 * chunks
}

fn chunk_failure(nv: &NvComp, op: &'static str, status: nvcomp::Status, at: u64) -> Error {
    codec_error(
        op,
        format!(
            "chunk at {at:#x}: nvCOMP status {status} ({})",
            nv.status_name(status)
        ),
    )
}

fn event_sync(ev: sys::CUevent) -> Result<()> {
    // SAFETY: one of our events (never recorded yet counts as passed).
    unsafe { check("cuEventSynchronize", sys::cuEventSynchronize(ev)) }
}

fn record(ev: sys::CUevent, stream: sys::CUstream) -> Result<()> {
    // SAFETY: our event, a live stream.
    unsafe { check("cuEventRecord", sys::cuEventRecord(ev, stream)) }
}

/// # Safety
/// `[dst, dst+len)` is host memory valid for writes until `stream` has passed the copy.
unsafe fn d2h(dst: usize, src: u64, len: usize, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract; the driver validates the device range.
    unsafe {
        check(
            "cuMemcpyDtoHAsync",
            sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, stream),
        )
    }
}

/// # Safety
/// `[src, src+len)` is host memory valid for reads, unchanged until `stream` has passed the copy.
unsafe fn h2d(dst: u64, src: usize, len: usize, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract; the driver validates the device range.
    unsafe {
        check(
            "cuMemcpyHtoDAsync",
            sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, stream),
        )
    }
}

/// What the codec is, for `DeviceCodec::describe`.
pub(super) fn describe(nv: &NvComp) -> String {
    let (a, b, c) = nv.version;
    format!(
        "nvCOMP {a}.{b}.{c} ANS ({} KiB chunks) from {}",
        chunk() >> 10,
        nv.origin
    )
}

/// The error of a codec call on a device that has no ring (`why`: what its set-up said).
pub(super) fn no_ring(compressing: bool, device: i32, why: &str) -> Error {
    let op = if compressing {
        OP_COMPRESS
    } else {
        OP_DECOMPRESS
    };
    codec_error(op, format!("no nvCOMP codec on device {device}: {why}"))
}
