//! What an adversarial review found, each with the test that would have caught it: worker threads the OS
//! refuses, panics under the engine lock, host memory growing over partial wakes, frees that fail half way,
//! size setters that wrap, fault arguments that wrap, and tag stacks that pile up.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use common::{assert_no_leaks, calls, engine, pattern, GRAN};
use cumem_rs::driver::Op;
use cumem_rs::tags::tag_stacks_on_this_thread;
use cumem_rs::{Engine, Error, SimDriver};

const NONE: Option<&[&str]> = None;

/// Bytes of the backups still referenced: of allocations asleep with a backup, and retained by awake ones.
fn backups_referenced(e: &Engine) -> usize {
    let asleep: usize = e
        .allocations()
        .unwrap()
        .iter()
        .filter(|a| a.asleep && a.backed_up)
        .map(|a| a.size)
        .sum();
    asleep + e.stats().host_retained_bytes
}

/// A cold sleep of one allocation large enough that its pages are touched by several threads (on a machine
/// with several cores), a wake, then `reserve_host`, which pins a buffer whole: every place that starts a
/// worker thread. Returns the allocation's address.
fn every_spawn_site(sim: &SimDriver, e: &Engine) -> u64 {
    const BIG: usize = 80 << 20; // above the 64 MiB where touching goes parallel
    e.push_tag("weights").unwrap();
    let a = e.malloc(BIG, 0, 0).unwrap();
    e.pop_tag().unwrap();
    // Marks at both ends (patterns of the whole size are slow to build in a debug build).
    let tail = a + (BIG - GRAN) as u64;
    e.write(a, &pattern(3, GRAN)).unwrap();
    e.write(tail, &pattern(4, GRAN)).unwrap();
    let before = calls(sim, "host_register");
    e.sleep(&["weights"]).unwrap();
    assert!(calls(sim, "host_register") > before, "the sleep was cold");
    e.wake(NONE).unwrap();
    assert_eq!(e.read(a, GRAN).unwrap(), pattern(3, GRAN));
    assert_eq!(e.read(tail, GRAN).unwrap(), pattern(4, GRAN));
    e.trim_host().unwrap();
    e.reserve_host(BIG, false).unwrap();
    a
}

#[test]
fn a_refused_thread_at_every_spawn_site_leaves_the_work_to_the_calling_thread() {
    let (sim, e) = engine(1, 256 << 20);
    every_spawn_site(&sim, &e);
    let sites = calls(&sim, "thread_spawn");
    e.close().unwrap();
    assert!(sites >= 1, "the scenario starts no worker thread");
    for nth in 1..=sites {
        let (sim, e) = engine(1, 256 << 20);
        sim.inject_fault(Op::ThreadSpawn, nth, 999).unwrap();
        let a = every_spawn_site(&sim, &e); // no panic, no error: the work ran on the calling thread
        assert!(
            e.errors().iter().any(|m| m.contains("thread_spawn")),
            "spawn #{nth}: the refusal was not recorded: {:?}",
            e.errors()
        );
        e.free(a).unwrap();
        e.close().unwrap();
        assert_no_leaks(&sim);
    }
}

#[test]
fn a_panic_under_the_lock_poisons_the_engine_and_every_later_call_says_so() {
    let (sim, e) = engine(1, 16 << 20);
    let kept = e.malloc(GRAN, 0, 0).unwrap();
    sim.inject_panic(Op::Map, 1).unwrap();
    let caught = catch_unwind(AssertUnwindSafe(|| e.malloc(GRAN, 0, 0)));
    assert!(caught.is_err(), "the injected panic did not happen");
    for r in [
        e.malloc(GRAN, 0, 0).map(drop),
        e.free(kept),
        e.sleep(&["default"]).map(drop),
        e.wake(NONE).map(drop),
        e.trim_host().map(drop),
        e.close(),
    ] {
        let err = r.unwrap_err();
        assert!(
            matches!(&err, Error::InvalidState(m) if m.contains("unusable")),
            "{err}"
        );
    }
    // What happened can still be read.
    assert!(
        e.errors().iter().any(|m| m.contains("panicked")),
        "{:?}",
        e.errors()
    );
    assert_eq!(e.stats().live_allocations, 1);
}

#[test]
fn pin_chunk_sizes_that_cannot_be_rounded_are_refused_and_sleep_still_ends() {
    let (sim, e) = engine(1, 16 << 20);
    for bad in [0, usize::MAX - 10, usize::MAX, isize::MAX as usize + 1] {
        let err = e.set_pin_chunk(bad).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("pin chunk")),
            "{bad}: {err}"
        );
    }
    // The largest accepted size: one cell for everything, and no overflow walking the cells.
    e.set_pin_chunk(isize::MAX as usize - (1 << 20)).unwrap();
    let a = e.malloc(3 * GRAN, 0, 0).unwrap();
    e.write(a, &pattern(1, 3 * GRAN)).unwrap();
    e.sleep(&["default"]).unwrap();
    e.wake(NONE).unwrap();
    assert_eq!(e.read(a, 3 * GRAN).unwrap(), pattern(1, 3 * GRAN));
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn a_free_that_fails_half_way_leaves_no_live_allocation_when_the_caller_forgets_it() {
    let (sim, e) = engine(1, 16 << 20);
    e.push_tag("weights").unwrap();
    let addrs: Vec<u64> = (0..3).map(|_| e.malloc(GRAN, 0, 0).unwrap()).collect();
    e.pop_tag().unwrap();
    // Allocator.free (and Engine::free) raise and keep the allocation live: the caller still has it.
    sim.inject_fault(Op::Unmap, 1, 999).unwrap();
    assert!(e.free(addrs[2]).is_err());
    assert_eq!(e.allocations().unwrap().len(), 3);
    // my_free's caller (torch) forgets the pointer: the rest of the release is queued, the failure recorded.
    for (op, addr) in [(Op::Synchronize, addrs[0]), (Op::Unmap, addrs[1])] {
        sim.inject_fault(op, 1, 999).unwrap();
        e.free_or_queue(addr).unwrap();
        assert!(
            e.allocations().unwrap().iter().all(|a| a.addr != addr),
            "{} failure left {addr:#x} live",
            op.name()
        );
        assert!(
            e.errors().iter().any(|m| m.contains(op.name())),
            "{:?}",
            e.errors()
        );
    }
    // Never backed up again: the sleep copies only the one allocation still live.
    let r = e.sleep(&["weights"]).unwrap();
    assert_eq!((r.allocations, r.copied_bytes), (1, GRAN));
    assert_eq!(
        e.stats().pending_releases,
        0,
        "the queued releases were retried"
    );
    e.wake(NONE).unwrap();
    e.free(addrs[2]).unwrap();
    e.close().unwrap();
    assert_no_leaks(&sim);
}

/// The same for members of a wake group (neighbours sharing one handle after a wake): a failed synchronize of
/// a member that is not the last, then a failed unmap of the group at its last member, each leave nothing live;
/// the group's release is queued, retried, and nothing leaks.
#[test]
fn a_group_member_free_that_fails_leaves_no_live_allocation_when_the_caller_forgets_it() {
    let (sim, e) = engine(1, 16 << 20);
    e.push_tag("weights").unwrap();
    let addrs: Vec<u64> = (0..3).map(|_| e.malloc(GRAN, 0, 0).unwrap()).collect();
    e.pop_tag().unwrap();
    for (i, a) in addrs.iter().enumerate() {
        e.write(*a, &pattern(i as u8, GRAN)).unwrap();
    }
    e.sleep(&["weights"]).unwrap();
    e.wake(NONE).unwrap();
    assert_eq!(e.stats().wake_groups, 1);
    sim.inject_fault(Op::Synchronize, 1, 999).unwrap();
    e.free_or_queue(addrs[0]).unwrap();
    assert_eq!(
        e.stats().unreturned_bytes,
        GRAN,
        "its memory stays with the group"
    );
    e.free(addrs[1]).unwrap();
    assert_eq!(e.read(addrs[2], GRAN).unwrap(), pattern(2, GRAN));
    sim.inject_fault(Op::Unmap, 1, 999).unwrap();
    assert!(
        e.free(addrs[2]).is_err(),
        "Engine::free raises and keeps it live"
    );
    assert_eq!(e.allocations().unwrap().len(), 1);
    sim.inject_fault(Op::Unmap, 1, 999).unwrap();
    e.free_or_queue(addrs[2]).unwrap();
    assert!(e.allocations().unwrap().is_empty());
    let s = e.stats();
    assert_eq!((s.wake_groups, s.unreturned_bytes), (0, 0));
    assert_eq!(
        s.pending_releases, 3,
        "unmap, release and address return of the group"
    );
    assert!(e.errors().iter().any(|m| m.contains("synchronize")));
    e.close().unwrap();
    assert_no_leaks(&sim);
}

/// Addresses whose unmap is still queued are not handed out again: a malloc that fails (set access refused, and
/// the undo's unmap refused too), or the free of an asleep allocation left mapped by a failed wake, must not let
/// the next malloc land on the still-mapped range (its map would fail with "already mapped").
#[test]
fn addresses_with_a_queued_unmap_are_not_handed_out_again() {
    let (sim, e) = engine(1, 16 << 20);
    let keep = e.malloc(GRAN, 0, 0).unwrap(); // keeps the shared reservation alive
    sim.inject_fault(Op::SetAccess, 1, 999).unwrap();
    sim.inject_fault(Op::Unmap, 1, 999).unwrap();
    assert!(e.malloc(GRAN, 0, 0).is_err());
    sim.inject_fault(Op::Unmap, 1, 999).unwrap(); // the retry at the next call is refused again
    let b = e.malloc(GRAN, 0, 0).expect("address space is plentiful");

    e.push_tag("w").unwrap();
    let a = e.malloc(GRAN, 0, 0).unwrap();
    e.pop_tag().unwrap();
    e.pause(Some(&["w"])).unwrap();
    sim.inject_fault(Op::SetAccess, 1, 999).unwrap();
    sim.inject_fault(Op::Unmap, 1, 999).unwrap();
    assert!(e.wake(Some(&["w"])).is_err());
    sim.inject_fault(Op::Unmap, 1, 999).unwrap(); // retried at the free: still refused
    e.free(a).unwrap();
    sim.inject_fault(Op::Unmap, 1, 999).unwrap(); // and at the next malloc
    let c = e.malloc(GRAN, 0, 0).expect("address space is plentiful");
    for p in [keep, b, c] {
        e.free(p).unwrap();
    }
    assert_eq!(
        e.stats().pending_releases,
        0,
        "the queued releases were retried"
    );
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn a_fault_too_far_ahead_to_ever_fire_is_refused() {
    let (sim, e) = engine(1, 16 << 20);
    let a = e.malloc(GRAN, 0, 0).unwrap(); // the create counter is at 1 now
    let err = sim.inject_fault(Op::Create, u64::MAX, 999).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("nth")),
        "{err}"
    );
    // The largest that can fire (at call number u64::MAX) is accepted.
    sim.inject_fault(Op::Create, u64::MAX - 1, 999).unwrap();
    sim.clear_faults();
    e.free(a).unwrap();
    e.close().unwrap();
}

#[test]
fn tag_stacks_of_closed_engines_do_not_pile_up() {
    // Closed on the thread that pushed: its stack goes at once.
    for _ in 0..300 {
        let (_, e) = engine(1, 16 << 20);
        e.push_tag("weights").unwrap();
        e.close().unwrap();
    }
    assert_eq!(tag_stacks_on_this_thread(), 0);
    // Pushed on another thread, closed here: that thread drops them at its next push once they pile up.
    let engines: Vec<Arc<Engine>> = (0..300).map(|_| Arc::new(engine(1, 16 << 20).1)).collect();
    let (pushed_tx, pushed_rx) = std::sync::mpsc::channel();
    let (closed_tx, closed_rx) = std::sync::mpsc::channel::<()>();
    let pusher = {
        let engines = engines.clone();
        std::thread::spawn(move || {
            for e in &engines {
                e.push_tag("weights").unwrap();
            }
            pushed_tx.send(tag_stacks_on_this_thread()).unwrap();
            closed_rx.recv().unwrap();
            let (_, fresh) = engine(1, 16 << 20);
            fresh.push_tag("weights").unwrap();
            tag_stacks_on_this_thread()
        })
    };
    assert_eq!(
        pushed_rx.recv().unwrap(),
        300,
        "live engines keep their stacks"
    );
    for e in &engines {
        e.close().unwrap();
    }
    closed_tx.send(()).unwrap();
    assert_eq!(
        pusher.join().unwrap(),
        1,
        "only the live engine's stack is left"
    );
}

#[test]
fn rounds_of_sleep_and_partial_wake_keep_host_memory_bounded() {
    // The review's case: four tags of one granule; sleep(all) then wake 3, 2, 1, 0 of them. Before the bound,
    // this held 10 granules of host memory for 4 asleep. Retained backups (kept by awake allocations across
    // wake) count as referenced.
    for retain in [false, true] {
        let (sim, e) = engine(1, 16 << 20);
        e.set_retain_backups(retain).unwrap();
        let tags = ["a", "b", "c", "d"];
        let mut addrs = Vec::new();
        for (i, t) in tags.iter().enumerate() {
            e.push_tag(t).unwrap();
            let a = e.malloc(GRAN, 0, 0).unwrap();
            e.pop_tag().unwrap();
            e.write(a, &pattern(i as u8, GRAN)).unwrap();
            addrs.push(a);
        }
        let mut largest = 0;
        let check = |largest: usize, when: &str| {
            let (held, needed) = (e.host_bytes(), backups_referenced(&e));
            assert!(
                held <= needed + largest,
                "retain {retain}, {when}: {held} bytes held for {needed} referenced (largest sleep {largest})"
            );
        };
        for round in 0..4 {
            largest = largest.max(e.sleep(&tags).unwrap().copied_bytes);
            check(largest, &format!("round {round} after sleep"));
            e.wake(Some(&tags[..3 - round])).unwrap();
            check(largest, &format!("round {round} after wake"));
        }
        e.wake(NONE).unwrap();
        for (i, a) in addrs.iter().enumerate() {
            let got = e.read(*a, GRAN).unwrap();
            assert_eq!(
                got,
                pattern(i as u8, GRAN),
                "retain {retain}, tag {}",
                tags[i]
            );
        }
        check(largest, "after waking everything");
        e.close().unwrap();
        assert_no_leaks(&sim);
    }
}

#[test]
fn every_python_entry_point_turns_panics_into_errors() {
    // PyO3 turns a panic that reaches its trampoline into PanicException, a BaseException that `except
    // Exception` misses; python.rs runs every entry's body through `guard` instead. A new entry that forgets
    // it fails here.
    let src = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/rust/src/python.rs"))
        .unwrap();
    let lines: Vec<&str> = src.lines().collect();
    let mut in_methods = false;
    let mut checked = 0;
    for (i, line) in lines.iter().enumerate() {
        if line.starts_with("#[pymethods]") {
            in_methods = true;
        } else if in_methods && *line == "}" {
            in_methods = false;
        }
        let prev = if i > 0 { lines[i - 1] } else { "" };
        let entry = (in_methods && line.starts_with("    fn "))
            || (line.starts_with("fn ") && (prev == "#[pyfunction]" || prev == "#[pymodule]"));
        if !entry {
            continue;
        }
        let body = lines[i..]
            .iter()
            .skip_while(|l| !l.trim_end().ends_with('{'))
            .nth(1)
            .unwrap_or(&"");
        assert!(
            body.contains("guard("),
            "python.rs:{}: {} does not go through guard",
            i + 1,
            line.trim()
        );
        checked += 1;
    }
    assert!(
        checked >= 30,
        "found only {checked} entry points: the check no longer matches python.rs"
    );
}

/// The simulated driver held about a thousand live allocations at most: it opened a memfd per physical handle,
/// so under a descriptor limit of 1024 (a common default) malloc failed near allocation 1019 with "Too many open
/// files". With slices of a memfd per device, the limit is the device's capacity. The test runs itself again in
/// a child process whose descriptor limit is 256 (set by the shell's `ulimit`, which leaves this process alone).
#[test]
fn ten_thousand_live_allocations_under_a_descriptor_limit_of_256() {
    const CHILD: &str = "RELIABILITY_TEST_NOFILE_CHILD";
    const NAME: &str = "ten_thousand_live_allocations_under_a_descriptor_limit_of_256";
    if std::env::var_os(CHILD).is_none() {
        let out = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg("ulimit -n 256 && exec \"$0\" \"$@\"")
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--test-threads=1", "--nocapture"])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "the child failed:\n{text}");
        assert!(
            text.contains("1 passed"),
            "the child did not run the test:\n{text}"
        );
        return;
    }

    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let soft: u64 = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(soft <= 256, "the descriptor limit was not lowered: {soft}");

    const N: usize = 10_000;
    let page = 4096;
    let sim = Arc::new(
        SimDriver::new(cumem_rs::SimConfig {
            capacity: N * page,
            granularity: page,
            ..cumem_rs::SimConfig::default()
        })
        .unwrap(),
    );
    let e = Engine::new(sim.clone()).unwrap();
    let addrs: Vec<u64> = (0..N)
        .map(|i| {
            e.malloc(page, 0, 0)
                .unwrap_or_else(|err| panic!("allocation {i}: {err}"))
        })
        .collect();
    assert_eq!(sim.counts().handles, N);
    assert_eq!(
        sim.counts().used_bytes,
        vec![N * page],
        "the capacity is all used"
    );
    let marked = [0, 1, N / 2, N - 2, N - 1];
    for &i in &marked {
        e.write(addrs[i], &pattern(i as u8, page)).unwrap();
    }
    e.sleep(&["default"]).unwrap();
    assert_eq!(sim.counts().handles, 0, "asleep: every handle released");
    assert_eq!(sim.counts().used_bytes, vec![0]);
    e.wake(NONE).unwrap();
    // (The wake may map adjacent allocations with one handle, so only the bytes are counted.)
    assert_eq!(sim.counts().used_bytes, vec![N * page], "awake again");
    for &i in &marked {
        assert_eq!(
            e.read(addrs[i], page).unwrap(),
            pattern(i as u8, page),
            "allocation {i}"
        );
    }
    for a in addrs {
        e.free(a).unwrap();
    }
    e.close().unwrap();
    assert_no_leaks(&sim);
}
