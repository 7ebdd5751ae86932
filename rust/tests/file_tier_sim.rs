//! The host budget and the file tier of the backup store on the simulated driver: what goes where, that the
//! bytes come back, and the transactional promises when a spill file's write or read fails.

mod common;

use common::{assert_no_leaks, engine, pattern, GRAN};
use cumem_rs::{Engine, Error};

fn weights(e: &Engine, granules: usize, seed: u8) -> (u64, Vec<u8>) {
    e.push_tag("weights").unwrap();
    let addr = e.malloc(granules * GRAN, 0, 0).unwrap();
    e.pop_tag().unwrap();
    let data = pattern(seed, granules * GRAN);
    e.write(addr, &data).unwrap();
    (addr, data)
}

#[test]
fn without_a_spill_dir_a_sleep_past_the_host_budget_is_refused_before_anything_is_released() {
    let (sim, e) = engine(1, 16 << 20);
    let (a, da) = weights(&e, 2, 1);
    let (b, db) = weights(&e, 2, 2);
    e.set_host_budget(Some(3 * GRAN)).unwrap();
    let err = e.sleep(&["weights"]).unwrap_err();
    assert!(
        matches!(&err, Error::OutOfMemory { what } if what.contains("host budget of 196608 bytes")),
        "{err}"
    );
    assert_eq!(e.stats().asleep_allocations, 0, "nothing was released");
    assert_eq!(
        (e.read(a, da.len()).unwrap(), e.read(b, db.len()).unwrap()),
        (da.clone(), db.clone())
    );
    assert_eq!(e.host_bytes(), 0);
    // Within the budget it sleeps, and what is held stays within it.
    e.set_host_budget(Some(4 * GRAN)).unwrap();
    e.sleep(&["weights"]).unwrap();
    assert!(e.host_bytes() <= 4 * GRAN);
    e.wake::<&str>(None).unwrap();
    assert_eq!(
        (e.read(a, da.len()).unwrap(), e.read(b, db.len()).unwrap()),
        (da, db)
    );
    // A reservation past the budget is refused too.
    assert!(matches!(
        e.reserve_host(8 * GRAN, false),
        Err(Error::OutOfMemory { .. })
    ));
    e.set_host_budget(None).unwrap();
    e.close().unwrap();
    assert_no_leaks(&sim);
}
