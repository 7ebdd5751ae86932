//! Sleep through the ring: ranges compressed batch by batch into slots on the codec stream, their blobs copied
//! device->host on the copy stream while the next batch compresses (see the parent module). Once a slot's copies
//! are waited for (the slot being reused, or the drain at the end), its ranges are complete and `done` is told
//! while the next batch's kernels run, so the caller releases their device memory under the codec (the CPU
//! drives the batches: work of its own between a batch's launch and its sizes would add to every batch).

use std::time::Instant;

use cudarc::driver::sys;

use super::blob::Header;
use super::copies::D2hCopies;
use super::{
    chunk, chunk_failure, codec_error, data_type, event_sync, record, CodecRing, Slot, Work,
    IN_BYTES, IN_PTRS, OP_COMPRESS, OUT_BYTES, OUT_PTRS, SLOTS, STATUS_FIELD,
};
use crate::driver::codec::{DataKind, DoneFn, PlaceFn, Stored, RAW_RATIO};
use crate::driver::cuda_check::check;
use crate::driver::{nvcomp, DevPtr};
use crate::error::Result;
use crate::timing::Phases;

/// How many ranges `done` was told of, in order.
#[derive(Default)]
pub(super) struct Told(usize);

impl Told {
    /// Tell `done` of every range before `end` not yet told.
    fn upto(&mut self, end: usize, stored: &[Stored], done: &mut DoneFn<'_>) -> Result<()> {
        while self.0 < end {
            done(self.0, stored[self.0])?;
            self.0 += 1;
        }
        Ok(())
    }
}

impl CodecRing {
    /// Compress `ranges` to host blobs (the trait's `compress_to_host`), `copy` being the device's copy stream.
    pub(in crate::driver) fn compress(
        &self,
        copy: sys::CUstream,
        ranges: &[(DevPtr, usize)],
        kind: DataKind,
        place: &mut PlaceFn<'_>,
        done: &mut DoneFn<'_>,
    ) -> Result<Vec<Stored>> {
        let mut phases = Phases::new("nvcomp compress");
        let mut work = self.work.lock();
        let mut told = Told::default();
        let result = self.compress_locked(
            &mut work,
            copy,
            ranges,
            kind,
            place,
            done,
            &mut told,
            &mut phases,
        );
        // Synchronous by contract, and on error no copy may still write into placed memory.
        let t = Instant::now();
        let drained = self.drain(&mut work, copy);
        let t = phases.add("drain", t);
        let stored = result.and_then(|stored| drained.map(|()| stored));
        // Every copy has finished: the rest are complete.
        let stored = stored.and_then(|stored| {
            told.upto(stored.len(), &stored, done)?;
            Ok(stored)
        });
        phases.add("done", t);
        phases.log();
        stored
    }

    #[allow(clippy::too_many_arguments)]
    fn compress_locked(
        &self,
        work: &mut Work,
        copy: sys::CUstream,
        ranges: &[(DevPtr, usize)],
        kind: DataKind,
        place: &mut PlaceFn<'_>,
        done: &mut DoneFn<'_>,
        told: &mut Told,
        phases: &mut Phases,
    ) -> Result<Vec<Stored>> {
        let (ty, width) = data_type(kind);
        let (mut raw_in, mut stored_out, mut n_copies) = (0usize, 0usize, 0usize);
        let mut stored = Vec::with_capacity(ranges.len());
        let mut copies = D2hCopies::default();
        let (mut start, mut batch) = (0, 0);
        // Where each batch's ranges end, for `done` once its slot's copies were waited for.
        let mut ends = Vec::new();
        while start < ranges.len() {
            // A batch: the next whole ranges whose chunks fit one slot (at least one range: raw ones count 0).
            let (mut end, mut chunks) = (start, 0);
            while end < ranges.len() && chunks + self.chunks_of(ranges[end], width) <= self.chunks {
                chunks += self.chunks_of(ranges[end], width);
                end += 1;
            }
            let slot = &work.slots[batch % SLOTS];
            // The copies out of this slot's previous batch are done: its area and table may be reused.
            let t = Instant::now();
            event_sync(slot.done)?;
            phases.add("slot wait", t);
            // The slot's previous batch (waited for above) is complete: told while this batch compresses.
            let mut tell = |phases: &mut Phases| -> Result<()> {
                if batch >= SLOTS {
                    let t = Instant::now();
                    told.upto(ends[batch - SLOTS], &stored, done)?;
                    phases.add("done", t);
                }
                Ok(())
            };
            let sizes = if chunks > 0 {
                let batch_ranges = &ranges[start..end];
                self.compress_batch(slot, ty, batch_ranges, width, chunks, phases, &mut tell)?
            } else {
                tell(phases)?;
                Vec::new()
            };
            let mut t = Instant::now();
            let mut c = 0;
            for (i, &(addr, len)) in ranges.iter().enumerate().take(end).skip(start) {
                let n = self.chunks_of((addr, len), width);
                let header = Header {
                    data_type: ty,
                    raw_len: len,
                    chunk: chunk(),
                    sizes: sizes[c..c + n].to_vec(),
                };
                let worth = n > 0 && (header.blob_len() as f64) <= RAW_RATIO * len as f64;
                if worth {
                    let blob_len = header.blob_len();
                    let dst = place(i, blob_len)?;
                    t = phases.add("place", t);
                    (raw_in, stored_out) = (raw_in + len, stored_out + blob_len);
                    let bytes = header.encode();
                    // SAFETY: `place` gave `blob_len` bytes of pinned host memory for this blob; the header is its
                    // first bytes, and no copy of ours writes there.
                    unsafe {
                        std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.0 as *mut u8, bytes.len())
                    };
                    for (j, off) in header.offsets().into_iter().enumerate() {
                        let from = slot.area + ((c + j) * self.stride) as u64;
                        copies.push(dst.0 + off, from, header.sizes[j]);
                    }
                    stored.push(Stored {
                        len: blob_len,
                        raw: false,
                    });
                } else {
                    let dst = place(i, len)?;
                    t = phases.add("place", t);
                    (raw_in, stored_out) = (raw_in + len, stored_out + len);
                    copies.push(dst.0, addr, len);
                    stored.push(Stored { len, raw: true });
                }
                c += n;
            }
            t = phases.add("blob headers", t);
            n_copies += copies.len();
            // SAFETY: each blob chunk's compressed bytes lie in the slot (written by the batch, which the CPU waited
            // for) and fit its blob at its offset (blob_len counts them); each raw range is the caller's, mapped, and
            // `place` gave its length; the slot is not reused before `done`, recorded after these copies.
            unsafe { copies.queue(copy, self.ordinal, self.batch_copies)? };
            record(slot.done, copy)?;
            phases.add("queue copies", t);
            ends.push(end);
            start = end;
            batch += 1;
        }
        phases.note(format!(
            "{batch} batches, {n_copies} copies, {raw_in} -> {stored_out} bytes"
        ));
        Ok(stored)
    }

    /// Compress the chunks of `ranges` (`chunks` of them) into `slot` and return their compressed sizes; `meanwhile`
    /// runs on the CPU while the kernels do (an error from it is returned once they finished).
    #[allow(clippy::too_many_arguments)]
    fn compress_batch(
        &self,
        slot: &Slot,
        ty: i32,
        ranges: &[(DevPtr, usize)],
        width: usize,
        chunks: usize,
        phases: &mut Phases,
        meanwhile: &mut dyn FnMut(&mut Phases) -> Result<()>,
    ) -> Result<Vec<usize>> {
        let t = Instant::now();
        let mut c = 0;
        for &(addr, len) in ranges {
            for j in 0..self.chunks_of((addr, len), width) {
                let off = j * chunk();
                self.put(slot, IN_PTRS, c, addr + off as u64);
                self.put(slot, IN_BYTES, c, chunk().min(len - off) as u64);
                self.put(slot, OUT_PTRS, c, slot.area + (c * self.stride) as u64);
                c += 1;
            }
        }
        debug_assert_eq!(c, chunks);
        let field = |f: usize| slot.table + (f * 8 * self.chunks) as u64;
        // Sizes and statuses: into the mapped host table directly, or on the device and copied back.
        let out = |f: usize| match self.mapped_sizes {
            true => slot.host_dev + (f * 8 * self.chunks) as u64,
            false => field(f),
        };
        // SAFETY: the host table was filled above and is not touched until the stream synchronize below; the
        // device table, slot area and temp are ours and used by nothing else (the ring's lock, the slot's `done`
        // waited for); the input chunks are mapped ranges of the caller's, aligned (chunks_of); the mapped host
        // table is pinned memory of ours, read only after the synchronize.
        unsafe {
            self.h2d_table(slot, 0, OUT_BYTES)?;
            self.nv.compress(
                ty,
                field(IN_PTRS),
                field(IN_BYTES),
                chunk(),
                chunks,
                self.temp,
                self.temp_bytes,
                field(OUT_PTRS),
                out(OUT_BYTES),
                out(STATUS_FIELD),
                self.stream,
            )?;
            if !self.mapped_sizes {
                self.d2h_table(slot, OUT_BYTES)?;
            }
            phases.add("compress launch", t);
        }
        let during = meanwhile(phases);
        let t = Instant::now();
        // SAFETY: our own stream; synchronized whatever `meanwhile` returned, before the slot is read or reused.
        unsafe { check(OP_COMPRESS, sys::cuStreamSynchronize(self.stream))? };
        phases.add("compress sync", t);
        during?;
        (0..chunks)
            .map(|c| {
                let (status, size) = (self.status(slot, c), self.get(slot, OUT_BYTES, c) as usize);
                if status != nvcomp::SUCCESS {
                    Err(chunk_failure(
                        self.nv,
                        OP_COMPRESS,
                        status,
                        self.get(slot, IN_PTRS, c),
                    ))
                } else if size == 0 || size > self.stride {
                    Err(codec_error(
                        OP_COMPRESS,
                        format!("nvCOMP reported {size} compressed bytes for a chunk"),
                    ))
                } else {
                    Ok(size)
                }
            })
            .collect()
    }
}
