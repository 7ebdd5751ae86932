//! Compressed backups: an allocation's host backup as one codec blob per fingerprint chunk, in host arenas that
//! hold the blobs only (host bytes held = stored bytes, not raw bytes).
//!
//! Sleep (`pack`): the chunks of the allocations to compress are fingerprinted first (one batch per device,
//! waited for: the prints a wake verifies against), then the driver's codec writes each chunk's blob where the
//! `Placer` says (placer.rs: back to back in arenas sized from an estimate of the ratio, the last sleep's, grown
//! in place when the estimate falls short). A retained compressed backup (retain.rs) keeps the blobs of its unchanged chunks (not
//! compressed, not copied again); only changed chunks get new blobs. Any failure (prints, codec, host memory)
//! returns an error with nothing changed; the engine then copies those allocations raw for this sleep.
//!
//! Wake (`restore_packed`): once the allocations are mapped, the codec restores every blob into its chunk; the
//! wake then verifies the restored chunks against the prints of the sleep with every other tier's (verify.rs). A
//! codec error or a mismatch fails the wake (naming the allocation); the blobs are never changed, so a later wake
//! can succeed.
//!
//! Chunks are the fingerprint chunk (2 MiB by default): the codec takes ranges of at most `MAX_RANGE`, so a
//! larger fingerprint chunk turns compression off (backups are raw). A backup that goes to a spill file is
//! compressed by the file tier's own pipeline (file_packed.rs), through its staging ring.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::blob_reuse::Reuse;
use super::placer::Placer;
use super::{Backup, BackupStore, Place};
use crate::driver::codec::{DataKind, RestoreItem, Stored};
use crate::driver::{DevPtr, Driver};
use crate::error::{Error, Result};
use crate::error_log::ErrorLog;
use crate::fingerprint::{self, Fingerprint};
use crate::host::HostBuffer;
use crate::registry::Registry;

pub use super::placer::MAX_RANGE;

/// The ratio assumed before any sleep measured one (bf16 weights: ~0.67; worse data grows the first arena).
pub(super) const FIRST_RATIO_GUESS: f64 = 0.67;

/// Host bytes a compressed sleep may pin past the raw bytes at worst, besides a thirty-second of them (the ends of
/// pinned pieces a blob did not fit): a first arena's room to grow and a few minimum-size arenas.
const PACK_SLACK: usize = 16 << 20;

/// Context of a blob arena that could not grow in place (a new arena took the rest of the blobs).
const GROW_FAILED: &str =
    "growing a compressed sleep's host arena in place (a new arena took the rest)";

/// Decodes a blob on the host, where the codec's format allows it (the simulated driver's): `read_backup` of a
/// compressed backup. None on CUDA, whose blobs only a wake restores.
pub(crate) type HostDecode = fn(&[u8], &mut [u8]) -> Result<()>;

/// Decode `blob` into `raw` with `decode`; without one (CUDA) an error: only a wake restores such a backup.
pub(super) fn decode_on_host(
    decode: Option<HostDecode>,
    blob: &[u8],
    raw: &mut [u8],
) -> Result<()> {
    let decode = decode.ok_or_else(|| {
        Error::InvalidState(
            "this backup is compressed on the device: only a wake restores its bytes".into(),
        )
    })?;
    decode(blob, raw)
}

/// One chunk's blob: `stored.len` bytes at `offset` of `arena`.
#[derive(Clone)]
pub(crate) struct Blob {
    arena: Arc<HostBuffer>,
    offset: usize,
    stored: Stored,
}

/// A compressed backup: the blobs of an allocation's chunks, in order, and their prints from the sleep.
pub(crate) struct Packed {
    pub(crate) kind: DataKind,
    /// Raw bytes per chunk (the last chunk may be shorter), and in all.
    pub(crate) chunk: usize,
    pub(crate) size: usize,
    pub(crate) blobs: Vec<Blob>,
    /// Fingerprint of each chunk's raw bytes, taken by the sleep that made its blob.
    pub(crate) prints: Vec<Fingerprint>,
    pub(crate) host_decode: Option<HostDecode>,
}

impl Packed {
    /// Where each blob lies: (arena, offset, stored bytes), so that no other backup is put over it.
    pub(super) fn blob_ranges(&self) -> impl Iterator<Item = (&Arc<HostBuffer>, usize, usize)> {
        self.blobs
            .iter()
            .map(|b| (&b.arena, b.offset, b.stored.len))
    }

    /// Host bytes its blobs take.
    pub(crate) fn stored_bytes(&self) -> usize {
        self.blobs.iter().map(|b| b.stored.len).sum()
    }

    /// Chunk `i`: (offset in the allocation, raw length), for an allocation of `size` bytes.
    fn chunk_range(&self, i: usize, size: usize) -> (usize, usize) {
        let off = i * self.chunk;
        (off, self.chunk.min(size - off))
    }

    /// `out.len()` bytes from `at` of the raw contents, decoded on the host (raw blobs need no codec).
    pub(crate) fn read_at(&self, size: usize, at: usize, out: &mut [u8]) -> Result<()> {
        let mut done = 0;
        while done < out.len() {
            let i = (at + done) / self.chunk;
            let (off, len) = self.chunk_range(i, size);
            let blob = &self.blobs[i];
            let mut raw = vec![0u8; len];
            if blob.stored.raw {
                blob.arena.read_at(blob.offset, &mut raw);
            } else {
                let mut bytes = vec![0u8; blob.stored.len];
                blob.arena.read_at(blob.offset, &mut bytes);
                decode_on_host(self.host_decode, &bytes, &mut raw)?;
            }
            let from = at + done - off;
            let n = (len - from).min(out.len() - done);
            out[done..done + n].copy_from_slice(&raw[from..from + n]);
            done += n;
        }
        Ok(())
    }
}

/// Where a blob ends: (its arena's address, the pinned piece (start, end) it lies in, the offset of its end).
type BlobEnd = (usize, Option<(usize, usize)>, usize);

/// An allocation `pack` compresses: (addr, device, size, mode, its retained compressed backup if any).
type Packing = (DevPtr, i32, usize, DataKind, Option<Arc<Packed>>);

/// One allocation to compress at a sleep.
pub struct PackJob {
    pub addr: DevPtr,
    pub device: i32,
    pub size: usize,
    pub kind: DataKind,
}

/// One compressed backup `pack` made, with the prints the retention keeps and, for a retained backup, the chunks
/// compared with its prints and the bytes of those unchanged (kept, neither compressed nor copied).
pub struct PackedOne {
    pub addr: DevPtr,
    pub backup: Backup,
    pub prints: Vec<Fingerprint>,
    pub chunks_checked: usize,
    pub skipped_bytes: usize,
}

/// What `pack` made.
#[derive(Default)]
pub struct PackedSleep {
    pub backups: Vec<PackedOne>,
    /// The codec failed part way: why, and the allocations it did not finish (to be copied raw, their retained
    /// backups unusable). Those it finished have their backups above, and `complete` was called for them.
    pub failed: Option<Error>,
    pub unpacked: Vec<DevPtr>,
}

impl BackupStore {
    /// Whether sleeps compress: on, a codec offered, a fingerprint chunk the codec takes, prints that work.
    pub fn compressing(&self) -> bool {
        self.compress
            && self.driver.codec().is_some()
            && self.retention.chunk <= MAX_RANGE
            && !self.retention.unavailable
    }

    /// Compression on or off (`CUMEM_RS_COMPRESS`); backups already compressed stay so until they wake.
    pub fn set_compress(&mut self, on: bool) {
        self.compress = on;
    }

    /// Host bytes `raw` bytes of compressed backups are estimated to take (the last compressed sleep's ratio,
    /// with the placer's slack), for pinning ahead.
    pub fn estimate_stored(&self, raw: usize) -> usize {
        (raw as f64 * self.ratio_guess * 1.05).min(raw as f64) as usize
    }

    /// Whether a compressed sleep of `raw` bytes (those the codec takes, fresh and retained, and those the same
    /// sleep copies raw after it) may release each allocation as soon as its backup is complete, the codec still
    /// running on others. Only where all the sleep may come to pin at worst fits the host's room now: every chunk
    /// stored raw (blob arenas up to the raw bytes, with the slack of piece ends and small arenas), or a raw
    /// fallback of what the codec did not finish beside the blobs of what it did. Otherwise the codec's backups
    /// are all or nothing, each arena and growth checked against the room as it comes (the estimate is a guess:
    /// data that compresses as expected fits where its raw bytes would not), and a refusal leaves every allocation
    /// awake with its data; a refusal after a release could not.
    pub fn may_release_while_packing(&self, raw: usize) -> bool {
        let worst = raw.saturating_add(raw / 32).saturating_add(PACK_SLACK);
        match self
            .room
            .check(worst, self.resident(), "a compressed sleep at worst")
        {
            Ok(()) => true,
            Err(e) => {
                log::debug!("compressed sleep: all or nothing, no release while compressing: {e}");
                false
            }
        }
    }

    /// Whether this sleep copies `addr` raw without trying the codec: its last compressed backup kept no chunk
    /// compressed (incompressible.rs). Counts the sleep.
    pub fn skips_codec(&mut self, addr: DevPtr) -> bool {
        self.incompressible.skip(addr)
    }

    /// What the codec made of `addr`'s fresh backup in a file (file_packed.rs): every chunk raw, or not.
    pub fn note_codec_result(&mut self, addr: DevPtr, all_raw: bool) {
        self.incompressible.record(addr, all_raw);
    }

    /// Whether the next sleep would copy `addr` raw without trying the codec (nothing counted).
    pub fn would_skip_codec(&self, addr: DevPtr) -> bool {
        self.incompressible.would_skip(addr)
    }

    /// What the codec is, while sleeps compress.
    pub fn codec_description(&self) -> Option<String> {
        self.compressing()
            .then(|| self.driver.codec().map(|c| c.describe()))
            .flatten()
    }

    /// Sleep, before anything is released: split the allocations with a retained compressed backup off
    /// `retained` (returned: `pack` handles them).
    pub fn split_packed(&self, retained: &mut Vec<DevPtr>) -> Vec<DevPtr> {
        let (packed, rest): (Vec<DevPtr>, Vec<DevPtr>) = retained
            .iter()
            .partition(|a| (self.retention.retained.get(a)).is_some_and(|b| b.packed().is_some()));
        *retained = rest;
        packed
    }

    /// Sleep: compressed backups of `jobs` (fresh) and of `retained` (allocations with a retained compressed
    /// backup: only their changed chunks are compressed again). `raw_after`: raw bytes the same sleep copies raw
    /// next (a cached buffer they fit is left to them).
    ///
    /// With `complete`, `complete(addr)` is called as soon as an allocation's backup is wholly in host memory,
    /// while the codec goes on with the others: the caller may release its device memory then (overlapping the
    /// releases with the codec: H200, 1024 allocations of 12 MiB spent 28-42 ms releasing after 160 ms of
    /// compressing). Such an allocation always gets its backup in the result. A failure before the first
    /// `complete` (or at all, without `complete`) is an `Err` with nothing changed (the arenas taken go back);
    /// after it, the result says what failed and which allocations were not finished (`PackedSleep::failed`,
    /// `unpacked`): the caller copies those raw.
    pub fn pack(
        &mut self,
        reg: &Registry,
        jobs: &[PackJob],
        retained: &[DevPtr],
        raw_after: usize,
        log: &mut ErrorLog,
        mut complete: Option<&mut dyn FnMut(DevPtr)>,
    ) -> Result<PackedSleep> {
        let driver = self.driver.clone();
        let codec = (driver.codec()).ok_or_else(|| Error::InvalidState("no codec".into()))?;
        // A buffer being pinned ahead is cached from here on (the placer may take it).
        self.stop_pin_ahead(log);
        let chunk = self.retention.chunk;
        // Every allocation, fresh or retained: (addr, device, size, kind, old backup).
        let mut all: Vec<Packing> = (jobs.iter())
            .map(|j| (j.addr, j.device, j.size, j.kind, None))
            .collect();
        for &addr in retained {
            let a = reg.get(addr).expect("selected");
            let old = (self.retention.retained.get(&addr))
                .and_then(Backup::packed)
                .expect("split on it")
                .clone();
            all.push((addr, a.device, a.size, old.kind, Some(old)));
        }
        let t = std::time::Instant::now();
        let prints = self.prints_now(&all, chunk)?;
        let prints_ms = t.elapsed().as_secs_f64() * 1e3;

        // The chunks to compress, per device and kind, in order: (allocation index, chunk index).
        // Ordered: the first group takes the sleep's first (largest) arena, so the order must not change from one
        // run to the next (a HashMap's does, per process).
        let mut todo: BTreeMap<(i32, DataKind), Vec<(usize, usize)>> = BTreeMap::new();
        let mut out = PackedSleep::default();
        // Per allocation with a retained backup: (chunks compared, bytes kept), given with its backup (one the codec
        // does not finish is copied raw, all of it).
        let mut retained_counts = vec![(0usize, 0usize); all.len()];
        for (n, (_, dev, size, kind, old)) in all.iter().enumerate() {
            for (i, (_, len)) in fingerprint::chunks(*size, chunk).enumerate() {
                if let Some(old) = old {
                    let c = &mut retained_counts[n];
                    c.0 += 1;
                    if old.chunk == chunk && old.prints.get(i) == Some(&prints[n][i]) {
                        c.1 += len;
                        continue;
                    }
                }
                todo.entry((*dev, *kind)).or_default().push((n, i));
            }
        }
        // Chunks of each allocation still to be compressed: at 0 its backup is complete.
        let mut left = vec![0usize; all.len()];
        for &(n, _) in todo.values().flatten() {
            left[n] += 1;
        }
        let mut any_complete = false;
        if let Some(complete) = complete.as_mut() {
            for (n, _) in left.iter().enumerate().filter(|(_, l)| **l == 0) {
                complete(all[n].0); // a retained backup with no chunk changed
                any_complete = true;
            }
        }
        let ratio = self.ratio_guess;
        // The blobs of changed chunks of the retained backups are dead: their bytes (with the holes beside them)
        // take new blobs first. From here on they may be overwritten: the retained backups are this sleep's, the
        // blobs of their unchanged chunks in use by the new backups (blob_reuse.rs).
        self.retention.drop(retained);
        let changed: std::collections::HashSet<(usize, usize)> =
            todo.values().flatten().copied().collect();
        for (n, (.., old)) in all.iter().enumerate() {
            let Some(old) = old else { continue };
            let kept = (old.blob_ranges().enumerate()).filter(|(i, _)| !changed.contains(&(n, *i)));
            (self.placed).extend(kept.map(|(_, (a, off, len))| (a.clone(), off, len)));
        }
        let reuse = Reuse::of(self.holes());
        let mut placer = Placer::new(self, ratio, raw_after, reuse);
        // Raw bytes of the ranges given to the codec.
        let mut raw_compressed = 0;
        // (arena index, offset, stored) of each compressed chunk.
        let mut made: HashMap<(usize, usize), (usize, usize, Stored)> = HashMap::new();
        let mut failed = None;
        for ((dev, kind), list) in &todo {
            let ranges: Vec<(DevPtr, usize)> = (list.iter())
                .map(|&(n, i)| {
                    let (addr, _, size, _, _) = &all[n];
                    fingerprint::chunk_ranges(*addr, *size, chunk)
                        .nth(i)
                        .expect("chunk")
                })
                .collect();
            let mut rest: usize = ranges.iter().map(|r| r.1).sum();
            raw_compressed += rest;
            let places = RefCell::new(Vec::with_capacity(ranges.len()));
            let answered = codec.compress_to_host(
                *dev,
                &ranges,
                *kind,
                &mut |i, len| {
                    let (a, off) = placer.place(len, ranges[i].1, rest)?;
                    rest = rest.saturating_sub(ranges[i].1);
                    places.borrow_mut().push((a, off));
                    Ok(placer.at(a, off))
                },
                &mut |k, stored| {
                    let &(a, off) = places.borrow().get(k).ok_or_else(|| {
                        Error::InvalidState(format!("codec finished blob {k} before placing it"))
                    })?;
                    let (n, i) = list[k];
                    if made.insert((n, i), (a, off, stored)).is_some() {
                        return Err(Error::InvalidState(format!(
                            "codec finished blob {k} twice"
                        )));
                    }
                    left[n] -= 1;
                    if let Some(complete) = complete.as_mut().filter(|_| left[n] == 0) {
                        complete(all[n].0);
                        any_complete = true;
                    }
                    Ok(())
                },
            );
            let answered = answered.and_then(|stored| match stored.len() == ranges.len() {
                true => Ok(()),
                false => Err(Error::InvalidState(format!(
                    "codec answered {} blobs for {} ranges",
                    stored.len(),
                    ranges.len()
                ))),
            });
            if let Err(e) = answered {
                failed = Some(e);
                break;
            }
        }
        if let Some(e) = failed.take_if(|_| !any_complete) {
            // Nothing finished: the arenas go back (cached or to the OS); nothing points into them.
            for a in placer.arenas {
                let _ = placer.store.host.give_back(a);
            }
            self.record_host_fallbacks(log);
            return Err(e);
        }
        let t = std::time::Instant::now();
        let skipped = placer.skipped;
        for e in std::mem::take(&mut placer.grow_failures) {
            log.record(GROW_FAILED, &e);
        }
        let (reused, new) = placer.finish(log);
        let new: Vec<Arc<HostBuffer>> = (new.into_iter()).map(|a| self.adopt(a, log)).collect();
        // The arenas this sleep took, for the spare the bound allows (below).
        let taken: usize = new.iter().map(|a| a.len()).sum();
        let arenas: Vec<Arc<HostBuffer>> = reused.into_iter().chain(new).collect();
        // Under a budget, the host cache may now hold past it beside the arenas (the arena `finish` shrank, or
        // one too large to take, went back to it): returned, so that `held()` stays within the budget.
        if self.budget.is_some_and(|b| self.held() > b) {
            if let Err(e) = self.host.trim() {
                log.record("returning cached host backup memory", &e);
            }
        }
        self.record_host_fallbacks(log);
        log::debug!(
            "compressed sleep: prints {prints_ms:.1} ms, finish arenas {:.1} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        let host_decode = self.host_decode();
        let (mut guess_raw, mut guess_stored) = (0usize, 0usize);
        out.failed = failed;
        for (n, (addr, _, size, kind, old)) in all.into_iter().enumerate() {
            if left[n] > 0 {
                out.unpacked.push(addr); // the codec failed before finishing it
                continue;
            }
            let blobs: Vec<Blob> = (0..size.div_ceil(chunk))
                .map(|i| match made.get(&(n, i)) {
                    Some(&(a, offset, stored)) => Blob {
                        arena: arenas[a].clone(),
                        offset,
                        stored,
                    },
                    None => old.as_ref().expect("unchanged chunks are retained").blobs[i].clone(),
                })
                .collect();
            let all_raw = old.is_none() && blobs.iter().all(|b| b.stored.raw);
            if old.is_none() {
                self.incompressible.record(addr, all_raw);
            }
            let packed = Packed {
                kind,
                chunk,
                size,
                blobs,
                prints: prints[n].clone(),
                host_decode,
            };
            if !all_raw {
                (guess_raw, guess_stored) =
                    (guess_raw + size, guess_stored + packed.stored_bytes());
            }
            let backup = Backup {
                place: Place::Packed(Arc::new(packed)),
                len: size,
            };
            let (chunks_checked, skipped_bytes) = retained_counts[n];
            out.backups.push(PackedOne {
                addr,
                backup,
                prints: prints[n].clone(),
                chunks_checked,
                skipped_bytes,
            });
        }
        // In use until the sleep is over: no raw backup of this sleep goes into a hole over them (`placed`).
        for p in out.backups.iter().filter_map(|one| one.backup.packed()) {
            (self.placed).extend(p.blob_ranges().map(|(a, off, len)| (a.clone(), off, len)));
        }
        // The spare arena the bound lets the store keep for the next sleep (bound.rs): as large as the arenas this
        // sleep took for its blobs (those of unchanged retained chunks were made before), at most their raw bytes.
        // Not the blobs' bytes: the arena holds a few percent more (its estimate's slack), and a spare bound below
        // it had every wake unpin it and the next sleep pin a new one (H200, 15 GiB of bf16: 250 ms at the wake,
        // 480 ms at the sleep). An arena grown in place may pass the raw bytes by the pieces' ends left unused.
        self.largest = self.largest.max(taken.min(raw_compressed + skipped));
        // The next sleep's guess, from the backups that will go through the codec again: not those it could not
        // shrink at all, which skip it from now on (counted in, 15 GiB of random bytes beside a few compressible
        // tensors had the next sleep size their arena at the raw bytes, then move it into an exact one: H200,
        // 36 ms of a 328 ms sleep). Only such backups: the guess stands.
        if guess_raw > 0 {
            self.ratio_guess = (guess_stored as f64 / guess_raw as f64).clamp(0.01, 1.0);
        }
        Ok(out)
    }

    /// The prints of the chunks of `all`, one batch per device, waited for.
    fn prints_now(&self, all: &[Packing], chunk: usize) -> Result<Vec<Vec<Fingerprint>>> {
        let allocs: Vec<(DevPtr, i32, usize, usize)> = (all.iter())
            .map(|&(addr, dev, size, ..)| (addr, dev, size, chunk))
            .collect();
        prints_of(&*self.driver, &allocs)
    }

    /// The host decoder of this driver's blobs, where its format allows one (the simulated driver's).
    pub(super) fn host_decode(&self) -> Option<HostDecode> {
        (self.driver.backend() == "sim").then_some(crate::driver::sim_codec::decode)
    }

    /// Whether `addr` is asleep with a compressed backup in host memory (a wake may map it while earlier ones are
    /// restored; one in a file is restored with the file tier, mapped before).
    pub fn has_packed_backup(&self, addr: DevPtr) -> bool {
        self.asleep.get(&addr).and_then(Backup::packed).is_some()
    }

    /// Wake: restore the allocations of `placed` ((device, addr), asleep) that have a compressed backup (the wake
    /// verifies them afterwards, verify.rs). Each is mapped by then, or mapped by `ready(addr)`, which is called
    /// before anything writes it (an error from it fails the restore). Returns (raw bytes, stored bytes).
    pub fn restore_packed(
        &self,
        placed: &[(i32, DevPtr)],
        reg: &Registry,
        ready: &mut dyn FnMut(DevPtr) -> Result<()>,
    ) -> Result<(usize, usize)> {
        let mut per_device: HashMap<i32, Vec<(DevPtr, &Packed)>> = HashMap::new();
        for &(dev, addr) in placed {
            if let Some(p) = self.asleep.get(&addr).and_then(Backup::packed) {
                per_device.entry(dev).or_default().push((addr, p));
            }
        }
        if per_device.is_empty() {
            return Ok((0, 0));
        }
        let codec = self.driver.codec().ok_or_else(|| {
            Error::InvalidState(
                "wake: compressed backups, but the driver offers no codec any more; nothing was restored".into(),
            )
        })?;
        let (mut raw, mut stored) = (0, 0);
        for (dev, allocs) in per_device {
            let mut items = Vec::new();
            // The allocation each item starts, at its first item.
            let mut starts: HashMap<usize, DevPtr> = HashMap::new();
            // Where the previous item's blob ends: (arena, its pinned piece, offset).
            let mut last: Option<BlobEnd> = None;
            for &(addr, p) in &allocs {
                starts.insert(items.len(), addr);
                let size = reg.get(addr).expect("selected").size;
                for (i, blob) in p.blobs.iter().enumerate() {
                    let (off, len) = p.chunk_range(i, size);
                    let arena = Arc::as_ptr(&blob.arena) as usize;
                    let piece = blob.arena.piece_at(blob.offset);
                    let joins_previous =
                        piece.is_some() && last == Some((arena, piece, blob.offset));
                    last = Some((arena, piece, blob.offset + blob.stored.len));
                    items.push(RestoreItem {
                        src: blob.arena.at(blob.offset),
                        stored: blob.stored,
                        dst: addr + off as u64,
                        raw_len: len,
                        kind: p.kind,
                        joins_previous,
                    });
                }
                raw += size;
                stored += p.stored_bytes();
            }
            let t = std::time::Instant::now();
            let decompressed = codec.decompress_from_host(dev, &items, &mut |i| {
                starts.get(&i).map_or(Ok(()), |addr| ready(*addr))
            });
            decompressed.map_err(|e| {
                let addrs: Vec<String> = allocs.iter().map(|(a, _)| format!("{a:#x}")).collect();
                naming(
                    e,
                    format!(
                        "restoring the compressed backups of allocations {} on device {dev}; every allocation \
                         stays asleep with its backup",
                        addrs.join(", ")
                    ),
                )
            })?;
            log::debug!(
                "compressed wake on device {dev}: {} items, decompress {:.1} ms",
                items.len(),
                t.elapsed().as_secs_f64() * 1e3,
            );
        }
        Ok((raw, stored))
    }

    /// Move the blobs of compressed backups (asleep and retained) out of arenas with unused bytes into one new
    /// arena of exactly their size (bound.rs, after its raw backups): partial wakes and changed chunks leave
    /// holes in blob arenas as they do in raw ones. Same bytes, same prints; no device copy touches a blob.
    pub(super) fn compact_packed(&mut self, log: &mut ErrorLog) -> Result<()> {
        let packed: Vec<(DevPtr, bool, Arc<Packed>)> = (self.asleep.iter())
            .map(|(a, b)| (*a, false, b))
            .chain(self.retention.retained.iter().map(|(a, b)| (*a, true, b)))
            .filter_map(|(a, r, b)| b.packed().map(|p| (a, r, p.clone())))
            .collect();
        // Bytes of blobs in each arena (a blob shared by two backups counted once).
        let mut used: HashMap<usize, usize> = HashMap::new();
        let mut seen = std::collections::HashSet::new();
        for (_, _, p) in &packed {
            for b in &p.blobs {
                if seen.insert((Arc::as_ptr(&b.arena) as usize, b.offset)) {
                    *used.entry(Arc::as_ptr(&b.arena) as usize).or_default() += b.stored.len;
                }
            }
        }
        let holed = |b: &Blob| used[&(Arc::as_ptr(&b.arena) as usize)] < b.arena.len();
        let moving: Vec<&(DevPtr, bool, Arc<Packed>)> = packed
            .iter()
            .filter(|(_, _, p)| p.blobs.iter().any(holed))
            .collect();
        let mut places: HashMap<(usize, usize), usize> = HashMap::new();
        let mut total = 0;
        for (_, _, p) in &moving {
            for b in p.blobs.iter().filter(|b| holed(b)) {
                places
                    .entry((Arc::as_ptr(&b.arena) as usize, b.offset))
                    .or_insert_with(|| {
                        total += b.stored.len;
                        total - b.stored.len
                    });
            }
        }
        // Beside the old arenas until the move is done: within the budget and the host's room.
        let what = "compacting compressed backups";
        if total == 0
            || (self.check_budget(total, what))
                .and_then(|()| self.room.check(total, self.resident(), what))
                .is_err()
        {
            return Ok(());
        }
        let (mut buf, fallback) = HostBuffer::acquire(&self.driver, total)?;
        let refused = std::mem::take(&mut buf.notes);
        super::record_pinning(log, fallback.into_iter().collect(), refused);
        let mut copied = std::collections::HashSet::new();
        for (_, _, p) in &moving {
            for b in p.blobs.iter().filter(|b| holed(b)) {
                let key = (Arc::as_ptr(&b.arena) as usize, b.offset);
                if copied.insert(key) {
                    buf.copy_from(places[&key], &b.arena, b.offset, b.stored.len);
                }
            }
        }
        let arena = Arc::new(buf);
        for (addr, retained, p) in moving {
            let blobs = (p.blobs.iter())
                .map(
                    |b| match places.get(&(Arc::as_ptr(&b.arena) as usize, b.offset)) {
                        Some(&offset) => Blob {
                            arena: arena.clone(),
                            offset,
                            stored: b.stored,
                        },
                        None => b.clone(),
                    },
                )
                .collect();
            let moved = Packed {
                kind: p.kind,
                chunk: p.chunk,
                size: p.size,
                blobs,
                prints: p.prints.clone(),
                host_decode: p.host_decode,
            };
            let backup = Backup {
                place: Place::Packed(Arc::new(moved)),
                len: p.size,
            };
            if *retained {
                self.retention.rebind(*addr, backup);
            } else {
                self.asleep.insert(*addr, backup);
            }
        }
        self.arenas.push(arena);
        Ok(())
    }

    /// Stored and raw bytes of the compressed backups of asleep allocations.
    pub fn compressed_asleep(&self) -> (usize, usize) {
        (self.asleep.values())
            .filter_map(|b| b.packed().map(|p| (p.stored_bytes(), b.len)))
            .fold((0, 0), |(s, r), (ps, pr)| (s + ps, r + pr))
    }
}

/// `e` with `context` added to its message, its kind (and a driver error's op and code) kept.
pub(super) fn naming(e: Error, context: String) -> Error {
    match e {
        Error::Driver { op, code, name } => Error::Driver {
            op,
            code,
            name: format!("{name} ({context})"),
        },
        Error::OutOfMemory { what } => Error::OutOfMemory {
            what: format!("{what} ({context})"),
        },
        other => Error::InvalidState(format!("{other} ({context})")),
    }
}

/// The prints of the chunks of each of `allocs` ((addr, device, size, chunk)), one batch per device, waited for.
pub(super) fn prints_of(
    driver: &dyn Driver,
    allocs: &[(DevPtr, i32, usize, usize)],
) -> Result<Vec<Vec<Fingerprint>>> {
    let mut per_device: HashMap<i32, Vec<usize>> = HashMap::new();
    for (n, (_, dev, ..)) in allocs.iter().enumerate() {
        per_device.entry(*dev).or_default().push(n);
    }
    let mut prints = vec![Vec::new(); allocs.len()];
    for (dev, members) in per_device {
        let ranges: Vec<(DevPtr, usize)> = (members.iter())
            .flat_map(|&n| {
                let (addr, _, size, chunk) = allocs[n];
                fingerprint::chunk_ranges(addr, size, chunk)
            })
            .collect();
        let fps = take_prints(driver, dev, &ranges)?;
        let mut rest = fps.as_slice();
        for n in members {
            let (_, _, size, chunk) = allocs[n];
            let (mine, tail) = rest.split_at(size.div_ceil(chunk));
            prints[n] = mine.to_vec();
            rest = tail;
        }
    }
    Ok(prints)
}

/// Fingerprints of `ranges` on `device`: queued, waited for, taken.
fn take_prints(
    driver: &dyn Driver,
    device: i32,
    ranges: &[(DevPtr, usize)],
) -> Result<Vec<Fingerprint>> {
    driver.queue_fingerprints(device, ranges)?;
    let waited = driver.wait(device);
    let fps = driver.take_fingerprints(device); // taken also after a failed wait: one batch at a time
    waited?;
    let fps = fps?;
    if fps.len() != ranges.len() {
        return Err(Error::InvalidState(format!(
            "{} fingerprints for {} chunks",
            fps.len(),
            ranges.len()
        )));
    }
    Ok(fps)
}
