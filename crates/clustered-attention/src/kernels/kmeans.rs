//! Lloyd's algorithm in Hamming space (paper §3.2.2), one launch per step.
//!
//! The definition is [`ClusteringBackend::hamming_kmeans`](crate::ClusteringBackend); all
//! arithmetic is on integers, so every backend agrees bit for bit. No step uses atomics: the
//! assignment step gives each query its own thread, the update step each `(row, cluster)`.

use cubecl::prelude::*;

/// Largest number of clusters whose centroids the assignment step keeps in shared memory
/// (16 KiB, the smallest limit among the runtimes); beyond, it reads them from global memory.
pub(crate) const SHARED_CENTROIDS: usize = 4096;

/// Assignment step: `assignments[row, i]` = the nearest centroid of query `i` in Hamming
/// distance, ties to the lowest index; `-1` for padded queries (`i ≥ lengths[row]`); `i`
/// itself when the row has no more valid queries than clusters.
///
/// Grid: X over chunks of `L` (one thread per query), Z over rows. Each cube first copies its
/// row's centroids into shared memory (when `shared`).
///
/// - `codes`, `assignments`: `[rows, L]`
/// - `centroids`: `[rows, clusters]`
/// - `lengths`: `[rows]`
#[cube(launch)]
pub(crate) fn kmeans_assign_kernel<I: Int>(
    codes: &Tensor<I>,
    centroids: &Tensor<I>,
    lengths: &Tensor<I>,
    assignments: &mut Tensor<I>,
    #[comptime] clusters: usize,
    #[comptime] shared: bool,
    #[define(I)] _dtype: StorageType,
) {
    let len = codes.shape(1);
    let row = CUBE_POS_Z as usize;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let i = cube * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let n = u32::cast_from(lengths[row]) as usize;
    let base = row * clusters;

    let mut cache = SharedMemory::<u32>::new(if shared { clusters } else { 1 });
    if shared {
        let mut c = UNIT_POS_X as usize;
        while c < clusters {
            cache[c] = u32::cast_from(centroids[base + c]);
            c += CUBE_DIM_X as usize;
        }
        sync_cube();
    }

    if i < len {
        let mut assigned = i32::new(-1);
        if i < n {
            if n <= clusters {
                assigned = i32::cast_from(i);
            } else {
                let code = u32::cast_from(codes[row * len + i]);
                let mut best = 33u32;
                let count = centroids.shape(1);
                for c in 0..count {
                    let centroid = if shared {
                        cache[c]
                    } else {
                        u32::cast_from(centroids[base + c])
                    };
                    let distance = (code ^ centroid).count_ones();
                    if distance < best {
                        best = distance;
                        assigned = i32::cast_from(c);
                    }
                }
            }
        }
        assignments[row * len + i] = I::cast_from(assigned);
    }
}

/// Update step and counts: one thread per `(row, cluster)` scans the row's valid queries
/// (all threads of a warp read the same query: broadcast loads), counts its members and, per
/// bit, the members that set it. When `update`, the centroid becomes the bitwise majority,
/// an exact tie (an empty cluster included) keeping the previous bit.
///
/// Grid: X over chunks of clusters, Z over rows.
///
/// - `codes`, `assignments`: `[rows, L]`
/// - `lengths`: `[rows]`
/// - `centroids`, `counts`: `[rows, clusters]`
#[cube(launch)]
pub(crate) fn kmeans_update_kernel<I: Int>(
    codes: &Tensor<I>,
    assignments: &Tensor<I>,
    lengths: &Tensor<I>,
    centroids: &mut Tensor<I>,
    counts: &mut Tensor<I>,
    #[comptime] update: bool,
    #[define(I)] _dtype: StorageType,
) {
    let len = codes.shape(1);
    let clusters = centroids.shape(1);
    let row = CUBE_POS_Z as usize;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let c = cube * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if c >= clusters {
        terminate!();
    }
    let n = u32::cast_from(lengths[row]) as usize;

    let mut ones = Array::<u32>::new(32usize);
    for b in 0..32usize {
        ones[b] = 0u32;
    }
    let mut count = 0u32;
    let target = i32::cast_from(c);
    for i in 0..n {
        if i32::cast_from(assignments[row * len + i]) == target {
            count += 1u32;
            if update {
                let code = u32::cast_from(codes[row * len + i]);
                for b in 0..32usize {
                    ones[b] += (code >> u32::cast_from(b)) & 1u32;
                }
            }
        }
    }
    counts[row * clusters + c] = I::cast_from(count);

    if update && n > clusters {
        let mut centroid = u32::cast_from(centroids[row * clusters + c]);
        for b in 0..32usize {
            let twice = 2u32 * ones[b];
            let bit = 1u32 << u32::cast_from(b);
            if twice > count {
                centroid |= bit;
            } else if twice < count {
                centroid &= !bit;
            }
        }
        centroids[row * clusters + c] = I::cast_from(i32::reinterpret(centroid));
    }
}
