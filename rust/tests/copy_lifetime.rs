//! Host backup memory must never be unpinned while a copy into it may still be queued. The simulated driver
//! copies synchronously, so this is checked on the order of driver calls instead: a wrapper records every call
//! the engine makes to the (real) simulated driver, and the test replays that log against the CUDA rule
//! "a queued copy is finished only by a later wait of its device's stream (or a marker recorded after it)".

use std::collections::HashMap;
use std::sync::Arc;

use cumem_rs::driver::sim::SimDriver;
use cumem_rs::driver::{DevPtr, DeviceInfo, Driver, HostPtr, Op, PhysHandle};
use cumem_rs::{Engine, Result, SimConfig};
use parking_lot::Mutex;

const GRAN: usize = 64 << 10;

#[derive(Debug, Clone)]
enum Call {
    Copy(i32),
    Record(i32, u64),
    WaitMarker(i32, u64),
    Wait(i32),
    Unpin,
}

struct Recording {
    sim: SimDriver,
    log: Mutex<Vec<Call>>,
}

impl Recording {
    fn push(&self, c: Call) {
        self.log.lock().push(c);
    }
}

impl Driver for Recording {
    fn backend(&self) -> &'static str {
        "sim"
    }
    fn device_count(&self) -> Result<usize> {
        self.sim.device_count()
    }
    fn granularity(&self, device: i32) -> Result<usize> {
        self.sim.granularity(device)
    }
    fn mem_info(&self, device: i32) -> Result<(usize, usize)> {
        self.sim.mem_info(device)
    }
    fn device_info(&self, device: i32) -> Result<DeviceInfo> {
        self.sim.device_info(device)
    }
    fn reserve(&self, device: i32, size: usize) -> Result<DevPtr> {
        self.sim.reserve(device, size)
    }
    fn free_range(&self, addr: DevPtr, size: usize) -> Result<()> {
        self.sim.free_range(addr, size)
    }
    fn create(&self, device: i32, size: usize) -> Result<PhysHandle> {
        self.sim.create(device, size)
    }
    fn release(&self, handle: PhysHandle) -> Result<()> {
        self.sim.release(handle)
    }
    fn map(&self, addr: DevPtr, size: usize, handle: PhysHandle) -> Result<()> {
        self.sim.map(addr, size, handle)
    }
    fn unmap(&self, addr: DevPtr, size: usize) -> Result<()> {
        self.sim.unmap(addr, size)
    }
    fn set_access(&self, device: i32, addr: DevPtr, size: usize) -> Result<()> {
        self.sim.set_access(device, addr, size)
    }
    unsafe fn copy_d2h(&self, device: i32, dst: HostPtr, src: DevPtr, size: usize) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        let r = unsafe { self.sim.copy_d2h(device, dst, src, size) };
        if r.is_ok() {
            self.push(Call::Copy(device));
        }
        r
    }
    unsafe fn copy_h2d(&self, device: i32, dst: DevPtr, src: HostPtr, size: usize) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        let r = unsafe { self.sim.copy_h2d(device, dst, src, size) };
        if r.is_ok() {
            self.push(Call::Copy(device));
        }
        r
    }
    fn memset_zero(&self, device: i32, addr: DevPtr, size: usize) -> Result<()> {
        self.sim.memset_zero(device, addr, size) // device memory only: no host buffer to keep alive
    }
    fn queue_fingerprints(&self, device: i32, chunks: &[(DevPtr, usize)]) -> Result<()> {
        let r = self.sim.queue_fingerprints(device, chunks);
        if r.is_ok() {
            self.push(Call::Copy(device)); // stream work like a copy, finished by the same waits
        }
        r
    }
    fn take_fingerprints(&self, device: i32) -> Result<Vec<cumem_rs::fingerprint::Fingerprint>> {
        self.sim.take_fingerprints(device)
    }
    fn wait(&self, device: i32) -> Result<()> {
        self.push(Call::Wait(device)); // even a failed wait ends the stream's work on CUDA (it reports the error)
        self.sim.wait(device)
    }
    fn record_marker(&self, device: i32) -> Result<u64> {
        let m = self.sim.record_marker(device)?;
        self.push(Call::Record(device, m));
        Ok(m)
    }
    fn wait_marker(&self, device: i32, marker: u64) -> Result<()> {
        self.push(Call::WaitMarker(device, marker));
        self.sim.wait_marker(device, marker)
    }
    fn synchronize(&self, device: i32, stream: u64) -> Result<()> {
        self.sim.synchronize(device, stream)
    }
    unsafe fn host_register(&self, ptr: HostPtr, size: usize) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.sim.host_register(ptr, size) }
    }
    unsafe fn host_unregister(&self, ptr: HostPtr) -> Result<()> {
        self.push(Call::Unpin);
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.sim.host_unregister(ptr) }
    }
    fn host_alloc(&self, size: usize) -> Result<HostPtr> {
        self.sim.host_alloc(size)
    }
    unsafe fn host_free(&self, ptr: HostPtr) -> Result<()> {
        self.push(Call::Unpin);
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.sim.host_free(ptr) }
    }
    fn thread_spawn(&self) -> Result<()> {
        self.sim.thread_spawn()
    }
}

/// Replays the log: at every unpin, no device may have copies that no later wait or marker wait covered.
fn assert_no_copy_in_flight_at_unpin(log: &[Call]) {
    let mut pending: HashMap<i32, usize> = HashMap::new(); // copies queued since the last completion point
    let mut marked: HashMap<u64, (i32, usize)> = HashMap::new(); // marker -> copies it covers
    for (i, c) in log.iter().enumerate() {
        match c {
            Call::Copy(d) => *pending.entry(*d).or_default() += 1,
            Call::Record(d, m) => {
                marked.insert(*m, (*d, pending.get(d).copied().unwrap_or(0)));
            }
            Call::WaitMarker(d, m) => {
                let covered = marked.remove(m).map_or(0, |(_, n)| n);
                let p = pending.entry(*d).or_default();
                *p = p.saturating_sub(covered);
            }
            Call::Wait(d) => {
                pending.insert(*d, 0);
            }
            Call::Unpin => {
                let busy: Vec<_> = pending.iter().filter(|(_, n)| **n > 0).collect();
                assert!(
                    busy.is_empty(),
                    "host memory unpinned at call {i} with copies still queued: {busy:?}\n{log:?}"
                );
            }
        }
    }
}

/// An engine on two simulated devices whose driver calls are logged.
fn recorded_engine() -> (Arc<Recording>, Engine) {
    let rec = Arc::new(Recording {
        sim: SimDriver::new(SimConfig {
            devices: 2,
            capacity: 16 << 20,
            granularity: GRAN,
            ..SimConfig::default()
        })
        .unwrap(),
        log: Mutex::new(Vec::new()),
    });
    let e = Engine::new(rec.clone() as Arc<dyn Driver>).unwrap();
    (rec, e)
}

/// Which call of a sleep → wake → sleep → wake cycle a fault is armed before.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    FirstSleep,
    FirstWake,
}

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + seed * 13) as u8).collect()
}

/// How often `op` reached the simulated driver so far.
fn calls_of(rec: &Recording, op: Op) -> u64 {
    (rec.sim.counts().calls.iter())
        .find(|c| c.0 == op.name())
        .map_or(0, |c| c.1)
}

/// What one faulted cycle did: the driver log, whether the armed fault was reached (the op was called at least
/// `nth` times in the faulted call) and whether that call failed.
struct Faulted {
    log: Vec<Call>,
    /// Calls of the op the faulted sleep or wake made.
    calls: u64,
    fired: bool,
    failed: bool,
}

/// Six allocations on two devices with known data; the `nth` next `op` call of `phase` fails (none if `nth` is
/// 0, for counting the calls of a clean run). The fault is cleared once that call returns; whatever it did, the
/// wake and the cycle after it must succeed and give the data back, so no result is dropped.
fn run_with_fault(op: Op, nth: u64, phase: Phase, prints: bool) -> Faulted {
    let (rec, e) = recorded_engine();
    if !prints {
        // No fingerprints at all: every wait of a sleep is then a wait for its copies.
        e.set_retain_backups(false).unwrap();
        e.set_verify_wakes(false).unwrap();
    }
    e.set_pin_chunk(3 * 4096 * 5).unwrap();
    e.set_keep_host_memory(false).unwrap(); // a buffer no allocation uses is unpinned at once
    e.push_tag("weights").unwrap();
    let allocs: Vec<(u64, usize)> = (0..6)
        .map(|i| {
            let n = GRAN * (1 + i % 3);
            let a = e.malloc(n, (i % 2) as i32, 0).unwrap();
            e.write(a, &pattern(i, n)).unwrap();
            (a, n)
        })
        .collect();
    e.pop_tag().unwrap();
    let ctx = format!("{} fault at call {nth} of {phase:?}", op.name());
    if phase == Phase::FirstWake {
        e.sleep(&["weights"]).unwrap();
    }
    let before = calls_of(&rec, op);
    if nth > 0 {
        rec.sim.inject_fault(op, nth, 999).unwrap();
    }
    let result = match phase {
        Phase::FirstSleep => e.sleep(&["weights"]).map(drop),
        Phase::FirstWake => e.wake(None::<&[&str]>).map(drop),
    };
    let calls = calls_of(&rec, op) - before;
    let fired = nth > 0 && calls >= nth;
    rec.sim.clear_faults();
    let failed = result.is_err();
    // After a failed wake everything is still asleep with its backup; after a failed sleep what it put to sleep
    // has its backup: either way this wake restores it all.
    e.wake(None::<&[&str]>)
        .unwrap_or_else(|err| panic!("{ctx}: the wake after it failed: {err}"));
    for (i, &(a, n)) in allocs.iter().enumerate() {
        assert!(
            e.read(a, n).unwrap() == pattern(i, n),
            "{ctx}: data of allocation {i}"
        );
    }
    e.sleep(&["weights"])
        .unwrap_or_else(|err| panic!("{ctx}: the clean sleep after it failed: {err}"));
    e.wake(None::<&[&str]>)
        .unwrap_or_else(|err| panic!("{ctx}: the clean wake after it failed: {err}"));
    for (i, &(a, n)) in allocs.iter().enumerate() {
        assert!(
            e.read(a, n).unwrap() == pattern(i, n),
            "{ctx}: data of allocation {i} after the clean cycle"
        );
    }
    e.close().unwrap();
    let log = rec.log.lock().clone();
    Faulted {
        log,
        calls,
        fired,
        failed,
    }
}

#[test]
fn no_host_buffer_is_unpinned_under_queued_copies_whatever_fails() {
    // Each op in the phase that calls it (a wake records no markers and pins nothing); a copy or a wait that fails must fail its sleep or wake
    // (a failed registration may fall back to an unpinned copy, a failed marker to a full wait). With prints on, a
    // sleep also waits for its fingerprint batch, whose failure costs only the prints (the sleep copies everything,
    // its wake goes unverified), so the wait of a sleep must fail it only without prints; the data is checked
    // intact either way.
    let cases = [
        (Op::CopyD2H, Phase::FirstSleep, true, true),
        (Op::Record, Phase::FirstSleep, false, true),
        (Op::Wait, Phase::FirstSleep, true, false),
        (Op::Wait, Phase::FirstSleep, false, true),
        (Op::HostRegister, Phase::FirstSleep, false, true),
        (Op::CopyH2D, Phase::FirstWake, true, true),
        (Op::Wait, Phase::FirstWake, true, true),
    ];
    for (op, phase, must_fail, prints) in cases {
        let clean = run_with_fault(op, 0, phase, prints);
        assert_no_copy_in_flight_at_unpin(&clean.log);
        assert!(
            !clean.failed && clean.calls > 0,
            "{} is called in {phase:?}",
            op.name()
        );
        let mut fired = 0;
        for nth in 1..=12 {
            let run = run_with_fault(op, nth, phase, prints);
            assert_no_copy_in_flight_at_unpin(&run.log);
            let ctx = format!("{} fault at call {nth} of {phase:?}", op.name());
            // The faulted call runs like the clean one up to the fault, so it is reached exactly when the clean
            // run made that many calls.
            assert_eq!(run.fired, nth <= clean.calls, "{ctx}: fired");
            if must_fail {
                assert_eq!(run.failed, run.fired, "{ctx}: the call failed");
            }
            fired += u64::from(run.fired);
        }
        assert_eq!(
            fired,
            clean.calls.min(12),
            "{} faults of {phase:?} fired",
            op.name()
        );
    }
}

/// The review's case: a first sleep whose third registration fails leaves a cached arena with an unpinned cell;
/// the second sleep queues the copies of the pinned cells, then pins that cell on a worker thread. `arm` makes
/// that step go wrong (no thread, or a panic while pinning). Returns the log and whether the sleep panicked.
fn second_sleep_pins_with(arm: impl Fn(&SimDriver)) -> (Vec<Call>, bool) {
    let (rec, e) = recorded_engine();
    e.set_pin_chunk(GRAN).unwrap();
    e.set_retain_backups(false).unwrap(); // the second sleep copies into the cached arena, pinning its last cell
    e.push_tag("weights").unwrap();
    for i in 0..6 {
        e.malloc(GRAN * (1 + i % 3), (i % 2) as i32, 0).unwrap();
    }
    e.pop_tag().unwrap();
    rec.sim.inject_fault(Op::HostRegister, 3, 999).unwrap();
    e.sleep(&["weights"]).unwrap();
    e.wake(None::<&[&str]>).unwrap();
    arm(&rec.sim);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = e.sleep(&["weights"]);
    }))
    .is_err();
    assert_eq!(
        rec.sim.counts().markers,
        0,
        "every copy marker was waited for"
    );
    if panicked {
        let err = e.malloc(GRAN, 0, 0).unwrap_err();
        assert!(err.to_string().contains("unusable"), "{err}");
    } else {
        e.wake(None::<&[&str]>).unwrap();
        e.close().unwrap();
    }
    drop(e); // a poisoned engine gives its host memory back here
    let log = rec.log.lock().clone();
    (log, panicked)
}

#[test]
fn a_refused_thread_or_a_panic_while_pinning_never_unpins_under_queued_copies() {
    let (log, panicked) =
        second_sleep_pins_with(|sim| sim.inject_fault(Op::ThreadSpawn, 1, 999).unwrap());
    assert!(
        !panicked,
        "a refused thread is not a panic: the calling thread pins"
    );
    assert_no_copy_in_flight_at_unpin(&log);
    let (log, panicked) =
        second_sleep_pins_with(|sim| sim.inject_panic(Op::HostRegister, 1).unwrap());
    assert!(panicked);
    assert!(
        log.iter().any(|c| matches!(c, Call::Unpin)),
        "the arena was given back"
    );
    assert_no_copy_in_flight_at_unpin(&log);
}
