//! Compressed backups on the simulated driver's codec: round trips, host bytes held, retained chunks that are not
//! compressed again, the compress policy and switch, and every fault path (sleep falls back to raw, a wake that
//! cannot decompress or restores wrong bytes fails transactionally and a later wake succeeds).

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::{assert_no_leaks, calls, engine, GRAN};
use cumem_rs::driver::{Driver, Op};
use cumem_rs::{Compress, Engine, EngineConfig, SimConfig, SimDriver, TagPolicy};

const CUDA_ERROR_UNKNOWN: i32 = 999;

/// bf16 bit patterns of N(0, 0.02) samples (what `torch.randn(...) * 0.02` holds), deterministic.
fn bf16_like(bytes: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut out = Vec::with_capacity(bytes);
    while out.len() < bytes {
        let (u, v) = (next().max(1e-300), next());
        let x = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos() * 0.02;
        out.extend_from_slice(&(((x as f32).to_bits() >> 16) as u16).to_le_bytes());
    }
    out
}

fn random_bytes(bytes: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..bytes)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 56) as u8
        })
        .collect()
}

/// One "weights" allocation holding `data`.
fn weights(e: &Engine, data: &[u8]) -> u64 {
    e.push_tag("weights").unwrap();
    let a = e.malloc(data.len(), 0, 0).unwrap();
    e.pop_tag().unwrap();
    e.write(a, data).unwrap();
    a
}

fn compressed(sim: &SimDriver) -> u64 {
    sim.inner()
        .codec_counts()
        .compressed
        .load(Ordering::Relaxed)
}

#[test]
fn bf16_like_random_and_zero_data_come_back_bit_identical_and_bf16_takes_less_host_memory() {
    let (sim, e) = engine(1, 64 << 20);
    let bf16 = bf16_like(64 * GRAN, 1);
    let random = random_bytes(16 * GRAN, 2);
    let zeros = vec![0u8; 16 * GRAN];
    let allocs: Vec<(u64, &Vec<u8>)> = [&bf16, &random, &zeros]
        .into_iter()
        .map(|d| (weights(&e, d), d))
        .collect();
    let raw_total = bf16.len() + random.len() + zeros.len();
    let rep = e.sleep(&["weights"]).unwrap();
    assert_eq!((rep.copied_bytes, rep.raw_bytes), (raw_total, raw_total));
    let s = e.stats();
    assert!(
        s.codec.as_deref().unwrap().contains("zstd"),
        "{:?}",
        s.codec
    );
    assert_eq!(s.host_tier_bytes, raw_total);
    assert_eq!(s.compressed_raw_bytes, raw_total);
    assert_eq!(
        (s.compressed_bytes, s.host_tier_stored_bytes),
        (rep.stored_bytes, rep.stored_bytes)
    );
    // Random bytes are stored raw (no gain), zeros shrink to almost nothing, bf16 to ~0.68.
    let bf16_stored = rep.stored_bytes - random.len();
    let ratio = bf16_stored as f64 / bf16.len() as f64;
    assert!((0.6..0.75).contains(&ratio), "bf16 ratio {ratio}");
    assert!(
        e.host_bytes() < raw_total * 3 / 4,
        "host bytes held {} for {raw_total} raw",
        e.host_bytes()
    );
    // The backup reads back decoded on the host (the sim's blobs allow it).
    assert_eq!(
        e.read_backup(allocs[0].0, 4096).unwrap().unwrap(),
        bf16[..4096]
    );
    let woke = e.wake(None::<&[&str]>).unwrap();
    assert_eq!(
        (woke.raw_bytes, woke.stored_bytes),
        (raw_total, rep.stored_bytes)
    );
    for (a, d) in &allocs {
        assert!(e.read(*a, d.len()).unwrap() == **d, "data of {a:#x}");
    }
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn a_retained_unchanged_chunk_is_not_compressed_again_and_a_changed_one_is() {
    let (sim, e) = engine(1, 64 << 20);
    e.set_fingerprint_chunk(GRAN).unwrap();
    let mut data = bf16_like(8 * GRAN, 3);
    let a = weights(&e, &data);
    e.sleep(&["weights"]).unwrap();
    assert_eq!(compressed(&sim), 8, "one blob per chunk");
    e.wake(None::<&[&str]>).unwrap();
    assert_eq!(e.stats().retained_allocations, 1);

    // Unchanged: nothing compressed, nothing copied.
    let rep = e.sleep(&["weights"]).unwrap();
    assert_eq!(compressed(&sim), 8);
    assert_eq!((rep.skipped_bytes, rep.copied_bytes), (8 * GRAN, 0));
    e.wake(None::<&[&str]>).unwrap();
    assert!(e.read(a, data.len()).unwrap() == data);

    // One chunk changed: only its blob is made again.
    let patch = bf16_like(GRAN, 4);
    data[5 * GRAN..6 * GRAN].copy_from_slice(&patch);
    e.write(a + 5 * GRAN as u64, &patch).unwrap();
    let rep = e.sleep(&["weights"]).unwrap();
    assert_eq!(compressed(&sim), 9);
    assert_eq!((rep.skipped_bytes, rep.copied_bytes), (7 * GRAN, GRAN));
    e.wake(None::<&[&str]>).unwrap();
    assert!(
        e.read(a, data.len()).unwrap() == data,
        "the new blob restored"
    );
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn a_failed_compression_falls_back_to_raw_copies_for_that_sleep() {
    for op in [Op::Compress, Op::Fingerprint] {
        let (sim, e) = engine(1, 64 << 20);
        let data = bf16_like(8 * GRAN, 5);
        let a = weights(&e, &data);
        sim.inject_fault(op, 1, CUDA_ERROR_UNKNOWN).unwrap();
        let rep = e.sleep(&["weights"]).unwrap();
        assert_eq!((rep.copied_bytes, rep.raw_bytes), (data.len(), 0), "{op:?}");
        let s = e.stats();
        assert_eq!((s.asleep_allocations, s.compressed_bytes), (1, 0));
        assert!(
            e.errors().iter().any(|r| r.contains("copied them raw")),
            "{:?}",
            e.errors()
        );
        e.wake(None::<&[&str]>).unwrap();
        assert!(e.read(a, data.len()).unwrap() == data);
        e.close().unwrap();
        assert_no_leaks(&sim);
    }
}

#[test]
fn a_wake_that_cannot_decompress_or_restores_wrong_bytes_fails_whole_and_a_later_wake_succeeds() {
    for op in [Op::Decompress, Op::CorruptDecompress] {
        let (sim, e) = engine(1, 64 << 20);
        let data = bf16_like(8 * GRAN, 6);
        let a = weights(&e, &data);
        let other = bf16_like(2 * GRAN, 7);
        let b = weights(&e, &other);
        e.sleep(&["weights"]).unwrap();
        let mapped = sim.counts().mapped_bytes;
        sim.inject_fault(op, 1, CUDA_ERROR_UNKNOWN).unwrap();
        let err = e.wake(None::<&[&str]>).unwrap_err();
        assert!(
            err.to_string().contains(&format!("{a:#x}")),
            "{op:?}: {err}"
        );
        if op == Op::CorruptDecompress {
            assert!(err.to_string().contains("did not restore intact"), "{err}");
        }
        let s = e.stats();
        assert_eq!(s.asleep_allocations, 2, "every allocation stays asleep");
        assert_eq!(
            s.compressed_raw_bytes,
            data.len() + other.len(),
            "backups kept"
        );
        assert_eq!(
            sim.counts().mapped_bytes,
            mapped,
            "what the wake mapped is released"
        );
        e.wake(None::<&[&str]>).unwrap();
        assert!(e.read(a, data.len()).unwrap() == data);
        assert!(e.read(b, other.len()).unwrap() == other);
        e.close().unwrap();
        assert_no_leaks(&sim);
    }
}

#[test]
fn a_wake_maps_compressed_allocations_while_the_ones_before_are_restored_and_a_failed_map_fails_it_whole(
) {
    for op in [Op::Create, Op::Map, Op::SetAccess] {
        let (sim, e) = engine(1, 64 << 20);
        let data: Vec<Vec<u8>> = (0..3).map(|i| bf16_like(4 * GRAN, 20 + i)).collect();
        let addrs: Vec<u64> = data.iter().map(|d| weights(&e, d)).collect();
        // Not neighbours of one run: each allocation is mapped on its own, just before it is restored.
        e.set_wake_group_bytes(0).unwrap();
        e.sleep(&["weights"]).unwrap();
        let mapped = sim.counts().mapped_bytes;
        let restored = || {
            sim.inner()
                .codec_counts()
                .decompressed
                .load(Ordering::Relaxed)
        };
        let before = restored();
        // The third allocation's map fails: by then the first two were restored.
        sim.inject_fault(op, 3, CUDA_ERROR_UNKNOWN).unwrap();
        e.wake(None::<&[&str]>).unwrap_err();
        let first_try = restored() - before;
        let s = e.stats();
        assert_eq!(
            s.asleep_allocations, 3,
            "{op:?}: every allocation stays asleep"
        );
        assert_eq!(
            sim.counts().mapped_bytes,
            mapped,
            "{op:?}: what it mapped is released"
        );
        e.wake(None::<&[&str]>).unwrap();
        let all = restored() - before - first_try;
        assert!(
            first_try > 0 && first_try * 3 == all * 2,
            "{op:?}: the chunks of the two allocations before it were restored first ({first_try} of {all})"
        );
        for (a, d) in addrs.iter().zip(&data) {
            assert!(e.read(*a, d.len()).unwrap() == *d, "{op:?}: {a:#x}");
        }
        e.close().unwrap();
        assert_no_leaks(&sim);
    }
}

#[test]
fn a_compressed_sleep_into_a_buffer_pinned_ahead_in_cells_keeps_every_blob_inside_one_registration()
{
    // Cells of 4 MiB: the 16 MiB or so of blobs cross cell boundaries unless the store places them by piece (the
    // emulator refuses a blob copy that spans two registrations, as CUDA does).
    for stop_early in [false, true] {
        let (sim, e) = engine(1, 64 << 20);
        e.set_pin_chunk(4 << 20).unwrap();
        let data = bf16_like(24 << 20, 30);
        let a = weights(&e, &data);
        let want = e.backup_bytes_of(&["weights"]).unwrap();
        assert!(want < data.len(), "the estimate counts compression: {want}");
        e.reserve_host(want, true).unwrap();
        if !stop_early {
            let start = std::time::Instant::now();
            while e.pin_ahead_status().unwrap().running {
                assert!(
                    start.elapsed().as_secs() < 20,
                    "pinning ahead did not finish"
                );
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
        e.sleep(&["weights"]).unwrap();
        assert_eq!(e.errors(), Vec::<String>::new(), "stop_early={stop_early}");
        let s = e.stats();
        assert_eq!(
            s.compressed_raw_bytes,
            data.len(),
            "compressed, not copied raw"
        );
        e.wake(None::<&[&str]>).unwrap();
        assert!(e.read(a, data.len()).unwrap() == data);
        // The next sleep reuses what the wake left, and its blobs come back through the joined copies.
        e.sleep(&["weights"]).unwrap();
        e.wake(None::<&[&str]>).unwrap();
        assert!(e.read(a, data.len()).unwrap() == data);
        assert_eq!(e.errors(), Vec::<String>::new());
        e.close().unwrap();
        assert_no_leaks(&sim);
    }
}

#[test]
fn steady_compressed_cycles_reuse_the_blob_arena_instead_of_pinning_a_new_one() {
    let (sim, e) = engine(1, 64 << 20);
    e.set_retain_backups(false).unwrap(); // every sleep compresses and copies everything
    let data = bf16_like(16 << 20, 40);
    let a = weights(&e, &data);
    let registered = || calls(&sim, "host_register");
    let mut after = Vec::new();
    for _ in 0..4 {
        e.sleep(&["weights"]).unwrap();
        e.wake(None::<&[&str]>).unwrap();
        assert!(e.read(a, data.len()).unwrap() == data);
        after.push(registered());
    }
    // The first sleep guesses the ratio, the second sizes from the first's: from then on the arena the wake left
    // in the cache is the one the next sleep takes.
    assert_eq!(after[2], after[1], "registrations per cycle: {after:?}");
    assert_eq!(after[3], after[2], "registrations per cycle: {after:?}");
    assert!(
        e.host_bytes() > 0,
        "the arena stays cached for the next sleep"
    );
    assert_eq!(e.errors(), Vec::<String>::new());
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn compress_off_by_policy_or_by_configuration_keeps_backups_raw() {
    let (sim, e) = engine(1, 64 << 20);
    e.set_tag_policy(
        "weights",
        TagPolicy {
            compress: Compress::Off,
            ..TagPolicy::default()
        },
    )
    .unwrap();
    let data = bf16_like(8 * GRAN, 8);
    let a = weights(&e, &data);
    let rep = e.sleep(&["weights"]).unwrap();
    assert_eq!((rep.raw_bytes, e.stats().compressed_bytes), (0, 0));
    assert_eq!(e.host_bytes(), data.len());
    e.wake(None::<&[&str]>).unwrap();
    assert!(e.read(a, data.len()).unwrap() == data);
    e.close().unwrap();
    assert_no_leaks(&sim);

    let sim = Arc::new(
        SimDriver::new(SimConfig {
            granularity: GRAN,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let config = EngineConfig {
        compress: false,
        ..EngineConfig::default()
    };
    let e = Engine::with_config(sim.clone() as Arc<dyn Driver>, config).unwrap();
    assert!(e.stats().codec.is_none(), "compression is off");
    let a = weights(&e, &data);
    let rep = e.sleep(&["weights"]).unwrap();
    assert_eq!(rep.raw_bytes, 0);
    e.wake(None::<&[&str]>).unwrap();
    assert!(e.read(a, data.len()).unwrap() == data);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn partial_wakes_free_discard_and_trim_keep_working_with_compressed_backups() {
    let (sim, e) = engine(1, 64 << 20);
    let w = bf16_like(8 * GRAN, 9);
    let a = weights(&e, &w);
    e.push_tag("kv_cache").unwrap();
    let kv = bf16_like(4 * GRAN, 10);
    let b = e.malloc(kv.len(), 0, 0).unwrap();
    e.write(b, &kv).unwrap();
    let freed = e.malloc(4 * GRAN, 0, 0).unwrap();
    e.write(freed, &kv).unwrap();
    e.pop_tag().unwrap();
    e.sleep(&["weights", "kv_cache"]).unwrap();
    e.free(freed).unwrap();
    e.wake(Some(&["kv_cache"])).unwrap();
    assert!(e.read(b, kv.len()).unwrap() == kv);
    assert_eq!(
        e.stats().compressed_raw_bytes,
        w.len(),
        "the weights' backup stays"
    );
    e.wake(None::<&[&str]>).unwrap();
    assert!(e.read(a, w.len()).unwrap() == w);
    // A discard drops the retained backups of what it releases; trim drops every retained one.
    e.discard(&["kv_cache"]).unwrap();
    e.trim_host().unwrap();
    assert_eq!(e.stats().retained_allocations, 0);
    e.sleep(&["weights"]).unwrap();
    e.wake(None::<&[&str]>).unwrap();
    assert!(e.read(a, w.len()).unwrap() == w);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn blob_arenas_with_holes_are_compacted_within_the_host_bound() {
    // Random bytes (stored raw, so the first estimate of the ratio falls short and arenas grow), a retained
    // backup next to fresh ones, a partial wake: the blob arenas with holes are compacted like raw ones, so the
    // host memory held stays within the backups referenced plus one spare of the largest sleep's copies.
    let (sim, e) = engine(1, 64 << 20);
    let mut datas = Vec::new();
    let mut alloc = |e: &Engine, tag: &str, granules: usize, seed: u64| {
        let d = random_bytes(granules * GRAN, seed);
        e.push_tag(tag).unwrap();
        let a = e.malloc(d.len(), 0, 0).unwrap();
        e.pop_tag().unwrap();
        e.write(a, &d).unwrap();
        datas.push((a, d));
    };
    alloc(&e, "a", 2, 1);
    alloc(&e, "a", 1, 2);
    alloc(&e, "b", 2, 3);
    let mut largest = e.sleep(&["a"]).unwrap().copied_bytes;
    e.wake(None::<&[&str]>).unwrap();
    alloc(&e, "a", 1, 4);
    // Released without backup by the sleep of "a": its undefined contents (the sim's poison) are what it holds.
    let b_addr = datas[2].0;
    datas[2].1 = e.read(b_addr, 2 * GRAN).unwrap();
    largest = largest.max(e.sleep(&["a", "b"]).unwrap().copied_bytes);
    e.wake(Some(&["b"])).unwrap();
    let s = e.stats();
    let referenced = s.host_tier_stored_bytes + s.host_retained_bytes;
    // The spare is the largest sleep's arena: its copies, plus the end of its first pinned piece when it grew in
    // place (a blob lies inside one piece: less than the largest range, 2 granules here, stays unused there).
    let piece_end = 2 * GRAN;
    assert!(
        e.host_bytes() <= referenced + largest + piece_end,
        "{} held for {referenced} referenced (largest sleep {largest})",
        e.host_bytes()
    );
    e.wake(None::<&[&str]>).unwrap();
    for (a, d) in &datas {
        assert!(
            e.read(*a, d.len()).unwrap() == *d,
            "data of {a:#x} ({} bytes)",
            d.len()
        );
    }
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn compacting_blob_arenas_moves_the_blobs_intact() {
    // A partial wake leaves a hole in the blob arena; a reservation compacts first (bound.rs), moving the
    // remaining blobs into an arena of exactly their size; the next wake restores (and verifies) them.
    let (sim, e) = engine(1, 64 << 20);
    e.set_retain_backups(false).unwrap();
    let wa = bf16_like(8 * GRAN, 30);
    let a = weights(&e, &wa);
    e.push_tag("kv_cache").unwrap();
    let wb = bf16_like(8 * GRAN, 31);
    let b = e.malloc(wb.len(), 0, 0).unwrap();
    e.write(b, &wb).unwrap();
    e.pop_tag().unwrap();
    e.sleep(&["weights", "kv_cache"]).unwrap();
    e.wake(Some(&["weights"])).unwrap();
    let stored = e.stats().host_tier_stored_bytes;
    assert!(
        e.stats().host_backup_bytes > stored,
        "the weights' blobs left a hole"
    );
    e.reserve_host(64 * GRAN, false).unwrap();
    assert_eq!(
        e.stats().host_backup_bytes,
        stored,
        "the blobs moved into an arena of their size"
    );
    e.wake(None::<&[&str]>).unwrap();
    assert!(e.read(a, wa.len()).unwrap() == wa);
    assert!(e.read(b, wb.len()).unwrap() == wb);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn data_compressing_worse_than_the_guess_grows_the_arena_in_place_and_later_sleeps_pin_nothing() {
    // Half random bytes (stored raw), half bf16-like: worse than the first guess (bf16's ratio), so the first
    // sleep's arena falls short and grows in place (a second registration of the same buffer); every later sleep
    // takes that one arena from the cache.
    let (sim, e) = engine(1, 256 << 20);
    e.set_retain_backups(false).unwrap();
    let mut data = random_bytes(8 << 20, 7);
    data.extend(bf16_like(8 << 20, 8));
    let a = weights(&e, &data);
    let (mut registered, mut unregistered) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        let rep = e.sleep(&["weights"]).unwrap();
        assert!(
            rep.stored_bytes > 0 && rep.stored_bytes < data.len(),
            "compressed: {}",
            rep.stored_bytes
        );
        e.wake(None::<&[&str]>).unwrap();
        assert!(e.read(a, data.len()).unwrap() == data);
        registered.push(calls(&sim, "host_register"));
        unregistered.push(calls(&sim, "host_unregister"));
    }
    assert_eq!(
        registered[0], 2,
        "one arena pinned, then grown once: {registered:?}"
    );
    assert_eq!(unregistered[0], 0, "nothing pinned beside it and returned");
    assert!(
        registered.windows(2).all(|w| w[0] == w[1])
            && unregistered.windows(2).all(|w| w[0] == w[1]),
        "later sleeps pin and unpin nothing: {registered:?} {unregistered:?}"
    );
    assert!(e.host_bytes() < data.len(), "{}", e.host_bytes());
    assert_eq!(e.errors(), Vec::<String>::new());
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn after_a_sleep_of_incompressible_bytes_the_estimate_counts_them_raw_and_the_rest_at_its_own_ratio(
) {
    let (_sim, e) = engine(1, 64 << 20);
    e.set_retain_backups(false).unwrap();
    let noise = random_bytes(32 * GRAN, 31);
    let w = bf16_like(8 * GRAN, 32);
    let (a, b) = (weights(&e, &noise), weights(&e, &w));
    e.sleep(&["weights"]).unwrap(); // both through the codec; the noise keeps no chunk compressed
    e.wake(None::<&[&str]>).unwrap();
    let estimate = e.backup_bytes_of(&["weights"]).unwrap();
    let rep = e.sleep(&["weights"]).unwrap(); // the noise skips the codec: the bf16 blobs alone
    assert_eq!(
        rep.raw_bytes,
        w.len(),
        "only the bf16 allocation was compressed"
    );
    let ratio = rep.stored_bytes as f64 / rep.raw_bytes as f64;
    // What pinning ahead sizes for (the store's 5% over its guess): the noise at its raw size, the bf16 bytes at
    // their own ratio, not at one diluted by the noise stored raw.
    let expected = noise.len() + (w.len() as f64 * ratio * 1.05) as usize;
    assert!(
        estimate.abs_diff(expected) <= 1,
        "estimate {estimate}, expected {expected} (bf16 ratio {ratio:.3})"
    );
    e.wake(None::<&[&str]>).unwrap();
    assert!(e.read(a, noise.len()).unwrap() == noise);
    assert!(e.read(b, w.len()).unwrap() == w);
    e.close().unwrap();
}

#[test]
fn an_allocation_the_codec_could_not_shrink_sleeps_raw_and_is_tried_again_later() {
    let (sim, e) = engine(1, 64 << 20);
    e.set_retain_backups(false).unwrap();
    let noise = random_bytes(8 * GRAN, 21);
    let a = weights(&e, &noise);
    let w = bf16_like(8 * GRAN, 22);
    let b = weights(&e, &w);
    let (mut codec_calls, mut compressed_raw, mut registered) =
        (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..10 {
        let before = compressed(&sim);
        let rep = e.sleep(&["weights"]).unwrap();
        codec_calls.push(compressed(&sim) - before);
        compressed_raw.push(rep.raw_bytes);
        registered.push(calls(&sim, "host_register"));
        e.wake(None::<&[&str]>).unwrap();
        assert!(e.read(a, noise.len()).unwrap() == noise);
        assert!(e.read(b, w.len()).unwrap() == w);
    }
    // Sleep 0 compresses both; sleeps 1-8 the bf16 one alone (the noise goes raw); sleep 9 tries both again.
    let (both, one) = (codec_calls[0], codec_calls[1]);
    assert!(one > 0 && both > one, "{codec_calls:?}");
    assert!(
        codec_calls[1..9].iter().all(|&c| c == one),
        "{codec_calls:?}"
    );
    assert_eq!(codec_calls[9], both, "{codec_calls:?}");
    assert_eq!(compressed_raw[0], noise.len() + w.len(), "both compressed");
    assert_eq!(
        compressed_raw[1],
        w.len(),
        "the noise went down the raw path"
    );
    // The raw copies take the arena the last sleep left cached (the blobs' placer leaves it to them): from then
    // on a sleep pins at most the small arena of the bf16 blobs. Sleep 1 included: its estimate for the bf16
    // blobs is their own ratio, not one diluted by the noise stored raw (an arena too large for them was moved
    // into a second, exact one at the end of that sleep).
    let pinned: Vec<u64> = registered.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(pinned[..8].iter().all(|&n| n <= 1), "{registered:?}");
    // Freed, and allocated again with the same bytes: the new allocation is tried at once.
    e.free(a).unwrap();
    let c = weights(&e, &noise);
    let before = compressed(&sim);
    e.sleep(&["weights"]).unwrap();
    assert_eq!(compressed(&sim) - before, both, "a new allocation is tried");
    e.wake(None::<&[&str]>).unwrap();
    assert!(e.read(c, noise.len()).unwrap() == noise);
    assert_eq!(e.errors(), Vec::<String>::new());
    e.close().unwrap();
    assert_no_leaks(&sim);
}

/// Wake everything and check that each allocation holds its data again.
fn wake_intact(e: &Engine, addrs: &[u64], data: &[Vec<u8>], what: &str) {
    e.wake(None::<&[&str]>).unwrap();
    for (a, d) in addrs.iter().zip(data) {
        assert!(e.read(*a, d.len()).unwrap() == *d, "{what}");
    }
}

#[test]
fn a_compression_failing_part_way_keeps_the_finished_backups_and_copies_the_rest_raw() {
    // Three allocations of two 2 MiB chunks: the codec fails at each blob in turn. Those whose blobs were all
    // finished before it were released during the compression and must keep their compressed backups; the
    // others are copied raw by the same sleep. Every allocation sleeps and wakes with its data.
    // Second round: after a wake, which maps them as one wake group (one handle): the group is unmapped under
    // the codec only once all three are complete.
    const CHUNKS: usize = 2;
    let size = CHUNKS * (2 << 20);
    for (grouped, nth) in [false, true]
        .into_iter()
        .flat_map(|g| (1..=(3 * CHUNKS) as u64).map(move |n| (g, n)))
    {
        let (sim, e) = engine(1, 128 << 20);
        let data: Vec<Vec<u8>> = (0..3).map(|i| bf16_like(size, 40 + i)).collect();
        let addrs: Vec<u64> = data.iter().map(|d| weights(&e, d)).collect();
        if grouped {
            e.sleep(&["weights"]).unwrap();
            e.wake(None::<&[&str]>).unwrap();
            assert_eq!(e.stats().wake_groups, 1);
            e.set_retain_backups(false).unwrap();
        }
        sim.inject_fault(Op::CompressBlob, nth, CUDA_ERROR_UNKNOWN)
            .unwrap();
        let rep = e.sleep(&["weights"]).unwrap();
        let finished = (nth as usize - 1) / CHUNKS;
        assert_eq!(rep.raw_bytes, finished * size, "fault at blob {nth}");
        assert_eq!(rep.copied_bytes, 3 * size, "fault at blob {nth}");
        assert_eq!(e.stats().asleep_allocations, 3, "fault at blob {nth}");
        assert_eq!(sim.counts().mapped_bytes, 0, "fault at blob {nth}");
        assert!(
            e.errors().iter().any(|r| r.contains("copied them raw")),
            "{:?}",
            e.errors()
        );
        wake_intact(&e, &addrs, &data, &format!("fault at blob {nth}"));
        e.close().unwrap();
        assert_no_leaks(&sim);
    }
}

#[test]
fn a_failed_unmap_or_release_during_a_compression_keeps_the_data_and_is_reported() {
    // The codec's allocations are unmapped and released while it works on the next ones (as each backup is
    // complete): a failure of either there must leave the allocation awake with its data (unmap) or asleep with
    // its backup and the handle queued for retry (release), as a release after the codec would.
    let size = 4 * (2 << 20);
    for op in [Op::Unmap, Op::Release] {
        for nth in 1..=3u64 {
            let (sim, e) = engine(1, 128 << 20);
            let data: Vec<Vec<u8>> = (0..3).map(|i| bf16_like(size, 50 + i)).collect();
            let addrs: Vec<u64> = data.iter().map(|d| weights(&e, d)).collect();
            sim.inject_fault(op, nth, CUDA_ERROR_UNKNOWN).unwrap();
            let slept = e.sleep(&["weights"]);
            let asleep = e.stats().asleep_allocations;
            match op {
                Op::Unmap => {
                    let err = slept.unwrap_err();
                    assert!(err.to_string().contains("unmap"), "{err}");
                    assert_eq!(asleep, 2, "{op:?}#{nth}");
                    assert_eq!(sim.counts().mapped_bytes, size, "{op:?}#{nth}");
                }
                _ => {
                    slept.unwrap();
                    assert_eq!(asleep, 3, "{op:?}#{nth}");
                    assert!(
                        e.errors().iter().any(|r| r.contains("queued for retry")),
                        "{:?}",
                        e.errors()
                    );
                }
            }
            wake_intact(&e, &addrs, &data, &format!("{op:?}#{nth}"));
            e.close().unwrap();
            assert_no_leaks(&sim);
        }
    }
}

#[test]
fn a_wake_group_unmapped_under_the_codec_keeps_every_member_awake_when_its_unmap_fails() {
    // After a wake the three allocations share one handle; the compressed sleep unmaps it once all three
    // backups are complete. If that one unmap fails, every member stays awake with its data, and a later sleep
    // and wake succeed.
    let size = 4 * (2 << 20);
    let (sim, e) = engine(1, 128 << 20);
    let data: Vec<Vec<u8>> = (0..3).map(|i| bf16_like(size, 60 + i)).collect();
    let addrs: Vec<u64> = data.iter().map(|d| weights(&e, d)).collect();
    e.sleep(&["weights"]).unwrap();
    e.wake(None::<&[&str]>).unwrap();
    assert_eq!(e.stats().wake_groups, 1);
    e.set_retain_backups(false).unwrap();
    sim.inject_fault(Op::Unmap, 1, CUDA_ERROR_UNKNOWN).unwrap();
    let err = e.sleep(&["weights"]).unwrap_err();
    assert!(err.to_string().contains("unmap"), "{err}");
    assert_eq!(e.stats().asleep_allocations, 0);
    assert_eq!(sim.counts().mapped_bytes, 3 * size);
    // Nothing went to sleep, and the sleep's report says so (its members before the last were only marked).
    let rep = e.stats().last_sleep.expect("a sleep ran");
    assert_eq!((rep.raw_bytes, rep.copied_bytes), (0, 0));
    for (a, d) in addrs.iter().zip(&data) {
        assert!(e.read(*a, size).unwrap() == *d);
    }
    let rep = e.sleep(&["weights"]).unwrap();
    assert_eq!(rep.raw_bytes, 3 * size);
    wake_intact(&e, &addrs, &data, "after the failed unmap");
    // The group's handle is released under the codec too: a failure there puts every member to sleep with its
    // backup and queues the handle for retry.
    assert_eq!(e.stats().wake_groups, 1);
    sim.inject_fault(Op::Release, 1, CUDA_ERROR_UNKNOWN)
        .unwrap();
    e.sleep(&["weights"]).unwrap();
    assert_eq!(e.stats().asleep_allocations, 3);
    assert!(
        e.errors().iter().any(|r| r.contains("queued for retry")),
        "{:?}",
        e.errors()
    );
    wake_intact(&e, &addrs, &data, "after the failed release");
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn a_compression_failing_after_an_unchanged_backup_was_kept_counts_every_byte_once() {
    // Found by the fault state machine: an unchanged retained backup is complete before the codec starts (kept, its
    // allocation released), then the codec fails on a changed one, which is copied raw, all of it. Its unchanged
    // chunks must not count as skipped too: copied + skipped is the bytes backed up.
    let (sim, e) = engine(1, 64 << 20);
    e.set_fingerprint_chunk(GRAN).unwrap();
    let kept = bf16_like(4 * GRAN, 70);
    let mut changed = bf16_like(4 * GRAN, 71);
    let (a, b) = (weights(&e, &kept), weights(&e, &changed));
    e.sleep(&["weights"]).unwrap();
    e.wake(None::<&[&str]>).unwrap();
    assert_eq!(e.stats().retained_allocations, 2);
    let patch = bf16_like(GRAN, 72);
    changed[..GRAN].copy_from_slice(&patch);
    e.write(b, &patch).unwrap();
    sim.inject_fault(Op::Compress, 1, CUDA_ERROR_UNKNOWN)
        .unwrap();
    let rep = e.sleep(&["weights"]).unwrap();
    assert_eq!(
        (rep.skipped_bytes, rep.copied_bytes),
        (kept.len(), changed.len())
    );
    assert_eq!(e.stats().asleep_allocations, 2);
    wake_intact(&e, &[a, b], &[kept, changed], "after the fallback");
    e.close().unwrap();
    assert_no_leaks(&sim);
}

/// A simulated engine whose host can pin at most `host_memory` bytes.
fn engine_with_host(host_memory: usize) -> (Arc<SimDriver>, Engine) {
    let sim = Arc::new(
        SimDriver::new(SimConfig {
            granularity: GRAN,
            host_memory: Some(host_memory),
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let e = Engine::new(sim.clone() as Arc<dyn Driver>).unwrap();
    (sim, e)
}

/// One allocation of tag "kv", whose policy is `compress="off"`, holding `data`.
fn uncompressed_kv(e: &Engine, data: &[u8]) -> u64 {
    let off = TagPolicy {
        compress: Compress::Off,
        ..TagPolicy::default()
    };
    e.set_tag_policy("kv", off).unwrap();
    e.push_tag("kv").unwrap();
    let c = e.malloc(data.len(), 0, 0).unwrap();
    e.pop_tag().unwrap();
    e.write(c, data).unwrap();
    c
}

#[test]
fn a_sleep_refused_after_the_codec_leaves_a_wake_group_whole_and_the_next_sleep_sound() {
    // Found by review: A and B (bf16) and C (random, so it skips the codec after its first sleep) share one wake
    // group. The codec finishes A and B, but the group waits for C, whose raw copy the host cannot pin (9.5 MiB
    // of host memory: the first sleep fits, the second's blobs take the cached arena and C's 6 MiB do not).
    // The refusal must leave all three awake with their data and the group's state clean: the next sleep had
    // found A and B still marked released, unmapped the group with C unbacked and panicked.
    let (sim, e) = engine_with_host(19 << 19);
    let size = 2 << 20;
    let data = vec![
        bf16_like(size, 80),
        bf16_like(size, 81),
        random_bytes(3 * size, 82),
    ];
    let addrs: Vec<u64> = data.iter().map(|d| weights(&e, d)).collect();
    e.sleep(&["weights"]).unwrap();
    e.wake(None::<&[&str]>).unwrap();
    assert_eq!(e.stats().wake_groups, 1);
    e.set_retain_backups(false).unwrap();
    for attempt in 0..2 {
        let err = e.sleep(&["weights"]).unwrap_err();
        assert!(
            err.to_string().contains("every allocation stays awake"),
            "{err}"
        );
        assert_eq!(e.stats().asleep_allocations, 0, "attempt {attempt}");
        for (a, d) in addrs.iter().zip(&data) {
            assert!(e.read(*a, d.len()).unwrap() == *d, "attempt {attempt}");
        }
    }
    e.discard(&["weights"]).unwrap();
    assert_eq!(e.stats().asleep_allocations, 3);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn a_sleep_whose_worst_case_does_not_fit_releases_nothing_under_the_codec_and_is_refused_whole() {
    // A and B compress; C (compress="off") then needs a raw arena the host (5 MiB) cannot give beside their blobs.
    // Its worst case (every chunk raw: 10 MiB) does not fit the host's room, so the codec releases nothing as it
    // goes (before the host guard bounded the real peak, A and B were released under the codec and the refusal
    // came after they had gone to sleep): the refusal leaves every allocation awake with its data, and the
    // blobs go back.
    let (sim, e) = engine_with_host(5 << 20);
    let size = 2 << 20;
    let data = vec![bf16_like(size, 90), bf16_like(size, 91)];
    let addrs: Vec<u64> = data.iter().map(|d| weights(&e, d)).collect();
    let kv = random_bytes(3 * size, 92);
    let c = uncompressed_kv(&e, &kv);
    let err = e.sleep(&["weights", "kv"]).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("every allocation stays awake"), "{text}");
    assert_eq!(e.stats().asleep_allocations, 0);
    assert!(e.read(c, kv.len()).unwrap() == kv);
    for (a, d) in addrs.iter().zip(&data) {
        assert!(e.read(*a, d.len()).unwrap() == *d, "after the refusal");
    }
    assert_eq!(e.stats().host_backup_bytes, 0, "the blobs made went back");
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn a_refusal_after_a_wake_group_stayed_awake_under_the_codec_does_not_count_it_asleep() {
    // Found by review: a group's unmap under the codec fails (its members stay awake), then the same sleep is
    // refused the raw arena of another tag (7 MiB of host memory: the blobs take the arena the first sleep left,
    // the other tag's 6 MiB do not fit beside it). The refusal must not say that allocations went to sleep.
    let (sim, e) = engine_with_host(7 << 20);
    let size = 2 << 20;
    let data = vec![bf16_like(size, 95), bf16_like(size, 96)];
    let addrs: Vec<u64> = data.iter().map(|d| weights(&e, d)).collect();
    e.sleep(&["weights"]).unwrap();
    e.wake(None::<&[&str]>).unwrap();
    assert_eq!(e.stats().wake_groups, 1);
    e.set_retain_backups(false).unwrap();
    let kv = random_bytes(3 * size, 97);
    let c = uncompressed_kv(&e, &kv);
    sim.inject_fault(Op::Unmap, 1, CUDA_ERROR_UNKNOWN).unwrap();
    let err = e.sleep(&["weights", "kv"]).unwrap_err();
    assert!(
        err.to_string().contains("every allocation stays awake"),
        "{err}"
    );
    assert_eq!(e.stats().asleep_allocations, 0);
    for (a, d) in addrs.iter().zip(&data) {
        assert!(e.read(*a, d.len()).unwrap() == *d);
    }
    assert!(e.read(c, kv.len()).unwrap() == kv);
    // The sleep's worst case does not fit the host's room: nothing was unmapped under the codec (see the test
    // above), so the fault may still be armed.
    sim.clear_faults();
    e.close().unwrap();
    assert_no_leaks(&sim);
}
