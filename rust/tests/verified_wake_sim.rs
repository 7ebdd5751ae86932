//! Verified wakes on the simulated driver: at every tier (raw host, compressed host, raw file, compressed file) a
//! wake that restores bytes other than those its sleep fingerprinted fails whole (the allocations named, what it
//! mapped released, every backup kept, every allocation asleep), and a later wake succeeds once the damage is
//! gone; a retained backup found wrong is written whole by the next sleep; `verify_wake: false` turns it off.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{assert_no_leaks, engine, pattern, raw_engine, GRAN};
use cumem_rs::backups::BackupTier;
use cumem_rs::driver::{Driver, Op};
use cumem_rs::{Compress, Engine, EngineConfig, Error, SimConfig, SimDriver, TagPolicy};

const CUDA_ERROR_UNKNOWN: i32 = 999;

fn weights(e: &Engine, granules: usize, seed: u8) -> (u64, Vec<u8>) {
    e.push_tag("weights").unwrap();
    let addr = e.malloc(granules * GRAN, 0, 0).unwrap();
    e.pop_tag().unwrap();
    let data = pattern(seed, granules * GRAN);
    e.write(addr, &data).unwrap();
    (addr, data)
}

fn wake(e: &Engine) -> cumem_rs::Result<cumem_rs::Report> {
    e.wake(None::<&[&str]>)
}

/// The wake failed for a mismatch naming `addr`, with every allocation left asleep and nothing left mapped.
fn assert_failed_whole(err: &Error, e: &Engine, sim: &SimDriver, addr: u64, mapped: usize) {
    assert!(matches!(err, Error::InvalidState(_)), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("did not restore intact") && msg.contains(&format!("{addr:#x}")),
        "{msg}"
    );
    assert!(
        e.allocations()
            .unwrap()
            .iter()
            .all(|a| a.asleep && a.backed_up),
        "every allocation stays asleep with its backup"
    );
    assert_eq!(
        sim.counts().mapped_bytes,
        mapped,
        "what the wake mapped was released"
    );
}

/// A fresh directory under the system's temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("cumem-rs-verify-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    /// This process's named spill files in it.
    fn files(&self) -> Vec<PathBuf> {
        let prefix = format!("cumem_rs-{}-", std::process::id());
        let mut v: Vec<PathBuf> = (std::fs::read_dir(&self.0).unwrap())
            .map(|d| d.unwrap().path())
            .filter(|p| {
                let name = p.file_name().unwrap().to_string_lossy();
                name.starts_with(&prefix) && name.ends_with(".bak")
            })
            .collect();
        v.sort();
        v
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// "weights" go to named spill files in `dir`, raw or compressed, through a small staging ring.
fn to_named_files(e: &Engine, dir: &TempDir, compress: Compress) {
    e.set_spill_dir_named(Some(&dir.0), true).unwrap();
    e.set_staging_bytes(8 * 4096).unwrap();
    let policy = TagPolicy {
        backup_tier: BackupTier::File,
        compress,
        ..TagPolicy::default()
    };
    e.set_tag_policy("weights", policy).unwrap();
}

/// `bytes` written at `at` of `file` (what a user or a failing disk does to a backup at rest); the old bytes.
fn overwrite(file: &Path, at: u64, bytes: &[u8]) -> Vec<u8> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    let mut old = vec![0u8; bytes.len()];
    f.read_exact_at(&mut old, at).unwrap();
    f.write_all_at(bytes, at).unwrap();
    f.sync_all().unwrap();
    old
}

#[test]
fn a_raw_host_backup_restored_wrong_fails_the_wake_whole_and_a_later_wake_succeeds() {
    let (sim, e) = raw_engine(1, 16 << 20);
    let (a, da) = weights(&e, 2, 1);
    let (b, db) = weights(&e, 1, 2);
    e.sleep(&["weights"]).unwrap();
    let mapped = sim.counts().mapped_bytes;
    sim.inject_fault(Op::CorruptCopyH2D, 1, CUDA_ERROR_UNKNOWN)
        .unwrap();
    let err = wake(&e).unwrap_err();
    assert_failed_whole(&err, &e, &sim, a, mapped);
    assert!(err.to_string().contains("raw host backup"), "{err}");
    assert_eq!(
        e.stats().host_tier_bytes,
        da.len() + db.len(),
        "backups kept"
    );
    assert_eq!(e.read_backup(a, da.len()).unwrap().unwrap(), da);
    let rep = wake(&e).unwrap();
    assert_eq!(rep.verified_bytes, da.len() + db.len());
    assert_eq!(e.read(a, da.len()).unwrap(), da);
    assert_eq!(e.read(b, db.len()).unwrap(), db);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn a_compressed_host_backup_restored_wrong_fails_the_wake_through_the_same_check() {
    let (sim, e) = engine(1, 16 << 20);
    let (a, da) = weights(&e, 4, 3);
    let rep = e.sleep(&["weights"]).unwrap();
    assert_eq!(rep.raw_bytes, da.len(), "compressed");
    let mapped = sim.counts().mapped_bytes;
    sim.inject_fault(Op::CorruptDecompress, 1, CUDA_ERROR_UNKNOWN)
        .unwrap();
    let err = wake(&e).unwrap_err();
    assert_failed_whole(&err, &e, &sim, a, mapped);
    assert!(err.to_string().contains("compressed host backup"), "{err}");
    assert_eq!(e.stats().compressed_raw_bytes, da.len(), "backup kept");
    let rep = wake(&e).unwrap();
    assert_eq!(rep.verified_bytes, da.len());
    assert_eq!(e.read(a, da.len()).unwrap(), da);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn a_raw_file_backup_damaged_on_disk_fails_the_wake_and_wakes_once_repaired() {
    let dir = TempDir::new("raw-file");
    let (sim, e) = engine(1, 16 << 20);
    e.set_retain_backups(false).unwrap();
    to_named_files(&e, &dir, Compress::Off);
    let (a, da) = weights(&e, 2, 4);
    let (b, db) = weights(&e, 1, 5);
    e.sleep(&["weights"]).unwrap();
    let files = dir.files();
    assert_eq!(files.len(), 2);
    let file = (files.iter())
        .find(|f| std::fs::metadata(f).unwrap().len() == da.len() as u64)
        .unwrap();
    let old = overwrite(file, GRAN as u64, &[0xA5; 40]);
    let mapped = sim.counts().mapped_bytes;
    let err = wake(&e).unwrap_err();
    assert_failed_whole(&err, &e, &sim, a, mapped);
    assert!(err.to_string().contains("raw file backup"), "{err}");
    assert!(!err.to_string().contains(&format!("{b:#x}")), "{err}");
    assert_eq!(dir.files().len(), 2, "the files stay");
    let seen = e.read_backup(a, da.len()).unwrap().unwrap();
    assert_eq!(&seen[GRAN..GRAN + 40], &[0xA5; 40], "the backup as it lies");
    overwrite(file, GRAN as u64, &old);
    let rep = wake(&e).unwrap();
    assert_eq!(rep.verified_bytes, da.len() + db.len());
    assert_eq!(e.read(a, da.len()).unwrap(), da);
    assert_eq!(e.read(b, db.len()).unwrap(), db);
    assert!(dir.files().is_empty());
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn a_retained_file_backup_damaged_while_awake_fails_the_wake_and_is_written_whole_next_time() {
    let dir = TempDir::new("retained-file");
    let (sim, e) = engine(1, 16 << 20);
    e.set_fingerprint_chunk(GRAN).unwrap();
    to_named_files(&e, &dir, Compress::Off);
    let (a, da) = weights(&e, 4, 6);
    e.sleep(&["weights"]).unwrap();
    wake(&e).unwrap();
    assert!(
        e.retains_backups().unwrap(),
        "the sim runs the fingerprint kernel"
    );
    let files = dir.files();
    assert_eq!(files.len(), 1, "the retained file backup keeps its file");
    let old = overwrite(&files[0], 0, &[0u8; 64]);
    let rep = e.sleep(&["weights"]).unwrap();
    assert_eq!(
        (rep.written_bytes, rep.skipped_bytes),
        (0, da.len()),
        "unchanged on the device: nothing rewritten"
    );
    let mapped = sim.counts().mapped_bytes;
    let err = wake(&e).unwrap_err();
    assert_failed_whole(&err, &e, &sim, a, mapped);
    assert!(err.to_string().contains("chunk at +0x0"), "{err}");
    overwrite(&files[0], 0, &old);
    wake(&e).unwrap();
    assert_eq!(e.read(a, da.len()).unwrap(), da);
    assert_eq!(
        e.stats().retained_allocations,
        0,
        "a backup found wrong is not retained"
    );
    assert!(dir.files().is_empty(), "its file went with it");
    let rep = e.sleep(&["weights"]).unwrap();
    assert_eq!(
        (rep.written_bytes, rep.skipped_bytes),
        (da.len(), 0),
        "written whole"
    );
    let rep = wake(&e).unwrap();
    assert_eq!(rep.verified_bytes, da.len());
    assert_eq!(e.read(a, da.len()).unwrap(), da);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn a_compressed_file_backup_restored_wrong_fails_the_wake_through_the_same_check() {
    let dir = TempDir::new("packed-file");
    let (sim, e) = engine(1, 16 << 20);
    to_named_files(&e, &dir, Compress::Auto);
    // Compressed in the file tier: a chunk fits a slot of the ring (8 slots of 4 chunks).
    e.set_fingerprint_chunk(GRAN).unwrap();
    e.set_staging_bytes(8 * 4 * GRAN).unwrap();
    let (a, da) = weights(&e, 4, 7);
    let rep = e.sleep(&["weights"]).unwrap();
    assert!(
        rep.raw_bytes == da.len() && rep.written_bytes < da.len(),
        "{rep:?}"
    );
    let mapped = sim.counts().mapped_bytes;
    sim.inject_fault(Op::CorruptDecompress, 1, CUDA_ERROR_UNKNOWN)
        .unwrap();
    let err = wake(&e).unwrap_err();
    assert_failed_whole(&err, &e, &sim, a, mapped);
    assert!(err.to_string().contains("compressed file backup"), "{err}");
    assert_eq!(dir.files().len(), 1, "the file stays");
    let rep = wake(&e).unwrap();
    assert_eq!(rep.verified_bytes, da.len());
    assert_eq!(e.read(a, da.len()).unwrap(), da);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn with_verification_off_damage_goes_unseen_and_nothing_is_verified() {
    let dir = TempDir::new("off");
    let sim = Arc::new(
        SimDriver::new(SimConfig {
            granularity: GRAN,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let config = EngineConfig {
        verify_wake: false,
        ..EngineConfig::default()
    };
    let e = Engine::with_config(sim.clone() as Arc<dyn Driver>, config).unwrap();
    e.set_retain_backups(false).unwrap();
    to_named_files(&e, &dir, Compress::Off);
    let (a, da) = weights(&e, 2, 8);
    e.sleep(&["weights"]).unwrap();
    let before = common::calls(&sim, "fingerprint");
    overwrite(&dir.files()[0], GRAN as u64, &[0xA5; 40]);
    let rep = wake(&e).unwrap();
    assert_eq!((rep.verified_bytes, rep.copied_bytes), (0, da.len()));
    assert_eq!(
        common::calls(&sim, "fingerprint"),
        before,
        "no fingerprint pass at wake"
    );
    let now = e.read(a, da.len()).unwrap();
    assert_eq!(
        &now[GRAN..GRAN + 40],
        &[0xA5; 40],
        "the damage was restored"
    );
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn one_wake_names_every_allocation_found_wrong_and_checks_each_device() {
    let (sim, e) = raw_engine(2, 16 << 20);
    e.push_tag("weights").unwrap();
    let on0 = e.malloc(GRAN, 0, 0).unwrap();
    let on1 = e.malloc(GRAN, 1, 0).unwrap();
    e.pop_tag().unwrap();
    e.write(on0, &pattern(1, GRAN)).unwrap();
    e.write(on1, &pattern(2, GRAN)).unwrap();
    e.sleep(&["weights"]).unwrap();
    // Both restore copies come back wrong.
    sim.inject_fault(Op::CorruptCopyH2D, 1, CUDA_ERROR_UNKNOWN)
        .unwrap();
    sim.inject_fault(Op::CorruptCopyH2D, 2, CUDA_ERROR_UNKNOWN)
        .unwrap();
    let err = wake(&e).unwrap_err().to_string();
    assert!(
        err.contains("allocations")
            && err.contains(&format!("{on0:#x}"))
            && err.contains(&format!("{on1:#x}")),
        "{err}"
    );
    assert_eq!(sim.counts().fingerprint_batches, 0, "every batch taken");
    let rep = wake(&e).unwrap();
    assert_eq!(rep.verified_bytes, 2 * GRAN);
    assert_eq!(e.read(on1, GRAN).unwrap(), pattern(2, GRAN));
    e.close().unwrap();
    assert_no_leaks(&sim);
}
