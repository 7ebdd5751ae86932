//! Every driver call of a scenario rich in wake groups fails once, in turn: two devices, cells that split
//! allocations, groups on both devices, retained backups with changed chunks, a member freed while its
//! neighbours live, pause/resume, discard and another cycle. After each failure every written allocation is
//! awake with its data or asleep with a backup equal to it, the driver maps exactly the live allocations plus
//! the unreturned bytes of groups, a later wake restores everything, and close leaves nothing behind.

mod common;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use common::{assert_no_leaks, engine, pattern, GRAN};
use cumem_rs::driver::Op;
use cumem_rs::{Engine, Error};

const NONE: Option<&[&str]> = None;

/// Allocation -> the bytes it must hold (removed when a write failed half way or it was freed).
type Expected = HashMap<u64, Vec<u8>>;

fn write(e: &Engine, x: &mut Expected, a: u64, data: Vec<u8>) -> Result<(), Error> {
    if let Err(err) = e.write(a, &data) {
        x.remove(&a); // contents unknown after a failed write
        return Err(err);
    }
    x.insert(a, data);
    Ok(())
}

fn scenario(e: &Engine, x: &mut Expected) -> Result<(), Error> {
    e.set_pin_chunk(3 * GRAN / 2)?; // cells split allocations
    e.push_tag("weights")?;
    let mut addrs = Vec::new();
    let made: Result<(), Error> = (|| {
        for i in 0..6 {
            addrs.push(e.malloc(if i == 2 { 2 * GRAN } else { GRAN }, 0, 0)?);
        }
        addrs.push(e.malloc(GRAN, 1, 0)?);
        addrs.push(e.malloc(GRAN, 1, 0)?);
        Ok(())
    })();
    e.pop_tag()?;
    made?;
    let other = e.malloc(GRAN, 0, 0)?;
    for (i, a) in addrs.iter().enumerate() {
        write(
            e,
            x,
            *a,
            pattern(i as u8, if i == 2 { 2 * GRAN } else { GRAN }),
        )?;
    }
    e.sleep(&["weights"])?;
    e.wake(NONE)?; // forms the groups
    write(e, x, addrs[1], pattern(101, GRAN))?;
    write(e, x, addrs[7], pattern(107, GRAN))?;
    e.sleep(&["weights"])?; // retained backups: changed chunks only
    e.wake(NONE)?;
    write(e, x, addrs[3], pattern(103, GRAN))?;
    x.remove(&addrs[0]);
    e.free_or_queue(addrs[0])?; // a member freed while its neighbours live
    e.pause(Some(&["weights"]))?;
    e.resume(Some(&["weights"]))?;
    write(e, x, addrs[4], pattern(104, GRAN))?;
    e.discard(&["default"])?;
    e.wake(NONE)?;
    e.free_or_queue(other)?;
    x.remove(&addrs[6]);
    e.free_or_queue(addrs[6])?;
    e.sleep(&["weights"])?;
    e.wake(Some(&["weights"]))?;
    Ok(())
}

fn check(e: &Engine, x: &Expected, what: &str) {
    let live = e.allocations().unwrap();
    for (a, want) in x {
        let info = live
            .iter()
            .find(|i| i.addr == *a)
            .unwrap_or_else(|| panic!("{what}: {a:#x} vanished"));
        let held = if info.asleep {
            assert!(info.backed_up, "{what}: {a:#x} asleep without a backup");
            e.read_backup(*a, want.len()).unwrap().unwrap()
        } else {
            e.read(*a, want.len()).unwrap()
        };
        assert!(
            &held == want,
            "{what}: {a:#x} (asleep: {}) lost its data",
            info.asleep
        );
    }
}

#[test]
fn every_single_fault_of_a_scenario_with_wake_groups_leaves_data_and_driver_consistent() {
    let (sim, e) = engine(2, 64 << 20);
    scenario(&e, &mut Expected::new()).unwrap();
    assert!(
        e.stats().wake_groups >= 1,
        "the scenario ends with a wake group"
    );
    let calls = sim.counts().calls;
    drop(e);
    let mut positions = 0;
    for (name, n) in calls {
        let op = Op::parse(name).unwrap();
        if op == Op::CorruptCopyH2D {
            continue; // it damages what a write puts on the device too: the caller's bytes, no call can tell
        }
        for nth in 1..=n {
            let (sim, e) = engine(2, 64 << 20);
            sim.inject_fault(op, nth, 999).unwrap();
            let mut x = Expected::new();
            let result = catch_unwind(AssertUnwindSafe(|| scenario(&e, &mut x)))
                .unwrap_or_else(|_| panic!("{name}#{nth}: panicked"));
            sim.clear_faults();
            let what = format!("{name}#{nth} ({result:?})");
            assert!(
                result.is_err() || !e.errors().is_empty(),
                "{what}: the failure vanished"
            );
            let mapped = e.usage(None).unwrap() + e.stats().unreturned_bytes;
            assert_eq!(
                mapped,
                sim.counts().mapped_bytes,
                "{what}: registry and driver disagree"
            );
            check(&e, &x, &what);
            e.wake(NONE)
                .unwrap_or_else(|err| panic!("{what}: wake after: {err}"));
            check(&e, &x, &format!("{what}, after a wake"));
            e.close()
                .unwrap_or_else(|err| panic!("{what}: close: {err}"));
            assert_no_leaks(&sim);
            positions += 1;
        }
    }
    assert!(positions > 200, "{positions} fault positions");
}
