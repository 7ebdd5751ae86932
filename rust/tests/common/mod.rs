//! Helpers shared by the engine tests on the simulated driver.

#![allow(dead_code)] // each test file uses its own subset

use std::sync::Arc;

use cumem_rs::driver::Driver;
use cumem_rs::{Engine, SimConfig, SimDriver};

pub const GRAN: usize = 64 << 10;

pub fn engine(devices: usize, capacity: usize) -> (Arc<SimDriver>, Engine) {
    engine_with_codec(devices, capacity, true)
}

/// An engine whose backups are raw (the sim offers no codec): for tests that count the copies, pinned cells
/// or host bytes of the raw path.
pub fn raw_engine(devices: usize, capacity: usize) -> (Arc<SimDriver>, Engine) {
    engine_with_codec(devices, capacity, false)
}

fn engine_with_codec(devices: usize, capacity: usize, compress: bool) -> (Arc<SimDriver>, Engine) {
    let sim = Arc::new(
        SimDriver::new(SimConfig {
            devices,
            capacity,
            granularity: GRAN,
            compress,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let engine = Engine::new(sim.clone() as Arc<dyn Driver>).unwrap();
    (sim, engine)
}

pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Allocations of the given sizes with known data: (addr, len, seed).
pub fn fill(e: &Engine, sizes: &[usize]) -> Vec<(u64, usize, u8)> {
    (sizes.iter().enumerate())
        .map(|(i, &n)| {
            let a = e.malloc(n, 0, 0).unwrap();
            e.write(a, &pattern(i as u8 + 1, n)).unwrap();
            (a, n, i as u8 + 1)
        })
        .collect()
}

/// The data `fill` wrote is there.
pub fn check(e: &Engine, allocs: &[(u64, usize, u8)]) {
    for &(a, n, seed) in allocs {
        assert_eq!(e.read(a, n).unwrap(), pattern(seed, n), "data of {a:#x}");
    }
}

pub fn assert_no_leaks(sim: &SimDriver) {
    let c = sim.counts();
    assert_eq!(
        (c.ranges, c.handles, c.mapped_bytes),
        (0, 0, 0),
        "driver resources left: {c:?}"
    );
    assert!(c.used_bytes.iter().all(|u| *u == 0), "{c:?}");
    assert_eq!(
        (c.host_registered, c.host_allocated),
        (0, 0),
        "host buffers left: {c:?}"
    );
    assert_eq!(c.markers, 0, "copy markers never waited for: {c:?}");
}

/// How often the simulated driver saw `op` called.
pub fn calls(sim: &SimDriver, op: &str) -> u64 {
    sim.counts()
        .calls
        .iter()
        .find(|c| c.0 == op)
        .map_or(0, |c| c.1)
}
