//! Engine behaviour on the simulated driver: round trips, rollback, leaks, threads.

mod common;

use std::sync::Arc;

use common::{assert_no_leaks, engine, pattern, raw_engine, GRAN};
use cumem_rs::driver::sim::POISON;
use cumem_rs::driver::Op;
use cumem_rs::{Engine, Error, TagPolicy, WakeFill};

#[test]
fn malloc_rounds_to_granularity_and_tracks_usage() {
    let (sim, e) = engine(2, 16 << 20);
    let a = e.malloc(1, 0, 0).unwrap();
    let b = e.malloc(GRAN + 1, 1, 0).unwrap();
    assert_eq!(
        (a % GRAN as u64, b % GRAN as u64),
        (0, 0),
        "ranges are granularity-aligned, as on CUDA"
    );
    assert_eq!(e.usage(Some(0)).unwrap(), GRAN);
    assert_eq!(e.usage(Some(1)).unwrap(), 2 * GRAN);
    assert_eq!(sim.counts().used_bytes, vec![GRAN, 2 * GRAN]);
    let infos = e.allocations().unwrap();
    assert_eq!(infos.iter().map(|i| i.requested).sum::<usize>(), GRAN + 2);
    e.free(a).unwrap();
    e.free(b).unwrap();
    assert_eq!(e.usage(None).unwrap(), 0);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn sleep_wake_keeps_addresses_and_offloaded_bytes_and_poisons_the_rest() {
    let (sim, e) = engine(1, 16 << 20);
    e.push_tag("weights").unwrap();
    let w = e.malloc(3 * GRAN, 0, 0).unwrap();
    e.pop_tag().unwrap();
    e.push_tag("kv_cache").unwrap();
    let kv = e.malloc(GRAN, 0, 0).unwrap();
    e.pop_tag().unwrap();
    let data = pattern(7, 3 * GRAN);
    e.write(w, &data).unwrap();
    e.write(kv, &pattern(9, GRAN)).unwrap();

    let r = e.sleep(&["weights"]).unwrap();
    assert_eq!(
        (r.copied_bytes, r.discarded_bytes, r.allocations),
        (3 * GRAN, GRAN, 2)
    );
    assert_eq!(e.usage(None).unwrap(), 0);
    assert_eq!(sim.counts().handles, 0, "all physical memory released");
    assert!(matches!(e.read(w, 1), Err(Error::InvalidState(_))));

    let r = e.wake(None::<&[&str]>).unwrap();
    assert_eq!((r.copied_bytes, r.discarded_bytes), (3 * GRAN, GRAN));
    assert_eq!(e.read(w, 3 * GRAN).unwrap(), data);
    assert!(e.read(kv, GRAN).unwrap().iter().all(|b| *b == POISON));
    let addrs: Vec<u64> = e.allocations().unwrap().iter().map(|a| a.addr).collect();
    assert!(addrs.contains(&w) && addrs.contains(&kv));
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn cold_sleep_pins_in_cells_that_split_allocations() {
    let (sim, e) = raw_engine(2, 16 << 20);
    e.set_pin_chunk(3 * 4096 * 5).unwrap(); // not a divisor of the granularity: cells end inside allocations
    e.push_tag("weights").unwrap();
    let sizes = [GRAN, 3 * GRAN, 2 * GRAN, GRAN];
    let addrs: Vec<u64> = sizes
        .iter()
        .enumerate()
        .map(|(i, s)| e.malloc(*s, (i % 2) as i32, 0).unwrap())
        .collect();
    e.pop_tag().unwrap();
    for (i, (a, s)) in addrs.iter().zip(sizes).enumerate() {
        e.write(*a, &pattern(i as u8, s)).unwrap();
    }
    e.sleep(&["weights"]).unwrap();
    let total: usize = sizes.iter().sum();
    assert_eq!(
        sim.counts().host_registered,
        total.div_ceil(3 * 4096 * 5),
        "one registration per cell"
    );
    e.wake(None::<&[&str]>).unwrap();
    for (i, (a, s)) in addrs.iter().zip(sizes).enumerate() {
        assert_eq!(
            e.read(*a, s).unwrap(),
            pattern(i as u8, s),
            "allocation {i}"
        );
    }
    // The steady sleep reuses the pinned arena: no new registration.
    e.sleep(&["weights"]).unwrap();
    e.wake(None::<&[&str]>).unwrap();
    assert_eq!(
        sim.counts()
            .calls
            .iter()
            .find(|c| c.0 == "host_register")
            .unwrap()
            .1 as usize,
        total.div_ceil(3 * 4096 * 5)
    );
    for (i, (a, s)) in addrs.iter().zip(sizes).enumerate() {
        assert_eq!(
            e.read(*a, s).unwrap(),
            pattern(i as u8, s),
            "allocation {i} after the second cycle"
        );
    }
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn selective_wake_and_discard() {
    let (sim, e) = engine(1, 16 << 20);
    e.push_tag("weights").unwrap();
    let w = e.malloc(GRAN, 0, 0).unwrap();
    e.pop_tag().unwrap();
    e.push_tag("kv_cache").unwrap();
    let kv = e.malloc(GRAN, 0, 0).unwrap();
    e.pop_tag().unwrap();
    e.write(w, &pattern(1, GRAN)).unwrap();
    let d = e.discard(&["kv_cache"]).unwrap();
    assert_eq!(d.discarded_bytes, GRAN);
    assert_eq!(e.usage(None).unwrap(), GRAN, "weights untouched by discard");
    e.sleep(&["weights"]).unwrap();
    e.wake(Some(&["weights"])).unwrap();
    assert_eq!(e.usage(None).unwrap(), GRAN, "kv_cache still asleep");
    assert_eq!(e.read(w, GRAN).unwrap(), pattern(1, GRAN));
    e.wake(Some(&["kv_cache"])).unwrap();
    assert_eq!(e.usage(None).unwrap(), 2 * GRAN);
    e.free(kv).unwrap();
    e.free(w).unwrap();
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn free_while_asleep_releases_range_and_backup() {
    let (sim, e) = raw_engine(1, 16 << 20);
    let a = e.malloc(GRAN, 0, 0).unwrap();
    e.set_keep_host_memory(false).unwrap();
    e.sleep(&["default"]).unwrap();
    assert_eq!(e.host_bytes(), GRAN);
    e.free(a).unwrap();
    assert_eq!(e.host_bytes(), 0);
    assert_eq!(sim.counts().ranges, 0);
    assert!(
        matches!(e.free(a), Err(Error::UnknownAddress(_))),
        "double free is refused, not repeated"
    );
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn out_of_memory_at_malloc_leaves_nothing_behind() {
    let (sim, e) = engine(1, 4 * GRAN);
    let a = e.malloc(3 * GRAN, 0, 0).unwrap();
    let err = e.malloc(2 * GRAN, 0, 0).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!(sim.counts().ranges, 1);
    e.free(a).unwrap();
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn failed_wake_keeps_backups_and_a_later_wake_succeeds() {
    let (sim, e) = engine(1, 4 * GRAN);
    e.push_tag("weights").unwrap();
    let w1 = e.malloc(GRAN, 0, 0).unwrap();
    let w2 = e.malloc(GRAN, 0, 0).unwrap();
    e.pop_tag().unwrap();
    e.write(w1, &pattern(3, GRAN)).unwrap();
    e.write(w2, &pattern(4, GRAN)).unwrap();
    e.sleep(&["weights"]).unwrap();
    // Someone else takes the memory while we sleep.
    let hog = e.malloc(3 * GRAN, 0, 0).unwrap();
    let err = e.wake(None::<&[&str]>).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert!(e
        .allocations()
        .unwrap()
        .iter()
        .filter(|a| a.addr != hog)
        .all(|a| a.asleep && a.backed_up));
    assert_eq!(
        sim.counts().handles,
        1,
        "what the failed wake mapped was released again"
    );
    e.free(hog).unwrap();
    e.wake(None::<&[&str]>).unwrap();
    assert_eq!(e.read(w1, GRAN).unwrap(), pattern(3, GRAN));
    assert_eq!(e.read(w2, GRAN).unwrap(), pattern(4, GRAN));
    e.close().unwrap();
    assert_no_leaks(&sim);
}

/// One scenario touching every driver operation the engine uses.
fn scenario(e: &Engine) -> Result<(), Error> {
    let zero = TagPolicy {
        backup: None,
        wake_fill: WakeFill::Zero,
        backup_tier: cumem_rs::backups::BackupTier::Auto,
        compress: cumem_rs::Compress::Auto,
    };
    e.set_tag_policy("default", zero)?;
    e.push_tag("weights").unwrap();
    let w = e.malloc(2 * GRAN, 0, 0);
    e.pop_tag().unwrap();
    let w = w?;
    let kv = e.malloc(GRAN, 1, 0)?;
    e.write(w, &pattern(5, 2 * GRAN))?;
    e.sleep(&["weights"])?;
    e.wake(None::<&[&str]>)?;
    if e.read(w, 2 * GRAN)? != pattern(5, 2 * GRAN) {
        panic!("offloaded data changed");
    }
    e.discard(&["default"])?;
    e.wake(None::<&[&str]>)?; // "default" wakes zero-filled: memset_zero
    e.pause(Some(&["weights"]))?;
    e.resume(Some(&["weights"]))?;
    if e.read(w, 2 * GRAN)? != pattern(5, 2 * GRAN) {
        panic!("paused data changed");
    }
    e.free(kv)?;
    e.free(w)?;
    e.trim_host()?;
    Ok(())
}

#[test]
fn a_fault_at_every_driver_call_is_reported_and_nothing_leaks() {
    let (sim, e) = engine(2, 16 << 20);
    scenario(&e).unwrap();
    let calls = sim.counts().calls;
    drop(e);
    let mut pairs = 0;
    for (name, n) in calls {
        let op = Op::parse(name).unwrap();
        if op == Op::CorruptCopyH2D {
            continue; // it damages what a write puts on the device too: the caller's bytes, no call can tell
        }
        for nth in 1..=n {
            let (sim, e) = engine(2, 16 << 20);
            sim.inject_fault(op, nth, 999).unwrap();
            let result = scenario(&e);
            let recorded = e.errors();
            assert!(
                result.is_err() || !recorded.is_empty(),
                "fault {name}#{nth} vanished"
            );
            // Registry and driver agree after the failure.
            assert_eq!(
                e.usage(None).unwrap(),
                sim.counts().mapped_bytes,
                "fault {name}#{nth}"
            );
            sim.clear_faults();
            // Everything still works: wake what is asleep, and all of it can be freed.
            e.wake(None::<&[&str]>).unwrap();
            e.close().unwrap();
            assert_no_leaks(&sim);
            pairs += 1;
        }
    }
    assert!(pairs > 40, "only {pairs} (op, position) pairs exercised");
}

#[test]
fn threads_allocate_while_another_sleeps_and_wakes() {
    let (sim, e) = engine(1, 256 << 20);
    let e = Arc::new(e);
    std::thread::scope(|s| {
        for t in 0..8u8 {
            let e = e.clone();
            s.spawn(move || {
                e.push_tag(if t % 2 == 0 { "weights" } else { "kv_cache" })
                    .unwrap();
                let mut mine = Vec::new();
                for i in 0..400usize {
                    if i % 3 == 2 {
                        if let Some(a) = mine.pop() {
                            e.free(a).unwrap();
                        }
                    } else {
                        mine.push(e.malloc(GRAN * (1 + i % 3), 0, 0).unwrap());
                    }
                }
                for a in mine {
                    e.free(a).unwrap();
                }
                e.pop_tag().unwrap();
            });
        }
        let e = e.clone();
        s.spawn(move || {
            for _ in 0..50 {
                e.sleep(&["weights"]).unwrap();
                e.wake(None::<&[&str]>).unwrap();
            }
        });
    });
    assert_eq!(e.allocations().unwrap().len(), 0);
    assert_eq!(e.usage(None).unwrap(), 0);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn reserve_host_falls_back_to_driver_pinned_memory_and_reports_both_failures() {
    let (sim, e) = engine(1, 16 << 20);
    // Registering fails: the driver's own pinned allocation serves, and the failure is recorded, not lost.
    sim.inject_fault(Op::HostRegister, 1, 999).unwrap();
    e.reserve_host(4 * GRAN, false).unwrap();
    assert_eq!(sim.counts().host_allocated, 1);
    assert!(
        e.errors().iter().any(|m| m.contains("host_register")),
        "{:?}",
        e.errors()
    );
    let a = e.malloc(GRAN, 0, 0).unwrap();
    e.write(a, &pattern(2, GRAN)).unwrap();
    e.sleep(&["default"]).unwrap(); // backs up into the fallback buffer
    e.wake(None::<&[&str]>).unwrap();
    assert_eq!(e.read(a, GRAN).unwrap(), pattern(2, GRAN));
    e.trim_host().unwrap();
    // Both fail: a clear out-of-memory error naming both, nothing left behind.
    sim.inject_fault(Op::HostRegister, 1, 999).unwrap();
    sim.inject_fault(Op::HostAlloc, 1, 2).unwrap();
    let err = e.reserve_host(4 * GRAN, false).unwrap_err();
    assert!(
        err.is_out_of_memory() && err.to_string().contains("host_register"),
        "{err}"
    );
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn close_reports_releases_the_driver_still_refuses_and_can_be_retried() {
    let (sim, e) = engine(1, 16 << 20);
    let a = e.malloc(GRAN, 0, 0).unwrap();
    sim.inject_fault(Op::FreeRange, 1, 999).unwrap(); // at free: queued and recorded
    sim.inject_fault(Op::FreeRange, 2, 999).unwrap(); // at close's retry: still refused
    e.free(a).unwrap();
    assert_eq!(e.stats().pending_releases, 1);
    let err = e.close().unwrap_err();
    assert!(err.to_string().contains("still refused"), "{err}");
    assert!(!e.is_closed(), "not closed while something is still held");
    e.close().unwrap();
    assert!(e.is_closed());
    assert_no_leaks(&sim);
}

/// A steady sleep of more allocations than the copy streams keep queued releases cells while it issues the
/// next ones; whatever copy fails, every allocation ends awake with its data or asleep with a full backup.
#[test]
fn steady_sleep_of_many_allocations_releases_while_issuing_and_survives_a_failed_copy() {
    const N: usize = 700; // more copies than the issue window (512 queued operations)
    for fail_at in [None, Some(1), Some(400)] {
        let (sim, e) = raw_engine(1, (2 * N + 8) * GRAN);
        e.set_retain_backups(false).unwrap(); // every sleep copies: the path under test
        e.set_pin_chunk(10 * GRAN).unwrap(); // 70 cells of 10 copies: the window drains cells while issuing
                                             // A spacer of another tag after each allocation: neighbours would be copied out together (one copy per
                                             // cell), and the window under test needs one copy per allocation.
        let mut addrs = Vec::new();
        for _ in 0..N {
            e.push_tag("weights").unwrap();
            addrs.push(e.malloc(GRAN, 0, 0).unwrap());
            e.pop_tag().unwrap();
            e.malloc(GRAN, 0, 0).unwrap();
        }
        for (i, a) in addrs.iter().enumerate() {
            e.write(*a, &pattern(i as u8, GRAN)).unwrap();
        }
        e.sleep(&["weights"]).unwrap(); // cold: pins the arena
        e.wake(None::<&[&str]>).unwrap();
        if let Some(nth) = fail_at {
            sim.inject_fault(Op::CopyD2H, nth, 999).unwrap();
            assert!(
                e.sleep(&["weights"]).is_err(),
                "the injected copy fault is reported"
            );
            sim.clear_faults();
            for a in e
                .allocations()
                .unwrap()
                .iter()
                .filter(|a| a.tag == "weights")
            {
                assert!(
                    !a.asleep || a.backed_up,
                    "{:#x} asleep without a backup",
                    a.addr
                );
            }
        } else {
            let r = e.sleep(&["weights"]).unwrap();
            assert_eq!(r.copied_bytes, N * GRAN);
        }
        assert_eq!(sim.counts().markers, 0, "every marker waited for");
        e.wake(None::<&[&str]>).unwrap();
        for (i, a) in addrs.iter().enumerate() {
            assert_eq!(
                e.read(*a, GRAN).unwrap(),
                pattern(i as u8, GRAN),
                "allocation {i} after {fail_at:?}"
            );
        }
        e.close().unwrap();
        assert_no_leaks(&sim);
    }
}
