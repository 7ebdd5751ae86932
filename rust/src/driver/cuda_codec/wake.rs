//! Wake through the ring: every blob's header checked on the host first, then blobs copied host->device into a
//! slot on the copy stream while the codec stream decompresses the previous slot into the destination ranges
//! (see the parent module).

use std::time::Instant;

use cudarc::driver::sys;

use super::blob::{round_up, Header, ALIGN};
use super::{
    chunk, chunk_failure, codec_error, event_sync, h2d, record, CodecRing, Slot, Work, ACTUAL,
    DEVICE_ALIGN, IN_BYTES, IN_PTRS, OP_DECOMPRESS, OUT_BYTES, OUT_PTRS, SLOTS, STATUS_FIELD,
};
use crate::driver::codec::{ReadyFn, RestoreItem};
use crate::driver::cuda_check::check;
use crate::driver::nvcomp;
use crate::error::Result;
use crate::timing::Phases;

impl CodecRing {
    /// Restore `items` (the trait's `decompress_from_host`).
    pub(in crate::driver) fn decompress(
        &self,
        copy: sys::CUstream,
        items: &[RestoreItem],
        ready: &mut ReadyFn<'_>,
    ) -> Result<()> {
        let mut phases = Phases::new("nvcomp decompress");
        let t = Instant::now();
        // Every header is checked before anything is queued: a damaged blob fails the wake with the device
        // untouched.
        let headers = items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                self.read_header(item)
                    .map_err(|why| codec_error(OP_DECOMPRESS, format!("blob {i}: {why}")))
            })
            .collect::<Result<Vec<_>>>()?;
        phases.add("headers", t);
        let mut work = self.work.lock();
        let result = self.decompress_locked(&mut work, copy, items, &headers, ready, &mut phases);
        let t = Instant::now();
        let drained = self.drain(&mut work, copy);
        let t = phases.add("drain", t);
        // Once drained every batch has run: check those whose statuses were not read yet.
        let checked =
            drained.and_then(|()| work.slots.iter_mut().try_for_each(|s| self.check_slot(s)));
        work.slots.iter_mut().for_each(|s| s.pending.clear());
        phases.add("check", t);
        phases.log();
        result.and(checked)
    }

    /// The header of a compressed item (None for a raw one), checked against what the item says.
    fn read_header(&self, item: &RestoreItem) -> std::result::Result<Option<Header>, String> {
        if item.stored.raw {
            return if item.stored.len == item.raw_len {
                Ok(None)
            } else {
                Err(format!(
                    "raw blob of {} bytes for {} bytes",
                    item.stored.len, item.raw_len
                ))
            };
        }
        if item.stored.len > self.area_bytes {
            return Err(format!(
                "{} bytes, more than a blob of this codec can be",
                item.stored.len
            ));
        }
        // SAFETY: the store keeps the blob's `stored.len` bytes at `src` alive and unchanged during the wake.
        let blob = unsafe { std::slice::from_raw_parts(item.src.0 as *const u8, item.stored.len) };
        let header = Header::parse(blob, item.raw_len, chunk(), self.stride)?;
        // The blob names its data type; decompression uses it, whatever kind the caller passes now.
        if header.sizes.len() > self.chunks {
            return Err(format!(
                "{} chunks, more than a batch holds",
                header.sizes.len()
            ));
        }
        if !(item.dst as usize).is_multiple_of(ALIGN) {
            return Err(format!(
                "destination {:#x} is not aligned for nvCOMP",
                item.dst
            ));
        }
        Ok(Some(header))
    }

    fn decompress_locked(
        &self,
        work: &mut Work,
        copy: sys::CUstream,
        items: &[RestoreItem],
        headers: &[Option<Header>],
        ready: &mut ReadyFn<'_>,
        phases: &mut Phases,
    ) -> Result<()> {
        // Items whose destination the caller was told about (`ready`), each once, in order.
        let mut told = 0;
        let mut tell = |upto: usize, phases: &mut Phases| -> Result<()> {
            let t = Instant::now();
            while told <= upto {
                ready(told)?;
                told += 1;
            }
            phases.add("ready", t);
            Ok(())
        };
        let (mut i, mut batch) = (0, 0);
        let (mut n_copies, mut stored_in) = (0usize, 0usize);
        while i < items.len() {
            let Some(first) = &headers[i] else {
                tell(i, phases)?;
                raw_copy(&items[i], copy)?;
                i += 1;
                continue;
            };
            let ty = first.data_type;
            let slot = &mut work.slots[batch % SLOTS];
            // The slot's previous decompression finished reading its area and table: check it, then reuse.
            let t = Instant::now();
            event_sync(slot.done)?;
            let t = phases.add("slot wait", t);
            self.check_slot(slot)?;
            let t = phases.add("check", t);
            let (mut used, mut c) = (0usize, 0usize);
            // Blobs lying back to back in one pinned piece (`joins_previous`, as the store places them) go over in
            // one copy: the device keeps their host offsets from one another, so each chunk stays 16-byte aligned.
            // H200: one copy per 1.4 MiB blob moved 46 GB/s where the link moves 52.
            let mut run = Run::default();
            while i < items.len() {
                let item = &items[i];
                match &headers[i] {
                    None => {
                        tell(i, phases)?;
                        raw_copy(item, copy)?;
                    }
                    Some(h) => {
                        let joins = item.joins_previous && run.follows(item.src.0);
                        let at = match joins {
                            true => used,
                            false => round_up(used, DEVICE_ALIGN),
                        };
                        let full =
                            c + h.sizes.len() > self.chunks || at + h.blob_len() > self.area_bytes;
                        if h.data_type != ty || full {
                            break;
                        }
                        tell(i, phases)?;
                        let to = slot.area + at as u64;
                        if !joins {
                            n_copies += run.flush(copy)?;
                            run = Run {
                                src: item.src.0,
                                dst: to,
                                len: 0,
                            };
                        }
                        run.len += h.blob_len();
                        stored_in += h.blob_len();
                        for (j, off) in h.offsets().into_iter().enumerate() {
                            self.put(slot, IN_PTRS, c, to + off as u64);
                            self.put(slot, IN_BYTES, c, h.sizes[j] as u64);
                            self.put(slot, OUT_PTRS, c, item.dst + (j * chunk()) as u64);
                            self.put(slot, OUT_BYTES, c, h.chunk_raw_len(j) as u64);
                            slot.pending.push(h.chunk_raw_len(j));
                            c += 1;
                        }
                        used = at + h.blob_len();
                    }
                }
                i += 1;
            }
            n_copies += run.flush(copy)?;
            if c == 0 {
                // Cannot happen (every blob fits an empty slot, read_header); never loop on it.
                return Err(codec_error(
                    OP_DECOMPRESS,
                    "a blob did not fit an empty slot".into(),
                ));
            }
            let t = phases.add("queue copies", t);
            let field = |f: usize| slot.table + (f * 8 * self.chunks) as u64;
            // SAFETY: the codec stream waits for the blobs' copies (`loaded`); tables, area and temp are ours and
            // free (the slot's `done` passed); the destination ranges are mapped ranges of the caller's, aligned
            // (read_header), each chunk's output buffer inside its range.
            unsafe {
                record(slot.loaded, copy)?;
                check(
                    OP_DECOMPRESS,
                    sys::cuStreamWaitEvent(self.stream, slot.loaded, 0),
                )?;
                self.h2d_table(slot, 0, ACTUAL)?;
                self.nv.decompress(
                    ty,
                    field(IN_PTRS),
                    field(IN_BYTES),
                    field(OUT_BYTES),
                    field(ACTUAL),
                    c,
                    self.temp,
                    self.temp_bytes,
                    field(OUT_PTRS),
                    field(STATUS_FIELD),
                    self.stream,
                )?;
                self.d2h_table(slot, ACTUAL)?;
            }
            record(slot.done, self.stream)?;
            phases.add("decompress launch", t);
            batch += 1;
        }
        phases.note(format!(
            "{batch} batches, {n_copies} blob copies of {stored_in} bytes"
        ));
        Ok(())
    }

    /// Check the statuses and actual sizes of the slot's finished decompression, if one is pending.
    fn check_slot(&self, slot: &mut Slot) -> Result<()> {
        let expected = std::mem::take(&mut slot.pending);
        for (c, want) in expected.into_iter().enumerate() {
            let (status, got) = (self.status(slot, c), self.get(slot, ACTUAL, c) as usize);
            if status != nvcomp::SUCCESS {
                return Err(chunk_failure(
                    self.nv,
                    OP_DECOMPRESS,
                    status,
                    self.get(slot, OUT_PTRS, c),
                ));
            }
            if got != want {
                let at = self.get(slot, OUT_PTRS, c);
                return Err(codec_error(
                    OP_DECOMPRESS,
                    format!("chunk at {at:#x} restored {got} bytes of {want}"),
                ));
            }
        }
        Ok(())
    }
}

/// Queue the plain copy of a raw blob into its range on the copy stream.
fn raw_copy(item: &RestoreItem, copy: sys::CUstream) -> Result<()> {
    if item.raw_len == 0 {
        return Ok(());
    }
    // SAFETY: the raw blob's `raw_len` bytes (read_header checked its length) are live and unchanged during the
    // wake (the store's contract); the destination range is mapped.
    unsafe { h2d(item.dst, item.src.0, item.raw_len, copy) }
}

/// Blobs back to back in host memory, copied to the device as one range.
#[derive(Default)]
struct Run {
    src: usize,
    dst: u64,
    len: usize,
}

impl Run {
    /// Whether a blob at `src` continues this run.
    fn follows(&self, src: usize) -> bool {
        self.len > 0 && src == self.src + self.len
    }

    /// Queue the run's copy (if any); the copies queued.
    fn flush(&mut self, copy: sys::CUstream) -> Result<usize> {
        if self.len == 0 {
            return Ok(0);
        }
        // SAFETY: the run's blobs are live (the store's contract) and lie back to back from `src`; the slot's
        // area has room for all of them from `dst` (each was checked against the area when it joined) and is
        // not read by earlier work any more (the slot's `done` was waited for).
        unsafe { h2d(self.dst, self.src, self.len, copy)? };
        self.len = 0;
        Ok(1)
    }
}
