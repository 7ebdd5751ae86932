//! Registry operations with 10^5 live allocations: what malloc, free and the sleep/wake selections cost in
//! bookkeeping alone (no driver calls). Run: `cargo bench --no-default-features --bench registry`.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use cumem_rs::driver::PhysHandle;
use cumem_rs::registry::{Allocation, Backing, Registry, State};

const LIVE: u64 = 100_000;
const GRAN: u64 = 2 << 20;

fn allocation(i: u64, tag: &Arc<str>) -> Allocation {
    Allocation {
        addr: (1 << 40) + i * GRAN,
        size: GRAN as usize,
        requested: GRAN as usize,
        device: 0,
        tag: tag.clone(),
        stream: 0,
        state: State::Awake {
            backing: Backing::Own(PhysHandle(i)),
        },
    }
}

fn full_registry() -> Registry {
    let (w, kv): (Arc<str>, Arc<str>) = (Arc::from("weights"), Arc::from("kv_cache"));
    let mut r = Registry::default();
    for i in 0..LIVE {
        r.insert(allocation(i, if i % 2 == 0 { &w } else { &kv }));
    }
    r
}

fn bench(c: &mut Criterion) {
    let tag: Arc<str> = Arc::from("weights");
    let mut r = full_registry();
    c.bench_function("insert+remove at 1e5 live", |b| {
        b.iter(|| {
            r.insert(allocation(LIVE + 1, &tag));
            black_box(r.remove((1 << 40) + (LIVE + 1) * GRAN));
        })
    });
    c.bench_function("containing (interior address) at 1e5 live", |b| {
        let addr = (1 << 40) + (LIVE / 2) * GRAN + 12345;
        b.iter(|| black_box(r.containing(black_box(addr), 64)))
    });
    c.bench_function("select one tag of 1e5 live (sleep's selection)", |b| {
        b.iter(|| black_box(r.select(|a| &*a.tag == "weights")))
    });
    c.bench_function("mapped_bytes of 1e5 live (usage)", |b| {
        b.iter(|| black_box(r.mapped_bytes(None)))
    });
    c.bench_function("build a registry of 1e5", |b| {
        b.iter_batched(
            || (),
            |_| black_box(full_registry()),
            BatchSize::PerIteration,
        )
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
