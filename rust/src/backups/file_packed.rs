//! Compressed backups in the file tier: a file-tier allocation of a tag that compresses goes device -> codec ->
//! staging slot -> file as blobs, one per fingerprint chunk, and comes back file -> slot -> codec -> device.
//!
//! Sleep (`write_packed`): the chunks of each allocation are fingerprinted first (the prints a wake verifies
//! against), then cut into frames of at most one staging slot of raw bytes. The codec compresses a frame's chunks
//! into a free slot, blobs back to back (a blob is never larger than its chunk: one that does not shrink is
//! stored raw), and a writer thread writes the slot to the file at the allocation's next aligned offset while the
//! codec fills the next slot. The file space was checked and reserved for the raw bytes before anything was
//! released (file_tier.rs); once an allocation's frames are all written, the reserved bytes past its last frame
//! are given back (punched at the end of the sleep), so the disk holds the compressed bytes. After any failure
//! every write in flight is waited for; each allocation is awake with its data or asleep with a complete backup.
//!
//! Wake (`restore_packed_files`): reader threads read runs of back-to-back blobs (at most a slot, aligned for
//! `O_DIRECT`) into slots while the codec restores the runs read before; the wake then verifies the restored
//! chunks against the sleep's prints with every other tier's (verify.rs). A read error, a codec error or a
//! mismatch fails the wake (naming the allocation); the file is never changed, so a later wake can succeed.
//!
//! Retained (retain.rs): such a backup stays bound across a wake like a raw file backup, but blobs of changing
//! lengths cannot be rewritten in place, chunk by chunk. So the next sleep checks it with one fingerprint pass
//! before the tiers are planned (`split_changed_file_packed`): unchanged, it is kept and nothing is written;
//! changed, it is dropped and the allocation written afresh, whole. A backup whose every chunk was stored raw is
//! handed over as a raw file backup instead (its bytes lie as a raw one's would), rewritten in place as usual.

use std::sync::Arc;
use std::time::Instant;

use super::compressed::{decode_on_host, naming, prints_of, HostDecode};
use super::io_workers::{io_len, Workers, IO_THREADS};
use super::spill_file::{SpillFile, SpillIo, IO_ALIGN};
use super::{Backup, FileRegion, Place};
use crate::driver::codec::{DataKind, RestoreItem, Stored};
use crate::driver::{DevPtr, Driver, HostPtr};
use crate::error::{Error, Result};
use crate::fingerprint::{self, Fingerprint};
use crate::host::staging::{SlotMem, StagingRing};

/// One chunk's blob: `stored.len` bytes at `at` bytes into the backup's region of the file.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FileBlob {
    at: u64,
    stored: Stored,
}

/// A compressed backup in a spill file: the blobs of an allocation's chunks, in order, in its region of the file
/// (whose length is the bytes on disk), and their prints from the sleep.
pub(crate) struct FilePacked {
    pub(super) region: FileRegion,
    kind: DataKind,
    chunk: usize,
    size: usize,
    blobs: Vec<FileBlob>,
    prints: Vec<Fingerprint>,
    host_decode: Option<HostDecode>,
}

impl FilePacked {
    /// Bytes of the file it takes (its frames, each padded to an I/O block).
    pub(crate) fn disk_bytes(&self) -> usize {
        self.region.len
    }

    /// The prints its sleep took of its raw chunks, as (chunk, prints): what a wake verifies against (verify.rs).
    pub(super) fn sleep_prints(&self) -> (usize, &[Fingerprint]) {
        (self.chunk, &self.prints)
    }

    /// `out.len()` bytes from `at` of the raw contents, decoded on the host where the codec's format allows it.
    pub(crate) fn read_at(&self, at: usize, out: &mut [u8]) -> Result<()> {
        let mut done = 0;
        while done < out.len() {
            let i = (at + done) / self.chunk;
            let off = i * self.chunk;
            let len = self.chunk.min(self.size - off);
            let blob = self.blobs[i];
            let mut bytes = vec![0u8; blob.stored.len];
            super::read_file_at(&self.region.file, self.region.offset + blob.at, &mut bytes)?;
            let raw = if blob.stored.raw {
                bytes
            } else {
                let mut raw = vec![0u8; len];
                decode_on_host(self.host_decode, &bytes, &mut raw)?;
                raw
            };
            let from = at + done - off;
            let n = (len - from).min(out.len() - done);
            out[done..done + n].copy_from_slice(&raw[from..from + n]);
            done += n;
        }
        Ok(())
    }
}

/// One allocation a sleep writes compressed: `size` bytes at `addr` on `device`, into `file` from `offset`
/// (`io_len(size)` bytes reserved there).
pub(super) struct PackedJob<'a> {
    pub(super) file: &'a Arc<SpillFile>,
    pub(super) device: i32,
    pub(super) addr: DevPtr,
    pub(super) size: usize,
    pub(super) offset: u64,
    pub(super) kind: DataKind,
}

/// The codec settings of a sleep's compressed file jobs.
#[derive(Clone, Copy)]
pub(super) struct FileCodec {
    pub(super) chunk: usize,
    pub(super) host_decode: Option<HostDecode>,
}

/// A frame: the chunks [first, first + n) of job `job`, compressed into one slot and written with one write.
struct Frame {
    job: usize,
    first: usize,
    n: usize,
}

/// A job's progress: its blobs so far, the next frame's offset in its region, and the frames still to be written.
#[derive(Default)]
struct JobState {
    blobs: Vec<FileBlob>,
    at: u64,
    left: usize,
}

/// A frame's write: (slot, frame, its file offset and length).
type Write = (usize, SlotMem, usize, u64, usize);

/// The sleep pipeline of compressed file jobs (see the module comment). `done(i, backup)` once all of job `i` is
/// written, never after the first failure; `codec_failed` says whether that failure came from the prints or the
/// codec (the caller may then write the jobs not handed over raw) rather than a write. Ok: the bytes written.
pub(super) fn write_packed(
    driver: &dyn Driver,
    (ring, io): (&StagingRing, &dyn SpillIo),
    jobs: &[PackedJob],
    codec: FileCodec,
    refused: &mut Option<Error>,
    codec_failed: &mut bool,
    mut done: impl FnMut(usize, Backup),
) -> Result<usize> {
    let Some(dev_codec) = driver.codec() else {
        return Err(Error::InvalidState("no codec".into()));
    };
    let chunk = codec.chunk;
    let per_slot = (ring.slot_size() / chunk).max(1);
    assert!(
        chunk <= ring.slot_size(),
        "planned only when a chunk fits a slot"
    );
    // The prints a wake verifies against: every job's, one batch per device, before anything is compressed.
    let allocs: Vec<(DevPtr, i32, usize, usize)> = (jobs.iter())
        .map(|j| (j.addr, j.device, j.size, chunk))
        .collect();
    let mut prints = prints_of(driver, &allocs).inspect_err(|_| *codec_failed = true)?;
    let mut frames = Vec::new();
    let mut state: Vec<JobState> = Vec::with_capacity(jobs.len());
    for (j, job) in jobs.iter().enumerate() {
        let chunks = job.size.div_ceil(chunk);
        let mut first = 0;
        while first < chunks {
            let n = per_slot.min(chunks - first);
            frames.push(Frame { job: j, first, n });
            first += n;
        }
        state.push(JobState {
            left: chunks.div_ceil(per_slot),
            ..JobState::default()
        });
    }
    let work = |(slot, mem, f, offset, len): Write| {
        let r = jobs[frames[f].job]
            .file
            .write_all_at(io, mem.bytes(len), offset);
        (slot, f, len, r)
    };
    // Compress frame `f` into `slot`: its blobs go to the job's state, and the write to queue comes back.
    let fill = |slot: usize, f: usize, state: &mut [JobState]| -> Result<Write> {
        let Frame { job: j, first, n } = frames[f];
        let job = &jobs[j];
        let ranges: Vec<(DevPtr, usize)> = fingerprint::chunk_ranges(job.addr, job.size, chunk)
            .skip(first)
            .take(n)
            .collect();
        let base = ring.slot_ptr(slot).0;
        let (mut cursor, mut offsets) = (0usize, Vec::with_capacity(n));
        let stored = dev_codec.compress_to_host(
            job.device,
            &ranges,
            job.kind,
            &mut |_, len| {
                if cursor + len > ring.slot_size() {
                    return Err(Error::InvalidState(format!(
                        "the codec's blobs overflow a staging slot ({} bytes)",
                        ring.slot_size()
                    )));
                }
                offsets.push(cursor);
                cursor += len;
                Ok(HostPtr(base + cursor - len))
            },
            // The blobs are complete once the slot is written to the file, not before: nothing to tell.
            &mut |_, _| Ok(()),
        )?;
        let st = &mut state[j];
        for (off, s) in offsets.iter().zip(stored) {
            st.blobs.push(FileBlob {
                at: st.at + *off as u64,
                stored: s,
            });
        }
        let (offset, len) = (job.offset + st.at, io_len(cursor));
        st.at += len as u64;
        Ok((slot, ring.slot_mem(slot), f, offset, len))
    };
    std::thread::scope(|scope| {
        let mut workers = Workers::start(scope, IO_THREADS.min(ring.slots()), &work, driver);
        *refused = workers.refused.take();
        let mut free: Vec<usize> = (0..ring.slots()).rev().collect();
        let (mut next, mut pending, mut written) = (0, 0, 0);
        let mut failed: Option<Error> = None;
        let mut finish = |(slot, f, len, r): (usize, usize, usize, Result<()>),
                          free: &mut Vec<usize>,
                          state: &mut [JobState],
                          failed: &mut Option<Error>| {
            free.push(slot);
            if let Err(e) = r {
                failed.get_or_insert(e);
                return;
            }
            written += len;
            let j = frames[f].job;
            state[j].left -= 1;
            if state[j].left == 0 && failed.is_none() {
                let (job, st) = (&jobs[j], std::mem::take(&mut state[j]));
                // Nothing shrank: the blobs are the raw bytes, back to back from the region's start (no frame
                // was padded), so the backup is a raw file backup, which later sleeps rewrite in place.
                let as_raw = (st.blobs.iter().enumerate())
                    .all(|(i, b)| b.stored.raw && b.at == (i * chunk) as u64);
                if as_raw {
                    done(j, Backup::in_file(job.file, job.offset, job.size));
                    return;
                }
                let used = st.at as usize;
                let reserved = io_len(job.size);
                if used < reserved {
                    job.file.release(job.offset + used as u64, reserved - used);
                }
                let packed = FilePacked {
                    region: FileRegion {
                        file: job.file.clone(),
                        offset: job.offset,
                        len: used,
                    },
                    kind: job.kind,
                    chunk,
                    size: job.size,
                    blobs: st.blobs,
                    prints: std::mem::take(&mut prints[j]),
                    host_decode: codec.host_decode,
                };
                done(
                    j,
                    Backup {
                        place: Place::FilePacked(Arc::new(packed)),
                        len: job.size,
                    },
                );
            }
        };
        loop {
            while failed.is_none() && next < frames.len() {
                let Some(slot) = free.pop() else { break };
                match fill(slot, next, &mut state) {
                    Ok(w) => {
                        workers.submit(w, &work);
                        pending += 1;
                        next += 1;
                    }
                    Err(e) => {
                        free.push(slot);
                        failed = Some(e);
                        *codec_failed = true;
                    }
                }
                while let Some(r) = workers.next(false) {
                    pending -= 1;
                    finish(r, &mut free, &mut state, &mut failed);
                }
            }
            if pending > 0 {
                let r = workers.next(true).expect("a write in flight");
                pending -= 1;
                finish(r, &mut free, &mut state, &mut failed);
                continue;
            }
            break;
        }
        drop(workers);
        failed.map_or(Ok(written), Err)
    })
}

/// A run of back-to-back blobs of one backup read with one read: item `item`'s blobs [first, first + n), the file
/// bytes [lo, hi) (aligned).
struct Run {
    item: usize,
    first: usize,
    n: usize,
    lo: u64,
    hi: u64,
}

/// What `restore_packed_files` did: bytes read from files, raw bytes restored, and where the time went (waiting
/// for reads; in the codec's restores and the verification).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct PackedRead {
    pub(super) disk: usize,
    pub(super) raw: usize,
    pub(super) read_wait_seconds: f64,
    pub(super) codec_seconds: f64,
}

/// Restore the compressed file backups `items` ((device, addr, backup) of mapped, asleep allocations) through the
/// ring (see the module comment; the wake verifies them afterwards). Every copy the codec queued is done when it
/// returns, failure or not.
pub(super) fn restore_packed_files(
    driver: &dyn Driver,
    (ring, io): (&StagingRing, &dyn SpillIo),
    items: &[(i32, DevPtr, &FilePacked)],
    refused: &mut Option<Error>,
) -> Result<PackedRead> {
    if items.is_empty() {
        return Ok(PackedRead::default());
    }
    let codec = driver.codec().ok_or_else(|| {
        Error::InvalidState(
            "wake: compressed file backups, but the driver offers no codec any more; nothing was restored".into(),
        )
    })?;
    let slot = ring.slot_size() as u64;
    let align = IO_ALIGN as u64;
    let mut runs: Vec<Run> = Vec::new();
    for (item, (_, addr, p)) in items.iter().enumerate() {
        let base = p.region.offset;
        for (i, b) in p.blobs.iter().enumerate() {
            let (start, end) = (base + b.at, base + b.at + b.stored.len as u64);
            let joins = runs.last().is_some_and(|r: &Run| {
                r.item == item
                    && {
                        let last = &p.blobs[r.first + r.n - 1];
                        base + last.at + last.stored.len as u64 == start
                    }
                    && end.next_multiple_of(align) - r.lo <= slot
            });
            if joins {
                let r = runs.last_mut().expect("joins one");
                r.n += 1;
                r.hi = end.next_multiple_of(align);
                continue;
            }
            let (lo, hi) = (start / align * align, end.next_multiple_of(align));
            if hi - lo > slot {
                return Err(Error::InvalidState(format!(
                    "wake: a compressed chunk of allocation {addr:#x} takes {} bytes of its file, more than a slot of \
                     the staging ring ({slot} bytes; set_staging_bytes was lowered since its sleep): nothing was \
                     restored",
                    hi - lo
                )));
            }
            runs.push(Run {
                item,
                first: i,
                n: 1,
                lo,
                hi,
            });
        }
    }
    let work = |(slot, mut mem, r): (usize, SlotMem, usize)| {
        let run = &runs[r];
        let file = &items[run.item].2.region.file;
        let res = file.read_exact_at(io, mem.bytes_mut((run.hi - run.lo) as usize), run.lo);
        (slot, r, res)
    };
    let mut out = PackedRead::default();
    std::thread::scope(|s| -> Result<()> {
        let mut workers = Workers::start(s, IO_THREADS.min(ring.slots()), &work, driver);
        *refused = workers.refused.take();
        let mut free: Vec<usize> = (0..ring.slots()).rev().collect();
        let (mut next, mut pending) = (0, 0);
        let mut failed: Option<Error> = None;
        loop {
            while failed.is_none() && next < runs.len() {
                let Some(slot) = free.pop() else { break };
                workers.submit((slot, ring.slot_mem(slot), next), &work);
                pending += 1;
                next += 1;
            }
            if pending == 0 {
                break;
            }
            let t = Instant::now();
            let (slot, r, res) = workers.next(true).expect("a read in flight");
            out.read_wait_seconds += t.elapsed().as_secs_f64();
            pending -= 1;
            if let Err(e) = res {
                failed.get_or_insert(e);
            }
            if failed.is_some() {
                free.push(slot);
                continue;
            }
            // Restore what was read (synchronous: the slot is free again when it returns), the other reads going on.
            let run = &runs[r];
            let (device, addr, p) = items[run.item];
            let base = ring.slot_ptr(slot).0;
            let restore: Vec<RestoreItem> = (run.first..run.first + run.n)
                .map(|i| {
                    let b = p.blobs[i];
                    let off = i * p.chunk;
                    RestoreItem {
                        src: HostPtr(base + (p.region.offset + b.at - run.lo) as usize),
                        stored: b.stored,
                        dst: addr + off as u64,
                        raw_len: p.chunk.min(p.size - off),
                        kind: p.kind,
                        joins_previous: false,
                    }
                })
                .collect();
            let t = Instant::now();
            let restored = codec.decompress_from_host(device, &restore, &mut |_| Ok(()));
            out.codec_seconds += t.elapsed().as_secs_f64();
            free.push(slot);
            match restored {
                Ok(()) => {
                    out.disk += (run.hi - run.lo) as usize;
                }
                Err(e) => {
                    failed.get_or_insert(naming(
                        e,
                        format!(
                            "restoring the compressed file backup of allocation {addr:#x} on device \
                             {device}; every allocation stays asleep with its backup"
                        ),
                    ));
                }
            }
        }
        drop(workers);
        failed.map_or(Ok(()), Err)
    })?;
    out.raw = items.iter().map(|(_, _, p)| p.size).sum();
    Ok(out)
}
