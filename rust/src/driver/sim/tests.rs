//! The simulated driver as users get it: fault injection (`driver/fault_injection.rs`) around the emulation.
//! (Here rather than next to the adaptor, so that `fault_injection` does not import `sim` back, not even in
//! tests.)

use crate::driver::{Driver, Op};
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
