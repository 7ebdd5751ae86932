//! The copies of a sleep: allocation contents laid out back to back in one host arena, walked in cells (the unit
//! of pinning and of completion tracking), each copy kept inside one pinned piece.
//!
//! A cell's copies are followed by a marker on every device they used; waiting for a cell's markers proves its
//! bytes are on the host, so the engine can release the allocations whose every byte is in finished cells while
//! later cells are still copying.

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

/// A cell's (offset, len) in the arena and the (job, from, to) arena byte ranges it holds.
type PlannedCell = ((usize, usize), Vec<(usize, usize, usize)>);

/// The cells of [0, total), in order.
fn plan(jobs: &[Job], total: usize, cell: usize) -> Vec<PlannedCell> {
    let mut cells = Vec::new();
    let mut j = 0;
    let mut start = 0;
    while start < total {
        let end = (start + cell).min(total);
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
    for &(j, from, to) in pieces {
        let job = jobs[j];
        for (off, len) in arena.split_at_pieces(from, to - from) {
            ops += 1;
            driver.copy_d2h(
                job.device,
                arena.at(off),
                job.addr + (off - job.offset) as u64,
                len,
            )?;
        }
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
/// threads while the copies of ready cells run. Returns the issued cells (in issue order) and the first error;
/// after an error no further cell is issued, but every issued cell is returned so its markers get waited for.
/// Cells the driver would not pin are copied through pageable memory (correct, slower) and their errors are
/// pushed to `absorbed`.
pub fn issue_copy_out(
    driver: &dyn Driver,
    arena: &mut HostBuffer,
    jobs: &[Job],
    cell: usize,
    absorbed: &mut Vec<Error>,
) -> (Vec<IssuedCell>, Result<()>) {
    let total = jobs.last().map_or(0, |j| j.offset + j.size);
    let cells = plan(jobs, total, cell);
    let mut issued = Vec::with_capacity(cells.len());
    let mut result = Ok(());
    let (ready, cold): (Vec<_>, Vec<_>) = cells
        .into_iter()
        .partition(|((off, _), _)| arena.is_pinned_at(*off));
    for (_, pieces) in &ready {
        match issue_cell(driver, arena, jobs, pieces) {
            Ok(c) => issued.push(c),
            Err(e) => {
                drain_streams(driver, jobs);
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
                Ok(c) => issued.push(c),
                Err(e) => result = Err(e),
            }
        }
    });
    if result.is_err() {
        drain_streams(driver, jobs);
    }
    (issued, result)
}

/// Whether every cell of the jobs' layout lies in pinned memory of `arena` (a cached, steady arena).
pub fn all_pinned(arena: &HostBuffer, jobs: &[Job], cell: usize) -> bool {
    let total = jobs.last().map_or(0, |j| j.offset + j.size);
    plan(jobs, total, cell)
        .iter()
        .all(|((off, _), _)| arena.is_pinned_at(*off))
}

/// Queue the device-to-host copies of every job into a wholly pinned `arena`, handing the oldest issued cell to
/// `drain` (which waits for it and releases what it completes) whenever more than MAX_QUEUED_OPS operations are
/// queued, so that releases run while the copies drain instead of after them. Returns the cells not drained yet
/// (in issue order) and the first error; after an error no further cell is issued and every copy stream the
/// jobs use was waited for.
pub fn issue_copy_out_pinned(
    driver: &dyn Driver,
    arena: &HostBuffer,
    jobs: &[Job],
    cell: usize,
    mut drain: impl FnMut(IssuedCell),
) -> (Vec<IssuedCell>, Result<()>) {
    let total = jobs.last().map_or(0, |j| j.offset + j.size);
    let mut pending: std::collections::VecDeque<IssuedCell> = std::collections::VecDeque::new();
    let mut queued = 0;
    for (_, pieces) in plan(jobs, total, cell) {
        match issue_cell(driver, arena, jobs, &pieces) {
            Ok(c) => {
                queued += c.ops;
                pending.push_back(c);
                while pending.len() > 1 && queued > MAX_QUEUED_OPS {
                    let oldest = pending.pop_front().expect("len > 1");
                    queued -= oldest.ops;
                    drain(oldest);
                }
            }
            Err(e) => {
                drain_streams(driver, jobs);
                return (pending.into(), Err(e));
            }
        }
    }
    (pending.into(), Ok(()))
}

/// After a failed issue, copies queued before the failure may have no marker behind them: wait for every copy
/// stream the jobs use, so none still writes into the arena when it is given back.
fn drain_streams(driver: &dyn Driver, jobs: &[Job]) {
    let mut devices: Vec<i32> = jobs.iter().map(|j| j.device).collect();
    devices.sort_unstable();
    devices.dedup();
    for d in devices {
        let _ = driver.wait(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
