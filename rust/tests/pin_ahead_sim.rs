//! The host guard (a sleep or reserve_host that would pin past the host's memory is refused before anything is
//! released) and background pinning (a sleep racing the worker at every stage), on the simulated driver.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{assert_no_leaks, calls, check, fill, GRAN};
use cumem_rs::driver::Driver;
use cumem_rs::{Engine, SimConfig, SimDriver};

/// Cell size of pinning in these tests: an allocation of 4 cells backs up in 4 registrations.
const CELL: usize = GRAN;

fn engine_with(host_memory: Option<usize>, delay_ms: u64) -> (Arc<SimDriver>, Engine) {
    let sim = Arc::new(
        SimDriver::new(SimConfig {
            devices: 1,
            capacity: 64 << 20,
            granularity: GRAN,
            host_memory,
            host_register_delay: Duration::from_millis(delay_ms),
            // The raw path: these tests count the cells pinned ahead and used by the sleep's copies.
            compress: false,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let e = Engine::new(sim.clone() as Arc<dyn Driver>).unwrap();
    e.set_pin_chunk(CELL).unwrap();
    (sim, e)
}

fn wait_until(what: &str, f: impl Fn() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting: {what}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn sleep_past_the_host_budget_is_refused_with_every_allocation_awake() {
    let (sim, e) = engine_with(Some(6 * GRAN), 0);
    let allocs = fill(&e, &[4 * GRAN, 4 * GRAN]);
    let err = e.sleep(&["default"]).unwrap_err();
    let msg = err.to_string();
    assert!(err.is_out_of_memory(), "{msg}");
    assert!(
        msg.contains(&format!("{}", 8 * GRAN)) && msg.contains(&format!("{}", 6 * GRAN)),
        "{msg}"
    );
    assert!(e.allocations().unwrap().iter().all(|a| !a.asleep));
    assert_eq!(calls(&sim, "copy_d2h"), 0, "nothing was queued");
    assert_eq!(sim.counts().host_registered, 0);
    check(&e, &allocs);
    // After freeing one, the backup fits: the sleep works and the data comes back.
    e.free(allocs[1].0).unwrap();
    e.sleep(&["default"]).unwrap();
    e.wake(None::<&[&str]>).unwrap();
    check(&e, &allocs[..1]);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn reserve_host_past_the_host_budget_is_refused() {
    let (sim, e) = engine_with(Some(3 * GRAN), 0);
    let err = e.reserve_host(4 * GRAN, false).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert!(err.to_string().contains(&format!("{}", 3 * GRAN)), "{err}");
    assert_eq!(e.host_bytes(), 0);
    e.reserve_host(2 * GRAN, false).unwrap();
    assert_eq!(e.host_bytes(), 2 * GRAN);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

/// Start pinning ahead for `allocs`, let the worker reach `cells_before` cells (None: do not wait), sleep, and
/// check that no cell was registered twice and the data survives.
fn race(cells_before: Option<usize>) {
    let (sim, e) = engine_with(None, 20);
    let allocs = fill(&e, &[3 * GRAN, 5 * GRAN]);
    let total = 8 * GRAN;
    e.reserve_host(total, true).unwrap();
    if let Some(n) = cells_before {
        wait_until("worker progress", || {
            e.pin_ahead_status().unwrap().pinned >= n * CELL
        });
    }
    if cells_before == Some(8) {
        // Finished: its buffer counts as cached host memory without any call stopping it.
        wait_until("worker exit", || !e.pin_ahead_status().unwrap().running);
        assert_eq!(e.stats().host_cached_bytes, total);
        assert_eq!(e.pin_ahead_status().unwrap(), Default::default());
    }
    let report = e.sleep(&["default"]).unwrap();
    assert_eq!(report.copied_bytes, total);
    assert!(!e.pin_ahead_status().unwrap().running);
    // Each cell registered exactly once, by the worker or by the sleep; none failed as already registered.
    assert_eq!(calls(&sim, "host_register"), 8, "{:?}", e.errors());
    assert_eq!(sim.counts().host_registered, 8);
    assert!(e.errors().is_empty(), "{:?}", e.errors());
    e.wake(None::<&[&str]>).unwrap();
    check(&e, &allocs);
    // The second sleep is steady: nothing more pinned.
    e.sleep(&["default"]).unwrap();
    e.wake(None::<&[&str]>).unwrap();
    assert_eq!(calls(&sim, "host_register"), 8);
    check(&e, &allocs);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn sleep_right_after_pinning_ahead_started() {
    race(None);
}

#[test]
fn sleep_when_half_the_cells_are_pinned_ahead() {
    race(Some(4));
}

#[test]
fn sleep_after_pinning_ahead_finished() {
    race(Some(8));
}

#[test]
fn close_and_trim_stop_the_worker() {
    let (sim, e) = engine_with(None, 20);
    e.reserve_host(16 * GRAN, true).unwrap();
    wait_until("first cell", || {
        e.pin_ahead_status().unwrap().pinned >= CELL
    });
    e.trim_host().unwrap();
    assert!(!e.pin_ahead_status().unwrap().running);
    assert_eq!(
        sim.counts().host_registered,
        0,
        "trim returned the part pinned"
    );
    e.reserve_host(16 * GRAN, true).unwrap();
    wait_until("first cell", || {
        e.pin_ahead_status().unwrap().pinned >= CELL
    });
    e.close().unwrap();
    assert_no_leaks(&sim);
    // Dropped while pinning: the drop joins the worker, which unpins what it pinned.
    let (sim, e) = engine_with(None, 20);
    e.reserve_host(16 * GRAN, true).unwrap();
    drop(e);
    assert_eq!(sim.counts().host_registered, 0);
}

#[test]
fn set_keep_host_memory_off_stops_the_worker_and_malloc_does_not_wait() {
    let (sim, e) = engine_with(None, 50);
    e.reserve_host(32 * GRAN, true).unwrap();
    // Malloc and free while the worker pins (32 cells at 50 ms): they do not wait for it.
    let t = Instant::now();
    let a = e.malloc(GRAN, 0, 0).unwrap();
    e.free(a).unwrap();
    assert!(
        e.pin_ahead_status().unwrap().running,
        "still pinning after {:?}",
        t.elapsed()
    );
    e.set_keep_host_memory(false).unwrap();
    assert!(!e.pin_ahead_status().unwrap().running);
    assert_eq!(sim.counts().host_registered, 0);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn worker_stops_at_the_host_budget_with_one_warning_and_the_sleep_uses_what_fits() {
    let (sim, e) = engine_with(Some(5 * GRAN), 0);
    let allocs = fill(&e, &[4 * GRAN]);
    // Asked for more than the budget: the worker pins 5 cells and stops, recording one warning.
    e.reserve_host(8 * GRAN, true).unwrap();
    wait_until("worker done", || !e.pin_ahead_status().unwrap().running);
    e.stop_pinning_ahead().unwrap();
    let errors = e.errors();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("out of memory") && errors[0].contains("pinning ahead"),
        "{errors:?}"
    );
    assert_eq!(sim.counts().host_registered, 5);
    // The sleep backs up 4 cells into the part already pinned: nothing more to pin, so it fits.
    e.sleep(&["default"]).unwrap();
    assert_eq!(calls(&sim, "host_register"), 5);
    e.wake(None::<&[&str]>).unwrap();
    check(&e, &allocs);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

#[test]
fn a_refused_worker_thread_is_recorded_and_the_sleep_pins_itself() {
    let (sim, e) = engine_with(None, 0);
    let allocs = fill(&e, &[2 * GRAN]);
    sim.inject_fault(cumem_rs::driver::Op::ThreadSpawn, 1, 999)
        .unwrap();
    e.reserve_host(2 * GRAN, true).unwrap();
    assert!(!e.pin_ahead_status().unwrap().running);
    assert!(
        e.errors()
            .iter()
            .any(|m| m.contains("background pinning worker")),
        "{:?}",
        e.errors()
    );
    e.sleep(&["default"]).unwrap();
    e.wake(None::<&[&str]>).unwrap();
    check(&e, &allocs);
    e.close().unwrap();
    assert_no_leaks(&sim);
}

/// Host bytes the bound of docs/errors-and-guarantees.md allows: backups still needed plus one spare no larger than the largest backup or
/// reservation.
fn bound(e: &Engine, largest: usize) -> usize {
    let asleep: usize = (e.allocations().unwrap().iter())
        .filter(|a| a.backed_up)
        .map(|a| a.size)
        .sum();
    asleep + e.stats().host_retained_bytes + largest
}

#[test]
fn reserving_again_while_a_small_backup_holds_the_reserved_arena_stays_within_the_bound() {
    for background in [false, true] {
        let (_sim, e) = engine_with(None, 0);
        let big = 64 << 20;
        e.reserve_host(big, false).unwrap();
        let a = fill(&e, &[GRAN]);
        e.pause(Some(&["default"])).unwrap(); // the 2 MiB backup goes into the reserved 64 MiB arena
        e.reserve_host(big, background).unwrap();
        if background {
            wait_until("worker done", || !e.pin_ahead_status().unwrap().running);
        }
        let held = e.host_bytes();
        assert!(
            held <= bound(&e, big),
            "background={background}: {held} bytes held, bound {}",
            bound(&e, big)
        );
        assert!(held >= big, "the reservation is kept: {held}");
        e.resume(None::<&[&str]>).unwrap();
        check(&e, &a);
        e.close().unwrap();
    }
}
