//! The smallest pin chunk (one page) on the simulated driver: the host arena is registered in one piece per page,
//! and sleep and wake stay correct and proportional to the bytes. A copy may not span two registrations, so each
//! direction makes exactly one copy per page: no more (the lookups behind each copy are bounded in the crate's unit
//! tests), and no fewer.

mod common;

use common::{assert_no_leaks, calls, check, fill, raw_engine, GRAN};
use cumem_rs::driver::Op;

fn page() -> usize {
    rustix::param::page_size()
}

#[test]
fn page_pin_chunk_copies_once_per_page_each_way_cold_and_steady() {
    let (sim, e) = raw_engine(1, 64 << 20); // the raw path: counts its copies
    e.set_retain_backups(false).unwrap(); // every sleep copies every byte
    e.set_pin_chunk(page()).unwrap();
    let allocs = fill(&e, &[3 * GRAN, 17 * GRAN, GRAN, 43 * GRAN]);
    let total: usize = allocs.iter().map(|a| a.1).sum();
    let pages = (total / page()) as u64;
    for round in ["cold", "steady"] {
        let (d2h, h2d) = (calls(&sim, "copy_d2h"), calls(&sim, "copy_h2d"));
        let report = e.sleep(&["default"]).unwrap();
        assert_eq!(report.copied_bytes, total, "{round}");
        assert_eq!(sim.counts().host_registered, pages as usize, "{round}");
        assert_eq!(calls(&sim, "copy_d2h") - d2h, pages, "{round} sleep");
        let report = e.wake(None::<&[&str]>).unwrap();
        assert_eq!(report.copied_bytes, total, "{round}");
        assert_eq!(calls(&sim, "copy_h2d") - h2d, pages, "{round} wake");
        check(&e, &allocs);
    }
    assert!(e.errors().is_empty(), "{:?}", e.errors());
    e.close().unwrap();
    assert_no_leaks(&sim);
}

/// A cached arena pinned in page cells, with one page left pageable (its registration failed), slept into with a
/// pin chunk of three pages: the cell that starts at the pageable page holds two pinned pages. Registering that cell
/// would overlap them; CUDA refuses it (already registered), and so does the allocator now before asking any driver,
/// so the simulated driver's registrations stay the pieces the arena knows. The cell is copied through pageable
/// memory for the unpinned page, its data intact.
#[test]
fn a_cell_over_pinned_pages_is_refused_and_copied_through_pageable_memory() {
    let (sim, e) = raw_engine(1, 64 << 20); // the raw path: counts its copies
    e.set_retain_backups(false).unwrap();
    e.set_pin_chunk(page()).unwrap();
    let allocs = fill(&e, &[GRAN, 2 * GRAN]);
    let total: usize = allocs.iter().map(|a| a.1).sum();
    let pages = total / page();
    sim.inject_fault(Op::HostRegister, 4, 999).unwrap(); // page 3 stays pageable
    e.sleep(&["default"]).unwrap();
    assert_eq!(sim.counts().host_registered, pages - 1);
    e.wake(None::<&[&str]>).unwrap();
    check(&e, &allocs);
    let recorded = e.errors().len();

    e.set_pin_chunk(3 * page()).unwrap();
    e.sleep(&["default"]).unwrap();
    assert_eq!(
        sim.counts().host_registered,
        pages - 1,
        "no registration over pinned pages"
    );
    let errors = e.errors();
    assert!(
        errors[recorded..]
            .iter()
            .any(|m| m.contains("ALREADY_REGISTERED")),
        "{errors:?}"
    );
    e.wake(None::<&[&str]>).unwrap();
    check(&e, &allocs);
    e.close().unwrap();
    assert_no_leaks(&sim);
}
