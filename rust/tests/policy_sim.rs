//! Tag policies, pause/resume of single tags, status and backup reads, on the simulated driver.

use std::sync::Arc;

use cumem_rs::driver::sim::POISON;
use cumem_rs::driver::{Driver, Op};
use cumem_rs::{Engine, Error, SimConfig, SimDriver, TagPolicy, WakeFill};

const G: usize = 64 << 10;

/// A fresh engine over `devices` simulated devices of 16 MiB, with its driver for counts and faults.
fn sim_engine(devices: usize) -> (Arc<SimDriver>, Engine) {
    let config = SimConfig {
        devices,
        capacity: 16 << 20,
        granularity: G,
        ..SimConfig::default()
    };
    let sim = Arc::new(SimDriver::new(config).unwrap());
    let engine = Engine::new(sim.clone() as Arc<dyn Driver>).unwrap();
    (sim, engine)
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8 ^ seed).wrapping_add(seed))
        .collect()
}

/// Allocate `size` bytes on `device` under `tag` and fill them with `bytes(seed, size)`.
fn filled(e: &Engine, tag: &str, size: usize, device: i32, seed: u8) -> u64 {
    e.push_tag(tag).unwrap();
    let addr = e.malloc(size, device, 0);
    e.pop_tag().unwrap();
    let addr = addr.unwrap();
    e.write(addr, &bytes(seed, size)).unwrap();
    addr
}

fn calls(sim: &SimDriver, op: Op) -> u64 {
    sim.counts()
        .calls
        .iter()
        .find(|(name, _)| *name == op.name())
        .map_or(0, |(_, n)| *n)
}

fn finish(sim: &SimDriver, e: Engine) {
    e.close().unwrap();
    let c = sim.counts();
    assert_eq!((c.ranges, c.handles, c.mapped_bytes), (0, 0, 0), "{c:?}");
    assert_eq!(
        (c.host_registered, c.host_allocated, c.markers),
        (0, 0, 0),
        "{c:?}"
    );
}

const ZERO: TagPolicy = TagPolicy {
    backup: None,
    wake_fill: WakeFill::Zero,
    backup_tier: cumem_rs::backups::BackupTier::Auto,
    compress: cumem_rs::Compress::Auto,
};

#[test]
fn zero_wake_fill_zeroes_memory_woken_without_backup_and_only_that() {
    let (sim, e) = sim_engine(1);
    e.set_tag_policy("kv_cache", ZERO).unwrap();
    let kv = filled(&e, "kv_cache", 2 * G, 0, 1);
    let scratch = filled(&e, "scratch", G, 0, 2);
    let w = filled(&e, "weights", G, 0, 3);
    e.set_tag_policy("weights", ZERO).unwrap(); // backed up: the fill does not apply

    e.sleep(&["weights"]).unwrap();
    let r = e.wake(None::<&[&str]>).unwrap();
    assert_eq!(
        (r.discarded_bytes, r.zeroed_bytes, r.copied_bytes),
        (3 * G, 2 * G, G)
    );
    assert!(
        e.read(kv, 2 * G).unwrap().iter().all(|b| *b == 0),
        "kv_cache not zeroed"
    );
    assert!(
        e.read(scratch, G).unwrap().iter().all(|b| *b == POISON),
        "no policy: poison"
    );
    assert_eq!(
        e.read(w, G).unwrap(),
        bytes(3, G),
        "a backup wins over the fill"
    );
    assert_eq!(
        calls(&sim, Op::MemsetZero),
        1,
        "one fill per zeroed allocation"
    );

    // Clearing the policy (the default policy) brings the poison back.
    e.set_tag_policy("kv_cache", TagPolicy::default()).unwrap();
    e.discard(&["kv_cache"]).unwrap();
    e.wake(None::<&[&str]>).unwrap();
    assert!(e.read(kv, 2 * G).unwrap().iter().all(|b| *b == POISON));
    finish(&sim, e);
}

#[test]
fn pause_releases_only_the_named_tag_and_resume_restores_it() {
    let (sim, e) = sim_engine(1);
    let w = filled(&e, "weights", 3 * G, 0, 4);
    let kv = filled(&e, "kv_cache", 2 * G, 0, 5);
    let mapped = e.usage(None).unwrap();

    let r = e.pause(Some(&["weights"])).unwrap();
    assert_eq!(
        (r.allocations, r.copied_bytes, r.discarded_bytes),
        (1, 3 * G, 0),
        "unset policy: backed up"
    );
    assert_eq!(e.usage(None).unwrap(), mapped - 3 * G);
    assert_eq!(
        e.read(kv, 2 * G).unwrap(),
        bytes(5, 2 * G),
        "the other tag keeps running"
    );
    e.write(kv, &bytes(6, 2 * G)).unwrap();

    let again = e.pause(Some(&["weights"])).unwrap();
    assert_eq!(again.allocations, 0, "pausing a paused tag is a no-op");
    let r = e.resume(Some(&["weights"])).unwrap();
    assert_eq!((r.allocations, r.copied_bytes), (1, 3 * G));
    assert_eq!(e.read(w, 3 * G).unwrap(), bytes(4, 3 * G));
    assert_eq!(
        e.resume(Some(&["weights"])).unwrap().allocations,
        0,
        "resuming an awake tag is a no-op"
    );
    assert_eq!(e.read(kv, 2 * G).unwrap(), bytes(6, 2 * G));
    finish(&sim, e);
}

#[test]
fn pause_follows_the_backup_policy_and_none_means_every_tag() {
    let (sim, e) = sim_engine(1);
    e.set_tag_policy(
        "kv_cache",
        TagPolicy {
            backup: Some(false),
            wake_fill: WakeFill::Zero,
            backup_tier: cumem_rs::backups::BackupTier::Auto,
            compress: cumem_rs::Compress::Auto,
        },
    )
    .unwrap();
    let w = filled(&e, "weights", G, 0, 7);
    let kv = filled(&e, "kv_cache", G, 0, 8);
    let r = e.pause(None::<&[&str]>).unwrap();
    assert_eq!(
        (r.allocations, r.copied_bytes, r.discarded_bytes),
        (2, G, G)
    );
    assert_eq!(e.usage(None).unwrap(), 0);
    let info = e.allocations().unwrap();
    let backed = |addr| info.iter().find(|a| a.addr == addr).unwrap().backed_up;
    assert!(backed(w) && !backed(kv));
    e.resume(None::<&[&str]>).unwrap();
    assert_eq!(e.read(w, G).unwrap(), bytes(7, G));
    assert!(e.read(kv, G).unwrap().iter().all(|b| *b == 0));
    finish(&sim, e);
}

#[test]
fn pause_synchronizes_only_the_devices_it_releases_on() {
    let (sim, e) = sim_engine(3);
    filled(&e, "a", G, 1, 9);
    filled(&e, "b", G, 0, 10);
    filled(&e, "b", G, 2, 11);
    let before = calls(&sim, Op::Synchronize);
    e.pause(Some(&["a"])).unwrap();
    assert_eq!(
        calls(&sim, Op::Synchronize) - before,
        1,
        "only device 1 holds tag a"
    );
    let before = calls(&sim, Op::Synchronize);
    e.pause(Some(&["a"])).unwrap();
    assert_eq!(
        calls(&sim, Op::Synchronize),
        before,
        "a no-op pause synchronizes nothing"
    );
    finish(&sim, e);
}

#[test]
fn pause_and_resume_mix_with_sleep_and_wake() {
    let (sim, e) = sim_engine(2);
    let w = filled(&e, "weights", 2 * G, 0, 12);
    let kv = filled(&e, "kv_cache", G, 1, 13);
    let d = filled(&e, "default", G, 1, 14);
    e.pause(Some(&["weights"])).unwrap();
    // The sleep finds weights asleep (kept with its backup) and offloads only what is awake and asked for.
    let r = e.sleep(&["kv_cache"]).unwrap();
    assert_eq!(
        (r.allocations, r.copied_bytes, r.discarded_bytes),
        (2, G, G)
    );
    let r = e.resume(Some(&["weights", "kv_cache"])).unwrap();
    assert_eq!((r.allocations, r.copied_bytes), (2, 3 * G));
    assert_eq!(e.read(w, 2 * G).unwrap(), bytes(12, 2 * G));
    assert_eq!(e.read(kv, G).unwrap(), bytes(13, G));
    let r = e.wake(None::<&[&str]>).unwrap();
    assert_eq!((r.allocations, r.discarded_bytes), (1, G));
    assert!(e.read(d, G).unwrap().iter().all(|b| *b == POISON));
    finish(&sim, e);
}

#[test]
fn sleep_without_tags_backs_up_per_policy_else_default_only() {
    let (sim, e) = sim_engine(1);
    filled(&e, "default", G, 0, 15);
    filled(&e, "weights", 2 * G, 0, 16);
    filled(&e, "kv_cache", 4 * G, 0, 17);
    // No policies: vLLM's sleep() rule, only "default" is backed up.
    let r = e.sleep_by_policy().unwrap();
    assert_eq!((r.copied_bytes, r.discarded_bytes), (G, 6 * G));
    e.wake(None::<&[&str]>).unwrap();
    e.set_tag_policy(
        "weights",
        TagPolicy {
            backup: Some(true),
            ..TagPolicy::default()
        },
    )
    .unwrap();
    e.set_tag_policy(
        "default",
        TagPolicy {
            backup: Some(false),
            ..TagPolicy::default()
        },
    )
    .unwrap();
    let r = e.sleep_by_policy().unwrap();
    assert_eq!((r.copied_bytes, r.discarded_bytes), (2 * G, 5 * G));
    e.wake(None::<&[&str]>).unwrap();
    // An explicit offload list decides for every tag, policies or not.
    let r = e.sleep(&["kv_cache"]).unwrap();
    assert_eq!((r.copied_bytes, r.discarded_bytes), (4 * G, 3 * G));
    e.wake(None::<&[&str]>).unwrap();
    finish(&sim, e);
}

#[test]
fn status_reports_each_tag_its_bytes_policy_and_state() {
    let (sim, e) = sim_engine(1);
    e.set_tag_policy("idle", ZERO).unwrap();
    filled(&e, "weights", 2 * G, 0, 18);
    let w2 = filled(&e, "weights", G, 0, 19);
    filled(&e, "kv_cache", G, 0, 20);
    let s = e.status().unwrap();
    assert!(!s.is_sleeping);
    assert_eq!(
        s.tags.keys().collect::<Vec<_>>(),
        ["idle", "kv_cache", "weights"]
    );
    let idle = &s.tags["idle"];
    assert_eq!(
        (idle.allocations, idle.state(), idle.policy),
        (0, "awake", ZERO)
    );
    assert_eq!(
        (s.tags["weights"].mapped_bytes, s.tags["weights"].state()),
        (3 * G, "awake")
    );

    e.pause(Some(&["kv_cache"])).unwrap();
    e.free(w2).unwrap();
    e.sleep(&["weights"]).unwrap();
    e.push_tag("weights").unwrap();
    e.malloc(G, 0, 0).unwrap(); // allocated while the rest of the tag sleeps
    e.pop_tag().unwrap();
    let s = e.status().unwrap();
    assert!(s.is_sleeping);
    let w = &s.tags["weights"];
    assert_eq!(
        (
            w.allocations,
            w.mapped_bytes,
            w.asleep_bytes,
            w.backup_bytes,
            w.state()
        ),
        (2, G, 2 * G, 2 * G, "mixed")
    );
    let kv = &s.tags["kv_cache"];
    assert_eq!(
        (kv.asleep_bytes, kv.backup_bytes, kv.state()),
        (G, G, "asleep")
    );
    finish(&sim, e);
}

#[test]
fn read_backup_shows_the_paused_contents_and_refuses_what_has_none() {
    let (sim, e) = sim_engine(1);
    e.set_tag_policy(
        "kv_cache",
        TagPolicy {
            backup: Some(false),
            ..TagPolicy::default()
        },
    )
    .unwrap();
    let w = filled(&e, "weights", 2 * G, 0, 21);
    let kv = filled(&e, "kv_cache", G, 0, 22);
    assert_eq!(
        e.read_backup(w + 10, 100).unwrap(),
        None,
        "awake: no backup to read"
    );
    e.pause(None::<&[&str]>).unwrap();
    assert_eq!(
        e.read_backup(w + 10, 100).unwrap().unwrap(),
        bytes(21, 2 * G)[10..110]
    );
    assert!(matches!(e.read_backup(kv, 1), Err(Error::InvalidState(_))));
    assert!(matches!(
        e.read_backup(w + G as u64, 2 * G),
        Err(Error::InvalidArgument(_))
    ));
    finish(&sim, e);
}

#[test]
fn a_failed_zero_fill_leaves_the_wake_undone() {
    let (sim, e) = sim_engine(1);
    e.set_tag_policy("kv_cache", ZERO).unwrap();
    let w = filled(&e, "weights", G, 0, 23);
    let kv = filled(&e, "kv_cache", G, 0, 24);
    e.sleep(&["weights"]).unwrap();
    sim.inject_fault(Op::MemsetZero, 1, 999).unwrap();
    let err = e.wake(None::<&[&str]>).unwrap_err();
    assert!(err.to_string().contains("memset_zero"), "{err}");
    assert_eq!(e.usage(None).unwrap(), 0, "nothing stays mapped");
    assert_eq!(sim.counts().mapped_bytes, 0);
    assert!(e.allocations().unwrap().iter().all(|a| a.asleep));
    e.wake(None::<&[&str]>).unwrap();
    assert_eq!(e.read(w, G).unwrap(), bytes(23, G));
    assert!(e.read(kv, G).unwrap().iter().all(|b| *b == 0));
    finish(&sim, e);
}

#[test]
fn bad_policy_input_is_refused() {
    let (sim, e) = sim_engine(1);
    assert!(matches!(
        e.set_tag_policy("", ZERO),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        WakeFill::parse("zeros"),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(WakeFill::parse("zero").unwrap(), WakeFill::Zero);
    e.close().unwrap();
    assert!(matches!(e.pause(None::<&[&str]>), Err(Error::Closed)));
    assert!(matches!(e.set_tag_policy("t", ZERO), Err(Error::Closed)));
    finish(&sim, e);
}
