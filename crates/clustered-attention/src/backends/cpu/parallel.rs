//! Splitting the host ops' work over rayon's global thread pool, the one NdArray, Flex and
//! their matrix products use, so that no two pools compete for the cores.

use rayon::prelude::*;

/// How many tasks the `items` (cluster rows, queries) of each of `rows` `(batch, head)`s split
/// into, so that the pool's threads share the work of fewer `(batch, head)`s than threads:
/// tasks of `least` items or more, one with enough `(batch, head)`s.
pub(super) fn head_splits(rows: usize, items: usize, least: usize) -> usize {
    rayon::current_num_threads()
        .div_ceil(rows.max(1))
        .min(items.div_ceil(least))
        .max(1)
}

/// Below this many inner-loop steps an op runs on the calling thread.
pub(super) const PARALLEL_THRESHOLD: usize = 1 << 16;

/// Calls `f(row, chunk)` for each of the `rows` equal chunks of `out`, on rayon's global
/// thread pool (the one NdArray, Flex and their matrix products use, so that no two pools
/// compete for the cores) when `rows × cost_per_row` is large enough to pay for it.
pub(super) fn for_each_row<T: Send>(
    out: &mut [T],
    rows: usize,
    cost_per_row: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    if rows == 0 || out.is_empty() {
        return;
    }
    let row_len = out.len() / rows;
    if rows == 1 || rows * cost_per_row < PARALLEL_THRESHOLD {
        for (row, chunk) in out.chunks_mut(row_len).enumerate() {
            f(row, chunk);
        }
        return;
    }
    out.par_chunks_mut(row_len)
        .enumerate()
        .for_each(|(row, chunk)| f(row, chunk));
}

/// Rows of `width` of a buffer that several tasks write at once, each row by one task.
pub(super) struct DisjointRows<'a> {
    ptr: *mut f32,
    rows: usize,
    width: usize,
    _buffer: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: the rows are only reached through `row`, whose callers promise that no two threads
// reach one row.
unsafe impl Sync for DisjointRows<'_> {}

impl<'a> DisjointRows<'a> {
    pub(super) fn new(buffer: &'a mut [f32], width: usize) -> Self {
        Self {
            ptr: buffer.as_mut_ptr(),
            rows: buffer.len() / width,
            width,
            _buffer: std::marker::PhantomData,
        }
    }

    /// Row `i`.
    ///
    /// # Safety
    /// No other reference to row `i` may live while the returned one does.
    ///
    /// # Panics
    /// If `i` is not a row of the buffer.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn row(&self, i: usize) -> &mut [f32] {
        assert!(i < self.rows, "row {i} of {}", self.rows);
        // SAFETY: the row lies in the buffer, borrowed mutably for 'a; the caller promises
        // that nothing else reaches it meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i * self.width), self.width) }
    }
}
