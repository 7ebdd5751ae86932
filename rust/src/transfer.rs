//! The copies of a sleep: allocation contents laid out back to back in one host arena, walked in cells (the unit
//! of pinning and of completion tracking), each copy kept inside one pinned piece.
//!
//! A cell's copies are followed by a marker on every device they used; waiting for a cell's markers proves its
//! bytes are on the host, so the engine can release the allocations whose every byte is in finished cells while
//! later cells are still copying.
//!
//! The issued copies live in an `InFlight`, whose drop waits for whatever was not waited for yet: after an error,
//! and when a panic unwinds, no copy can still be writing into the arena when it is unpinned.

use std::collections::VecDeque;

use crate::driver::{DevPtr, Driver};
use crate::error::{Error, Result};
use crate::host::HostBuffer;

/// One allocation to back up: `size` bytes at `addr` on `device`, going to `offset` of the arena.
#[derive(Debug, Clone, Copy)]
pub struct Job {
    pub device: i32,
    pub addr: DevPtr,
    pub size: usize,
    pub offset: usize,
    /// Its device range continues the previous job's in one reservation (same device): a copy may span both,
    /// so neighbours go out as one copy instead of one each (the driver's per-copy cost adds up at thousands).
    pub joins_previous: bool,
}

/// Lay `(device, addr, size)` allocations out back to back; returns the jobs and the arena size they need.
pub fn layout(allocs: impl IntoIterator<Item = (i32, DevPtr, usize)>) -> (Vec<Job>, usize) {
    let mut offset = 0;
    let jobs = allocs
        .into_iter()
        .map(|(device, addr, size)| {
            let j = Job {
                device,
                addr,
                size,
                offset,
                joins_previous: false,
            };
            offset += size;
            j
        })
        .collect();
    (jobs, offset)
}

/// A cell whose copies were queued: the markers to wait for and the jobs with bytes in it.
pub struct IssuedCell {
    pub markers: Vec<(i32, u64)>,
    pub jobs: Vec<usize>,
    /// Stream operations it queued (copies and markers).
    pub ops: usize,
}

/// Operations kept queued on the copy streams at most while issuing into a pinned arena. A CUDA stream holds
/// about a thousand pending operations; past that, queueing a copy blocks until one finishes, and a sleep of
/// thousands of small allocations would spend the whole copy time queueing before it could release anything
/// (measured: 6144 allocations of 2 MiB slept at 0.49x of the copy limit).
const MAX_QUEUED_OPS: usize = 512;

/// The copies of one sleep that were queued, cells in issue order. Dropping it waits for every marker not waited
/// for yet and, after any failure (or during a panic), for the whole copy stream of every device the jobs use,
/// since a copy queued before a failure may have no marker behind it.
pub struct InFlight<'d> {
    driver: &'d dyn Driver,
    cells: VecDeque<IssuedCell>,
    devices: Vec<i32>,
    failed: bool,
    drained: bool,
}

impl<'d> InFlight<'d> {
    fn new(driver: &'d dyn Driver, jobs: &[Job]) -> Self {
        let mut devices: Vec<i32> = jobs.iter().map(|j| j.device).collect();
        devices.sort_unstable();
        devices.dedup();
        InFlight {
            driver,
            cells: VecDeque::new(),
            devices,
            failed: false,
            drained: false,
        }
    }

    /// Wait for the next cell's copies; returns the jobs with bytes in it and whether its copies finished.
    /// Every marker is waited for even after one failed (the driver forgets a marker once waited for).
    pub fn next_cell(&mut self) -> Option<(Vec<usize>, Result<()>)> {
        let cell = self.cells.pop_front()?;
        let mut result = Ok(());
        for (device, marker) in cell.markers {
            if let Err(e) = self.driver.wait_marker(device, marker) {
                self.failed = true;
                result = result.and(Err(e));
            }
        }
        Some((cell.jobs, result))
    }

    /// Wait for the whole copy stream of every device the jobs use (their copies may have no marker behind them).
    fn drain(&mut self) {
        self.drained = true;
        for &d in &self.devices {
            let _ = self.driver.wait(d);
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        while self.next_cell().is_some() {}
        if (self.failed && !self.drained) || std::thread::panicking() {
            self.drain();
        }
    }
}

/// A cell's (offset, len) in the arena and the (job, from, to) arena byte ranges it holds.
type PlannedCell = ((usize, usize), Vec<(usize, usize, usize)>);

/// The cells of [0, total), in order.
fn plan(jobs: &[Job], total: usize, cell: usize) -> Vec<PlannedCell> {
    let mut cells = Vec::new();
    let mut j = 0;
    let mut start = 0;
    while start < total {
        let end = start.saturating_add(cell).min(total);
        let mut pieces = Vec::new();
        while j < jobs.len() && jobs[j].offset < end {
            let from = jobs[j].offset.max(start);
            let to = (jobs[j].offset + jobs[j].size).min(end);
            if from < to {
                pieces.push((j, from, to));
            }
            if jobs[j].offset + jobs[j].size > end {
                break; // continues in the next cell
            }
            j += 1;
        }
        cells.push(((start, end - start), pieces));
        start = end;
    }
    cells
}

fn issue_cell(
    driver: &dyn Driver,
    arena: &HostBuffer,
    jobs: &[Job],
    pieces: &[(usize, usize, usize)],
) -> Result<IssuedCell> {
    let mut devices: Vec<i32> = Vec::new();
    let mut ops = 0;
    let mut i = 0;
    while i < pieces.len() {
        let (j, from, mut to) = pieces[i];
        // Pieces of neighbouring jobs that continue each other on the device and in the arena: one copy.
        while let Some(&(next, next_from, next_to)) = pieces.get(i + 1) {
            if next != pieces[i].0 + 1 || !jobs[next].joins_previous || next_from != to {
                break;
            }
            to = next_to;
            i += 1;
        }
        i += 1;
        let job = jobs[j];
        ops += arena.queue_from_device(
            job.device,
            job.addr + (from - job.offset) as u64,
            from,
            to - from,
        )?;
        if !devices.contains(&job.device) {
            devices.push(job.device);
        }
    }
    let mut markers = Vec::with_capacity(devices.len());
    for d in devices {
        match driver.record_marker(d) {
            Ok(m) => markers.push((d, m)),
            Err(e) => {
                for (d, m) in markers {
                    let _ = driver.wait_marker(d, m);
                }
                return Err(e);
            }
        }
    }
    ops += markers.len();
    Ok(IssuedCell {
        markers,
        jobs: pieces.iter().map(|p| p.0).collect(),
        ops,
    })
}

/// Queue the device-to-host copies of every job into `arena`, pinning cells that are not pinned yet on worker
/// threads while the copies of ready cells run. Returns the issued cells (to wait for in issue order) and the
/// first error; after an error no further cell is issued, and the copy streams are drained at once.
/// Cells the driver would not pin are copied through pageable memory (correct, slower) and their errors are
/// pushed to `absorbed` (worker threads that could not start are noted in `arena.notes`).
pub fn issue_copy_out<'d>(
    driver: &'d dyn Driver,
    arena: &mut HostBuffer,
    jobs: &[Job],
    cell: usize,
    absorbed: &mut Vec<Error>,
) -> (InFlight<'d>, Result<()>) {
    let total = jobs.last().map_or(0, |j| j.offset + j.size);
    let cells = plan(jobs, total, cell);
    // Declared before anything is queued, so that a panic below still waits for what was (see `InFlight`).
    let mut issued = InFlight::new(driver, jobs);
    let mut result = Ok(());
    let (ready, cold): (Vec<_>, Vec<_>) = cells
        .into_iter()
        .partition(|((off, _), _)| arena.is_pinned_at(*off));
    for (_, pieces) in &ready {
        match issue_cell(driver, arena, jobs, pieces) {
            Ok(c) => issued.cells.push_back(c),
            Err(e) => {
                issued.failed = true;
                issued.drain();
                return (issued, Err(e));
            }
        }
    }
    let ranges: Vec<(usize, usize)> = cold.iter().map(|(range, _)| *range).collect();
    arena.pin_cells(&ranges, |arena, i, pinned| {
        if let Err(e) = pinned {
            absorbed.push(e);
        }
        if result.is_ok() {
            match issue_cell(driver, arena, jobs, &cold[i].1) {
                Ok(c) => issued.cells.push_back(c),
                Err(e) => result = Err(e),
            }
        }
    });
    if result.is_err() {
        issued.failed = true;
        issued.drain();
    }
    (issued, result)
}

/// Whether every cell of the jobs' layout lies in pinned memory of `arena` (a cached, steady arena). One
/// O(log pieces) lookup per cell start, the same starts as `plan`'s cells.
pub fn all_pinned(arena: &HostBuffer, jobs: &[Job], cell: usize) -> bool {
    let total = jobs.last().map_or(0, |j| j.offset + j.size);
    (0..total)
        .step_by(cell.max(1))
        .all(|off| arena.is_pinned_at(off))
}

/// Queue the device-to-host copies of every job into a wholly pinned `arena`, handing the oldest issued cell's
/// jobs (and the result of waiting for it) to `done` whenever more than MAX_QUEUED_OPS operations are queued, so
/// that releases run while the copies drain instead of after them. Returns the cells still in flight and the
/// first error; after an error no further cell is issued and every copy stream the jobs use was waited for.
pub fn issue_copy_out_pinned<'d>(
    driver: &'d dyn Driver,
    arena: &HostBuffer,
    jobs: &[Job],
    cell: usize,
    mut done: impl FnMut(Vec<usize>, Result<()>),
) -> (InFlight<'d>, Result<()>) {
    let total = jobs.last().map_or(0, |j| j.offset + j.size);
    let mut issued = InFlight::new(driver, jobs);
    let mut queued = 0;
    for (_, pieces) in plan(jobs, total, cell) {
        match issue_cell(driver, arena, jobs, &pieces) {
            Ok(c) => {
                queued += c.ops;
                issued.cells.push_back(c);
                while issued.cells.len() > 1 && queued > MAX_QUEUED_OPS {
                    queued -= issued.cells.front().map_or(0, |c| c.ops);
                    let (cell_jobs, waited) = issued.next_cell().expect("more than one cell");
                    done(cell_jobs, waited);
                }
            }
            Err(e) => {
                issued.failed = true;
                issued.drain();
                return (issued, Err(e));
            }
        }
    }
    (issued, Ok(()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::driver::sim::{SimConfig, SimDriver};

    #[test]
    fn plan_covers_every_byte_once_in_cell_order() {
        let (jobs, total) = layout([(0, 0x10000, 10), (1, 0x20000, 25), (0, 0x30000, 5)]);
        assert_eq!(total, 40);
        let cells = plan(&jobs, total, 8);
        assert_eq!(cells.len(), 5);
        let mut covered = vec![0u8; total];
        for ((start, len), pieces) in &cells {
            for &(j, from, to) in pieces {
                assert!(*start <= from && to <= start + len, "piece inside its cell");
                assert!(
                    jobs[j].offset <= from && to <= jobs[j].offset + jobs[j].size,
                    "piece inside its job"
                );
                covered[from..to].iter_mut().for_each(|c| *c += 1);
            }
        }
        assert!(covered.iter().all(|c| *c == 1), "{covered:?}");
    }

    fn calls(sim: &SimDriver, op: &str) -> u64 {
        sim.counts()
            .calls
            .iter()
            .find(|c| c.0 == op)
            .map_or(0, |c| c.1)
    }

    /// An arena pinned in page-sized cells (the smallest pin chunk accepted): a cold sleep's copies, the steady
    /// check, a steady sleep's copies and a wake's copies each make one copy per cell (CUDA allows no fewer: a copy
    /// may not span two registrations) and look at a bounded number of pinned pieces per cell, where a scan of the
    /// pieces per lookup would look at all of them (quadratic in the bytes).
    #[test]
    fn page_sized_cells_cost_a_bounded_lookup_per_copy() {
        let cell = rustix::param::page_size();
        let cells = 1024;
        let total = cells * cell;
        let sim = Arc::new(
            SimDriver::new(SimConfig {
                capacity: total,
                granularity: total,
                ..SimConfig::default()
            })
            .unwrap(),
        );
        let driver: Arc<dyn Driver> = sim.clone();
        let addr = driver.reserve(0, total).unwrap();
        let handle = driver.create(0, total).unwrap();
        driver.map(addr, total, handle).unwrap();
        driver.set_access(0, addr, total).unwrap();
        let data: Vec<u8> = (0..total).map(|i| (i / 7) as u8).collect();
        crate::driver::copy_from_slice(&*driver, 0, addr, &data).unwrap();
        // Four allocations of unequal sizes, so that jobs end inside cells.
        let sizes = [total / 8 + 100, total / 2 - 300, total / 4 + 200];
        let last = total - sizes.iter().sum::<usize>();
        let mut at = addr;
        let (mut jobs, laid_out) = layout(sizes.iter().chain([&last]).map(|&size| {
            at += size as u64;
            (0, at - size as u64, size)
        }));
        assert_eq!(laid_out, total);
        // One mapping: neighbours continue each other (as the engine finds for one reservation).
        jobs.iter_mut()
            .skip(1)
            .for_each(|j| j.joins_previous = true);

        let mut arena = HostBuffer::map_unpinned(&driver, total).unwrap();
        let mut absorbed = Vec::new();
        let (mut flight, r) = issue_copy_out(&*driver, &mut arena, &jobs, cell, &mut absorbed);
        r.unwrap();
        while let Some((_, waited)) = flight.next_cell() {
            waited.unwrap();
        }
        drop(flight);
        assert!(absorbed.is_empty(), "{absorbed:?}");
        assert_eq!(arena.unpinned_below(total), 0);
        assert_eq!(sim.counts().host_registered, cells);
        assert_eq!(
            calls(&sim, "copy_d2h"),
            cells as u64,
            "one copy per pinned cell"
        );

        assert!(all_pinned(&arena, &jobs, cell));
        let (flight, r) = issue_copy_out_pinned(&*driver, &arena, &jobs, cell, |_, w| w.unwrap());
        r.unwrap();
        drop(flight);
        assert_eq!(calls(&sim, "copy_d2h"), 2 * cells as u64);

        driver.memset_zero(0, addr, total).unwrap();
        let before = calls(&sim, "copy_h2d");
        arena.queue_to_device(0, addr, 0, total).unwrap();
        driver.wait(0).unwrap();
        assert_eq!(
            calls(&sim, "copy_h2d") - before,
            cells as u64,
            "a wake cut at every piece"
        );
        let mut back = vec![0u8; total];
        crate::driver::copy_to_slice(&*driver, 0, addr, &mut back).unwrap();
        assert!(back == data, "contents came back");

        // Four passes over `cells` cells; a scan per lookup would look at about 4 * cells^2 / 2 entries.
        let per_cell = arena.pieces_visited() as f64 / (4 * cells) as f64;
        assert!(
            per_cell <= 4.0,
            "{per_cell} pinned pieces looked at per cell"
        );

        arena.release().map_err(|(_, e)| e).unwrap();
        driver.unmap(addr, total).unwrap();
        driver.release(handle).unwrap();
        driver.free_range(addr, total).unwrap();
        assert_eq!(sim.counts().host_registered, 0);
    }
}
