//! The host budget and the file tier of the backup store on the simulated driver: what goes where, that the
//! bytes come back, and the transactional promises when a spill file's write or read fails.

mod common;

use common::{assert_no_leaks, engine, pattern, raw_engine, GRAN};
use cumem_rs::{Engine, Error};

/// Every allocation holds its bytes.
fn check_data(e: &Engine, tensors: &[(u64, Vec<u8>)]) {
    for (a, d) in tensors {
        assert_eq!(e.read(*a, d.len()).unwrap(), *d, "data of {a:#x}");
    }
}

fn weights(e: &Engine, granules: usize, seed: u8) -> (u64, Vec<u8>) {
    e.push_tag("weights").unwrap();
    let addr = e.malloc(granules * GRAN, 0, 0).unwrap();
    e.pop_tag().unwrap();
    let data = pattern(seed, granules * GRAN);
    e.write(addr, &data).unwrap();
    (addr, data)
}

#[test]
fn without_a_spill_dir_a_sleep_past_the_host_budget_is_refused_before_anything_is_released() {
    // Raw backups: these patterns compress to a few hundred bytes, which would fit any budget.
    let (sim, e) = raw_engine(1, 16 << 20);
    let (a, da) = weights(&e, 2, 1);
    let (b, db) = weights(&e, 2, 2);
    e.set_host_budget(Some(3 * GRAN)).unwrap();
    let err = e.sleep(&["weights"]).unwrap_err();
    assert!(
        matches!(&err, Error::OutOfMemory { what } if what.contains("host budget of 196608 bytes")),
        "{err}"
    );
    assert_eq!(e.stats().asleep_allocations, 0, "nothing was released");
    assert_eq!(
        (e.read(a, da.len()).unwrap(), e.read(b, db.len()).unwrap()),
        (da.clone(), db.clone())
    );
    assert_eq!(e.host_bytes(), 0);
    // Within the budget it sleeps, and what is held stays within it.
    e.set_host_budget(Some(4 * GRAN)).unwrap();
    e.sleep(&["weights"]).unwrap();
    assert!(e.host_bytes() <= 4 * GRAN);
    e.wake::<&str>(None).unwrap();
    assert_eq!(
        (e.read(a, da.len()).unwrap(), e.read(b, db.len()).unwrap()),
        (da, db)
    );
    // A reservation past the budget is refused too.
    assert!(matches!(
        e.reserve_host(8 * GRAN, false),
        Err(Error::OutOfMemory { .. })
    ));
    e.set_host_budget(None).unwrap();
    e.close().unwrap();
    assert_no_leaks(&sim);
}

/// A fresh directory under the system's temporary directory, removed when dropped.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("cumem-rs-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn entries(&self) -> usize {
        std::fs::read_dir(&self.0).unwrap().count()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An engine with a host budget of `budget` granules, a spill directory and a small staging ring (several
/// chunks per allocation and a ring that wraps).
fn spilling(dir: &TempDir, budget: usize) -> (std::sync::Arc<cumem_rs::SimDriver>, Engine) {
    let (sim, e) = engine(1, 32 << 20);
    e.set_host_budget(Some(budget * GRAN)).unwrap();
    e.set_spill_dir(Some(&dir.0)).unwrap();
    e.set_staging_bytes(8 * 4096).unwrap();
    (sim, e)
}

#[test]
fn auto_fills_the_budget_first_and_sends_the_rest_to_an_unlinked_file() {
    let dir = TempDir::new("auto");
    let (sim, e) = spilling(&dir, 2);
    let tensors: Vec<_> = (0..4).map(|i| weights(&e, 1 + i % 2, i as u8)).collect();
    let rep = e.sleep(&["weights"]).unwrap();
    let total: usize = tensors.iter().map(|t| t.1.len()).sum();
    assert_eq!(rep.copied_bytes, total);
    let s = e.stats();
    assert_eq!(s.asleep_allocations, 4);
    assert!(e.host_bytes() <= 2 * GRAN, "host memory within the budget");
    assert_eq!(s.host_tier_bytes + s.file_tier_bytes, total);
    assert!(s.file_tier_bytes > 0 && s.host_tier_bytes > 0);
    assert_eq!(rep.written_bytes, s.file_tier_bytes);
    assert_eq!(dir.entries(), 0, "spill files are unlinked from the start");
    // Reads of an asleep backup see the file's bytes.
    let (a, d) = &tensors[3];
    assert_eq!(e.read_backup(*a, d.len()).unwrap().unwrap(), *d);
    let woke = e.wake::<&str>(None).unwrap();
    assert_eq!(woke.read_bytes, s.file_tier_bytes);
    check_data(&e, &tensors);
    assert_eq!(e.stats().file_tier_bytes, 0);
    // Again: the backups (in files too) were retained by the wake and nothing changed, so nothing is written.
    let again = e.sleep(&["weights"]).unwrap();
    assert_eq!((again.written_bytes, again.skipped_bytes), (0, total));
    e.wake::<&str>(None).unwrap();
    check_data(&e, &tensors);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn a_file_policy_without_a_spill_dir_is_refused_before_anything_is_released() {
    let (sim, e) = engine(1, 16 << 20);
    let (a, d) = weights(&e, 2, 7);
    let policy = cumem_rs::TagPolicy {
        backup_tier: cumem_rs::backups::BackupTier::File,
        ..Default::default()
    };
    e.set_tag_policy("weights", policy).unwrap();
    let err = e.sleep(&["weights"]).unwrap_err();
    assert!(err.to_string().contains("spill directory"), "{err}");
    assert_eq!(e.read(a, d.len()).unwrap(), d);
    assert!(
        matches!(e.set_spill_dir(Some("/nonexistent/x".as_ref())), Err(Error::InvalidArgument(m)) if m.contains("/nonexistent/x"))
    );
    e.close().unwrap();
    assert_no_leaks(&sim);
}

/// After a failed sleep every allocation is awake with its data or asleep with a complete backup; a later
/// wake restores everything asleep.
fn check_after_failure(e: &Engine, tensors: &[(u64, Vec<u8>)]) {
    let asleep: Vec<u64> = (e.allocations().unwrap().iter())
        .filter(|i| i.asleep)
        .map(|i| i.addr)
        .collect();
    for (a, d) in tensors {
        if asleep.contains(a) {
            assert_eq!(
                e.read_backup(*a, d.len()).unwrap().unwrap(),
                *d,
                "complete backup"
            );
        } else {
            assert_eq!(e.read(*a, d.len()).unwrap(), *d, "awake with its data");
        }
    }
    e.wake::<&str>(None).unwrap();
    check_data(e, tensors);
}

#[test]
fn a_failed_write_at_any_position_keeps_every_allocation_whole() {
    let dir = TempDir::new("write-faults");
    for kind in ["short", "enospc", "eio"] {
        for nth in 1..=12 {
            let (sim, e) = spilling(&dir, 0);
            let tensors: Vec<_> = (0..3).map(|i| weights(&e, 1 + i % 2, i as u8)).collect();
            e.inject_spill_fault("write", nth, kind).unwrap();
            let r = e.sleep(&["weights"]);
            if nth <= 4 {
                assert!(r.is_err(), "{kind} at write {nth} fails the sleep");
            }
            if kind == "enospc" {
                if let Err(err) = &r {
                    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
                }
            }
            e.clear_spill_faults().unwrap();
            check_after_failure(&e, &tensors);
            e.close().unwrap();
            assert_no_leaks(&sim);
        }
    }
}

#[test]
fn a_failed_read_at_any_position_fails_the_wake_and_a_later_wake_succeeds() {
    let dir = TempDir::new("read-faults");
    for kind in ["short", "eio"] {
        for nth in 1..=12 {
            let (sim, e) = spilling(&dir, 0);
            let tensors: Vec<_> = (0..3).map(|i| weights(&e, 1 + i % 2, i as u8)).collect();
            e.sleep(&["weights"]).unwrap();
            let used = sim.counts().used_bytes[0];
            e.inject_spill_fault("read", nth, kind).unwrap();
            let r = e.wake::<&str>(None);
            e.clear_spill_faults().unwrap();
            if r.is_err() {
                assert_eq!(
                    e.stats().asleep_allocations,
                    3,
                    "{kind} at read {nth}: all stay asleep"
                );
                assert_eq!(
                    sim.counts().used_bytes[0],
                    used,
                    "what the wake mapped was released"
                );
                e.wake::<&str>(None).unwrap();
            } else {
                assert!(nth > 4, "{kind} at read {nth} must fail the wake");
            }
            check_data(&e, &tensors);
            e.close().unwrap();
            assert_no_leaks(&sim);
        }
    }
}

#[test]
fn a_failed_device_copy_into_the_ring_keeps_every_allocation_whole() {
    use cumem_rs::driver::Op;
    let dir = TempDir::new("copy-faults");
    for nth in 1..=8 {
        let (sim, e) = spilling(&dir, 0);
        let tensors: Vec<_> = (0..3).map(|i| weights(&e, 1 + i % 2, i as u8)).collect();
        sim.inject_fault(Op::CopyD2H, nth, cumem_rs::error::cuda_code::UNKNOWN)
            .unwrap();
        let _ = e.sleep(&["weights"]);
        sim.clear_faults();
        check_after_failure(&e, &tensors);
        e.close().unwrap();
        assert_no_leaks(&sim);
    }
}

#[test]
fn a_failed_copy_from_the_ring_to_the_device_fails_the_wake_and_keeps_the_backups() {
    use cumem_rs::driver::Op;
    let dir = TempDir::new("h2d-faults");
    for nth in 1..=6 {
        let (sim, e) = spilling(&dir, 0);
        let tensors: Vec<_> = (0..3).map(|i| weights(&e, 1 + i % 2, i as u8)).collect();
        e.sleep(&["weights"]).unwrap();
        let used = sim.counts().used_bytes[0];
        sim.inject_fault(Op::CopyH2D, nth, cumem_rs::error::cuda_code::UNKNOWN)
            .unwrap();
        let r = e.wake::<&str>(None);
        sim.clear_faults();
        assert!(r.is_err(), "copy {nth} of the wake failed");
        assert_eq!(
            e.stats().asleep_allocations,
            3,
            "copy {nth}: all stay asleep"
        );
        assert_eq!(
            sim.counts().used_bytes[0],
            used,
            "what the wake mapped was released"
        );
        e.wake::<&str>(None).unwrap();
        check_data(&e, &tensors);
        e.close().unwrap();
        assert_no_leaks(&sim);
    }
}

/// The wake report splits the file pipeline's time into waiting for reads and the ring's device copies (what
/// the GPU bench prints to show where a wake from files spends its time); none of it without files.
#[test]
fn a_wake_from_files_reports_where_its_pipeline_time_went() {
    let dir = TempDir::new("phases");
    let (sim, e) = spilling(&dir, 0);
    e.set_retain_backups(false).unwrap(); // the wake drops its file backups: the spill file closes in it
    let tensors: Vec<_> = (0..4).map(|i| weights(&e, 2, i as u8)).collect();
    let slept = e.sleep(&["weights"]).unwrap();
    assert_eq!(
        (slept.file_read_wait_seconds, slept.file_copy_seconds),
        (0.0, 0.0),
        "wake only"
    );
    let woke = e.wake::<&str>(None).unwrap();
    check_data(&e, &tensors);
    assert_eq!(woke.read_bytes, 8 * GRAN);
    let (read, copy) = (woke.file_read_wait_seconds, woke.file_copy_seconds);
    assert!(read > 0.0 && copy > 0.0, "{woke:?}");
    assert!(
        read + copy <= woke.file_seconds,
        "parts of the pipeline: {woke:?}"
    );
    assert!(
        woke.file_seconds + woke.release_seconds <= woke.seconds,
        "{woke:?}"
    );
    assert!(
        woke.release_seconds > 0.0,
        "the spill file was closed: {woke:?}"
    );
    // Host backups only: no file pipeline, no parts of it.
    e.set_host_budget(None).unwrap();
    e.set_spill_dir(None).unwrap();
    e.sleep(&["weights"]).unwrap();
    let woke = e.wake::<&str>(None).unwrap();
    assert_eq!(woke.read_bytes, 0);
    let parts = (
        woke.file_seconds,
        woke.file_read_wait_seconds,
        woke.file_copy_seconds,
    );
    assert_eq!(parts, (0.0, 0.0, 0.0));
    check_data(&e, &tensors);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn free_and_close_drop_file_backups_and_the_ring() {
    let dir = TempDir::new("free");
    let (sim, e) = spilling(&dir, 0);
    let (a, _) = weights(&e, 2, 1);
    let (b, _) = weights(&e, 1, 2);
    e.sleep(&["weights"]).unwrap();
    assert_eq!(e.stats().file_tier_bytes, 3 * GRAN);
    e.free(a).unwrap();
    assert_eq!(e.stats().file_tier_bytes, GRAN);
    assert!(e.stats().staging_bytes > 0);
    e.trim_host().unwrap();
    assert_eq!(e.stats().staging_bytes, 0, "trim_host returns the ring");
    e.free(b).unwrap();
    assert_eq!(e.stats().file_tier_bytes, 0);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn io_threads_the_os_refuses_are_recorded_and_their_work_runs_on_the_calling_thread() {
    use cumem_rs::driver::Op;
    let dir = TempDir::new("threads");
    let (sim, e) = spilling(&dir, 0);
    let tensors: Vec<_> = (0..3).map(|i| weights(&e, 2, i as u8)).collect();
    for phase in ["sleep", "wake"] {
        let before = e.errors().len();
        sim.inject_fault(Op::ThreadSpawn, 1, 999).unwrap();
        if phase == "sleep" {
            e.sleep(&["weights"]).unwrap();
        } else {
            e.wake::<&str>(None).unwrap();
        }
        sim.clear_faults();
        let errors = e.errors();
        assert!(
            errors.len() > before,
            "{phase}: the refused thread is recorded"
        );
        assert!(
            errors.last().unwrap().contains("worker thread"),
            "{errors:?}"
        );
    }
    check_data(&e, &tensors);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn with_a_spill_dir_auto_parks_more_than_the_host_can_pin() {
    let dir = TempDir::new("guard");
    let sim = std::sync::Arc::new(
        cumem_rs::SimDriver::new(cumem_rs::SimConfig {
            devices: 1,
            capacity: 16 << 20,
            granularity: GRAN,
            host_memory: Some(3 * GRAN + 8 * 4096), // three granules beside the staging ring
            // Raw backups: these patterns compress to almost nothing, which the guard now lets into three
            // granules (it sizes blob arenas by the room, not by the first guess of the ratio).
            compress: false,
            ..cumem_rs::SimConfig::default()
        })
        .unwrap(),
    );
    let e = Engine::new(sim.clone() as std::sync::Arc<dyn cumem_rs::driver::Driver>).unwrap();
    e.set_staging_bytes(8 * 4096).unwrap();
    let tensors: Vec<_> = (0..4).map(|i| weights(&e, 2, i as u8)).collect();
    // No spill directory: refused by the host RAM guard, as before.
    assert!(matches!(
        e.sleep(&["weights"]),
        Err(Error::OutOfMemory { .. })
    ));
    assert_eq!(e.stats().asleep_allocations, 0);
    e.set_spill_dir(Some(&dir.0)).unwrap();
    e.sleep(&["weights"]).unwrap();
    let s = e.stats();
    assert!(
        s.host_tier_bytes <= 2 * GRAN && s.file_tier_bytes >= 6 * GRAN,
        "{s:?}"
    );
    e.wake::<&str>(None).unwrap();
    check_data(&e, &tensors);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

/// Chunk prints smaller than an I/O block: a change of a few bytes rewrites its whole 4 KiB block from the
/// device (the unchanged chunks around it included), never a partial block of stale ring bytes. (Raw backups:
/// a compressed file backup is written afresh when anything in it changed.)
#[test]
fn a_retained_file_backup_rewrites_whole_blocks_around_small_changed_chunks() {
    let dir = TempDir::new("small-chunks");
    let (sim, e) = raw_engine(1, 32 << 20);
    e.set_host_budget(Some(0)).unwrap();
    e.set_spill_dir(Some(&dir.0)).unwrap();
    e.set_staging_bytes(8 * 4096).unwrap();
    let policy = cumem_rs::TagPolicy {
        backup_tier: cumem_rs::backups::BackupTier::File,
        ..Default::default()
    };
    e.set_tag_policy("weights", policy).unwrap();
    e.set_fingerprint_chunk(1024).unwrap();
    let (a, mut d) = weights(&e, 2, 9);
    assert_eq!(e.sleep(&["weights"]).unwrap().written_bytes, d.len());
    e.wake::<&str>(None).unwrap();
    assert!(e.retains_backups().unwrap());
    for (at, bytes) in [(5 * 4096 + 1030, [1u8, 2, 3]), (GRAN - 3, [4, 5, 6])] {
        e.write(a + at as u64, &bytes).unwrap();
        d[at..at + 3].copy_from_slice(&bytes);
    }
    let rep = e.sleep(&["weights"]).unwrap();
    assert_eq!(rep.written_bytes, 2 * 4096, "one block per change");
    assert_eq!(rep.copied_bytes, 2 * 1024, "the changed chunks");
    assert_eq!(rep.skipped_bytes, d.len() - 2 * 1024);
    assert_eq!(e.read_backup(a, d.len()).unwrap().unwrap(), d);
    e.wake::<&str>(None).unwrap();
    assert_eq!(e.read(a, d.len()).unwrap(), d);
    e.close().unwrap();
    assert_no_leaks(&sim);
}
