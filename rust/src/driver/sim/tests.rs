//! The simulated driver as users get it: fault injection (`driver/fault_injection.rs`) around the emulation.
//! (Here rather than next to the adaptor, so that `fault_injection` does not import `sim` back, not even in
//! tests.)

use crate::driver::{Driver, HostPtr, Op};
use crate::error::{cuda_code, Error};

use super::{SimConfig, SimDriver};

fn sim() -> SimDriver {
    SimDriver::new(SimConfig::default()).unwrap()
}

#[test]
fn the_nth_call_fails_with_the_code_and_the_others_reach_the_driver() {
    let d = sim();
    d.inject_fault(Op::Reserve, 2, cuda_code::OUT_OF_MEMORY)
        .unwrap();
    let a = d.reserve(0, 2 << 20).unwrap();
    let e = d.reserve(0, 2 << 20).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    let b = d.reserve(0, 2 << 20).unwrap();
    assert_eq!(
        d.inner().counts().ranges,
        2,
        "the failed call never reached the emulation"
    );
    let reserves = d.calls().into_iter().find(|c| c.0 == "reserve").unwrap();
    assert_eq!(reserves.1, 3, "every call is counted, the failed one too");
    d.free_range(a, 2 << 20).unwrap();
    d.free_range(b, 2 << 20).unwrap();
}

#[test]
fn a_failed_marker_wait_still_forgets_the_marker() {
    let d = sim();
    let m = d.record_marker(0).unwrap();
    d.inject_fault(Op::Wait, 1, cuda_code::UNKNOWN).unwrap();
    let e = d.wait_marker(0, m).unwrap_err();
    assert!(
        matches!(e, Error::Driver { code, .. } if code == cuda_code::UNKNOWN),
        "{e}"
    );
    assert_eq!(
        d.counts().markers,
        0,
        "the trait promises the marker is gone"
    );
}

#[test]
fn an_injected_panic_fires_once() {
    let d = sim();
    d.inject_panic(Op::Synchronize, 1).unwrap();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| d.synchronize(0, 0)));
    assert!(caught.is_err());
    d.synchronize(0, 0).unwrap();
    assert!(d.inject_fault(Op::Wait, 0, 1).is_err(), "nth 0 is refused");
    assert!(
        d.inject_fault(Op::Wait, u64::MAX, 1).is_ok(),
        "nothing called yet: it fits"
    );
    d.wait(0).unwrap();
    assert!(
        d.inject_fault(Op::Wait, u64::MAX, 1).is_err(),
        "it would wrap around"
    );
}

#[test]
fn device_info_answers_with_the_configuration() {
    let d = SimDriver::new(SimConfig {
        devices: 2,
        granularity: 64 << 10,
        ..SimConfig::default()
    })
    .unwrap();
    let info = d.device_info(1).unwrap();
    assert_eq!(info.name, "simulated device");
    assert_eq!(info.granularity, 64 << 10);
    assert!(!info.rdma_with_vmm);
    assert_eq!(info.driver_version, None);
    let e = d.device_info(2).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

// ----- the copy stream (`sim/stream.rs`) -----------------------------------------------------------------------

const SIZE: usize = 2 << 20;

/// One mapped, accessible granule on device 0 (filled with `POISON`), and its handle.
fn mapped(d: &SimDriver) -> (u64, crate::driver::PhysHandle) {
    let a = d.reserve(0, SIZE).unwrap();
    let h = d.create(0, SIZE).unwrap();
    d.map(a, SIZE, h).unwrap();
    d.set_access(0, a, SIZE).unwrap();
    (a, h)
}

fn is_illegal_address(e: &Error) -> bool {
    matches!(e, Error::Driver { code, .. } if *code == cuda_code::ILLEGAL_ADDRESS)
}

/// Queue a copy of `out.len()` bytes at `src` into `out`, without waiting.
fn queue_d2h(d: &SimDriver, out: &mut [u8], src: u64) {
    // SAFETY: every test below keeps `out` alive until the stream passed the copy or the context is poisoned
    // (which drops the queued work). The emulator runs queued work only inside the waiting call, on the caller's
    // thread, so the tests' reads of `out` in between see the bytes from before the copy, which is their point.
    unsafe { d.copy_d2h(0, HostPtr(out.as_mut_ptr() as usize), src, out.len()) }.unwrap();
}

fn queue_h2d(d: &SimDriver, dst: u64, data: &[u8]) {
    // SAFETY: as in queue_d2h; `data` is not written until the stream passed the copy.
    unsafe { d.copy_h2d(0, dst, HostPtr(data.as_ptr() as usize), data.len()) }.unwrap();
}

#[test]
fn a_queued_copy_runs_when_its_stream_is_waited_for_not_before() {
    let d = sim();
    let (a, _) = mapped(&d);
    let data = vec![7u8; 4096];
    let mut out = vec![0u8; 4096];
    queue_h2d(&d, a, &data);
    queue_d2h(&d, &mut out, a);
    assert_eq!(d.counts().queued, 2);
    assert!(out.iter().all(|&b| b == 0), "nothing ran at queue time");
    d.wait(0).unwrap();
    assert!(out.iter().all(|&b| b == 7), "both ran, in the order queued");
    assert_eq!(d.counts().queued, 0);
    // A fill is queued behind the copies too; synchronize runs the stream like wait.
    d.memset_zero(0, a, 4096).unwrap();
    queue_d2h(&d, &mut out, a);
    assert!(out.iter().all(|&b| b == 7));
    d.synchronize(0, 0).unwrap();
    assert!(out.iter().all(|&b| b == 0));
}

#[test]
fn without_stream_order_work_runs_as_it_is_queued() {
    let d = SimDriver::new(SimConfig {
        stream_order: false,
        ..SimConfig::default()
    })
    .unwrap();
    let (a, _) = mapped(&d);
    let mut out = vec![0u8; 64];
    queue_d2h(&d, &mut out, a);
    assert!(out.iter().all(|&b| b == super::POISON));
    assert_eq!(d.counts().queued, 0);
}

#[test]
fn unmap_under_a_queued_copy_is_a_sticky_illegal_address() {
    let d = sim();
    let (a, h) = mapped(&d);
    let mut out = vec![0u8; 4096];
    queue_d2h(&d, &mut out, a + 8192);
    let e = d.unmap(a, SIZE).unwrap_err();
    assert!(is_illegal_address(&e), "{e}");
    assert!(
        e.to_string().contains("copy_d2h"),
        "names the pending op: {e}"
    );
    assert!(out.iter().all(|&b| b == 0), "the copy never ran");
    // Sticky: every later call of the context fails with it, and names the first cause.
    for e in [
        d.wait(0).unwrap_err(),
        d.reserve(0, SIZE).unwrap_err(),
        d.release(h).unwrap_err(),
        d.record_marker(0).unwrap_err(),
    ] {
        assert!(is_illegal_address(&e), "{e}");
        assert!(e.to_string().contains("unmap of device"), "{e}");
    }
    assert!(d.inner().sticky_error().is_some());
}

#[test]
fn unmap_after_the_wait_is_fine_and_unrelated_ranges_may_go_while_work_is_queued() {
    let d = sim();
    let (a, h) = mapped(&d);
    let (b, hb) = mapped(&d);
    let mut out = vec![0u8; 4096];
    queue_d2h(&d, &mut out, a);
    d.unmap(b, SIZE).unwrap(); // the queued copy does not touch b
    d.release(hb).unwrap();
    d.wait(0).unwrap();
    d.unmap(a, SIZE).unwrap();
    d.release(h).unwrap();
    assert!(d.inner().sticky_error().is_none());
}

#[test]
fn unregistering_or_freeing_host_memory_under_a_queued_copy_is_a_sticky_illegal_address() {
    let d = sim();
    let (a, _) = mapped(&d);
    let mut host = vec![0u8; 8192];
    let ptr = HostPtr(host.as_mut_ptr() as usize);
    // SAFETY: `host` outlives its registration and every copy into it (the context is poisoned below, which
    // drops the copy).
    unsafe { d.host_register(ptr, host.len()) }.unwrap();
    // SAFETY: as above.
    unsafe { d.copy_d2h(0, HostPtr(ptr.0 + 4096), a, 4096) }.unwrap();
    // SAFETY: registered above; the point of the test is the copy still queued.
    let e = unsafe { d.host_unregister(ptr) }.unwrap_err();
    assert!(is_illegal_address(&e), "{e}");
    assert!(
        e.to_string().contains("host_unregister") && e.to_string().contains("copy_d2h"),
        "{e}"
    );
    assert!(host.iter().all(|&b| b == 0), "the copy never ran");

    let d = sim();
    let (a, _) = mapped(&d);
    let p = d.host_alloc(4096).unwrap();
    // SAFETY: `p` is the driver's own allocation of 4096 bytes, freed (refused) only below.
    unsafe { d.copy_h2d(0, a, p, 4096) }.unwrap();
    // SAFETY: from host_alloc above, freed once.
    let e = unsafe { d.host_free(p) }.unwrap_err();
    assert!(is_illegal_address(&e), "{e}");
    assert!(
        e.to_string().contains("host_free") && e.to_string().contains("copy_h2d"),
        "{e}"
    );
}

#[test]
fn a_marker_waits_for_the_work_before_it_only() {
    let d = sim();
    let (a, _) = mapped(&d);
    let (mut first, mut second) = (vec![0u8; 64], vec![0u8; 64]);
    queue_d2h(&d, &mut first, a);
    let m = d.record_marker(0).unwrap();
    queue_d2h(&d, &mut second, a);
    d.wait_marker(0, m).unwrap();
    assert!(
        first.iter().all(|&b| b == super::POISON),
        "before the marker: ran"
    );
    assert!(
        second.iter().all(|&b| b == 0),
        "after the marker: still queued"
    );
    // A marker the stream passed already waits for nothing.
    let passed = d.record_marker(0).unwrap();
    d.wait(0).unwrap();
    assert!(second.iter().all(|&b| b == super::POISON));
    let mut third = vec![0u8; 64];
    queue_d2h(&d, &mut third, a);
    d.wait_marker(0, passed).unwrap();
    assert!(
        third.iter().all(|&b| b == 0),
        "work queued after a passed marker"
    );
    d.wait(0).unwrap();
    assert_eq!(d.counts().markers, 0);
}

#[test]
fn a_fingerprint_batch_is_readable_once_the_stream_passed_it() {
    let d = sim();
    let (a, _) = mapped(&d);
    let data = vec![3u8; 4096];
    queue_h2d(&d, a, &data);
    d.queue_fingerprints(0, &[(a, 4096)]).unwrap();
    d.wait(0).unwrap();
    let prints = d.take_fingerprints(0).unwrap();
    assert_eq!(
        prints,
        vec![crate::fingerprint::fingerprint(&data)],
        "taken after the copy before it"
    );

    d.queue_fingerprints(0, &[(a, 4096)]).unwrap();
    let e = d.take_fingerprints(0).unwrap_err();
    assert!(is_illegal_address(&e), "{e}");
    assert!(e.to_string().contains("before its stream passed it"), "{e}");
}

#[test]
fn the_user_touching_memory_that_queued_work_uses_is_a_data_race() {
    let d = sim();
    let (a, _) = mapped(&d);
    let mut out = vec![0u8; 64];
    queue_d2h(&d, &mut out, a);
    // The queued copy only reads: reading alongside it is fine, and so is writing elsewhere.
    d.user_device_access(0, a, 64, false).unwrap();
    d.user_device_access(0, a + 64, 64, true).unwrap();
    let e = d.user_device_access(0, a, 64, true).unwrap_err();
    assert!(is_illegal_address(&e), "{e}");
    assert!(e.to_string().contains("data race"), "{e}");

    let d = sim();
    let (a, _) = mapped(&d);
    let data = vec![1u8; 64];
    queue_h2d(&d, a + 32, &data);
    let e = d.user_device_access(0, a, 64, false).unwrap_err();
    assert!(
        e.to_string().contains("read") && e.to_string().contains("copy_h2d"),
        "{e}"
    );
}

#[test]
fn a_failed_wait_still_runs_the_stream() {
    let d = sim();
    let (a, _) = mapped(&d);
    let mut out = vec![0u8; 64];
    queue_d2h(&d, &mut out, a);
    d.inject_fault(Op::Wait, 1, cuda_code::UNKNOWN).unwrap();
    let e = d.wait(0).unwrap_err();
    assert!(
        matches!(e, Error::Driver { code, .. } if code == cuda_code::UNKNOWN),
        "{e}"
    );
    assert!(out.iter().all(|&b| b == super::POISON));
    assert_eq!(d.counts().queued, 0);
}

#[test]
fn a_corrupting_copy_fault_flips_the_byte_in_stream_order() {
    let d = sim();
    let (a, _) = mapped(&d);
    let data = vec![9u8; 64];
    d.inject_fault(Op::CorruptCopyH2D, 1, cuda_code::UNKNOWN)
        .unwrap();
    queue_h2d(&d, a, &data);
    let mut out = vec![0u8; 64];
    queue_d2h(&d, &mut out, a);
    assert!(out.iter().all(|&b| b == 0), "nothing ran before the wait");
    d.wait(0).unwrap();
    assert_eq!(out[0], 9 ^ 0x5A);
    assert!(out[1..].iter().all(|&b| b == 9));
}

#[test]
fn handing_the_user_host_memory_that_queued_work_uses_is_a_data_race() {
    let d = sim();
    let (a, _) = mapped(&d);
    let data = vec![1u8; 64];
    queue_h2d(&d, a, &data); // reads `data`
    let at = HostPtr(data.as_ptr() as usize);
    d.user_host_access(at, 64, false).unwrap();
    let e = d.user_host_access(at, 64, true).unwrap_err();
    assert!(
        is_illegal_address(&e) && e.to_string().contains("writable view"),
        "{e}"
    );

    let d = sim();
    let (a, _) = mapped(&d);
    let mut out = vec![0u8; 64];
    queue_d2h(&d, &mut out, a); // writes `out`
    let e = d
        .user_host_access(HostPtr(out.as_ptr() as usize + 32), 8, false)
        .unwrap_err();
    assert!(
        e.to_string().contains("data race") && e.to_string().contains("copy_d2h"),
        "{e}"
    );
}
