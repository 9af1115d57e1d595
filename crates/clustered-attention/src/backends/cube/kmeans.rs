//! Lloyd's algorithm in Hamming space (paper §3.2.2).
//!
//! The definition is
//! [`ClusteredAttentionBackend::hamming_kmeans`](crate::ClusteredAttentionBackend); all arithmetic
//! is on integers, so every backend agrees bit for bit. Two forms:
//!
//! - up to [`LOOP_CLUSTERS`] (120) clusters, the whole loop in one launch
//!   ([`kmeans_loop_kernel`]; on lavapipe only while a thread's loop passes stay within
//!   llvmpipe's limit, [`loop_pass_limit`]): one cube per
//!   `(batch, head)` row keeps the row's centroids and votes in shared memory and runs every
//!   round, its threads striding over the queries;
//! - beyond, one launch per step: the assignment step gives each query its own thread; the
//!   update step tallies the members' bits with integer atomics, one thread per query, then
//!   gives each `(row, cluster)` a thread to take the majority.

use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::IntTensorOps;
use burn::tensor::{DType, Shape, read_sync};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros};
use burn_cubecl::ops::reshape;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::{cube_count, ints, linear};
use crate::ops::checks::{checked_lengths, known_lengths};
use crate::ops::initial_centroid_positions;

/// Largest number of clusters whose centroids the assignment step keeps in shared memory
/// (16 KiB, the smallest limit among the runtimes); beyond, it reads them from global memory.
pub(super) const SHARED_CENTROIDS: usize = 4096;

/// Votes per cluster: one per bit, then the member count.
const VOTES: usize = 33;

/// Largest number of clusters whose votes one cube tallies in shared memory (16 KiB of
/// `u32`, the smallest limit among the runtimes); beyond, the votes go to global memory.
pub(super) const SHARED_VOTES: usize = 4096 / VOTES;

/// Largest number of clusters whose Lloyd loop runs in one launch ([`kmeans_loop_kernel`]):
/// the row's votes and centroids (`34` words per cluster) within 16 KiB of shared memory.
pub(super) const LOOP_CLUSTERS: usize = 4096 / (VOTES + 1);

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
#[cube(launch, create_dummy_kernel)]
fn kmeans_assign_kernel<I: Int>(
    codes: &Tensor<I>,
    centroids: &Tensor<I>,
    lengths: &Tensor<I>,
    assignments: &mut Tensor<I>,
    #[comptime] clusters: usize,
    #[comptime] shared: bool,
    #[define(I)] _dtype: ElemType,
) {
    let len = codes.shape(1);
    let row = CUBE_POS_Z as usize;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let i = cube * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let n = u32::cast_from(lengths[row]) as usize;
    let base = row * clusters;

    let mut cache = Shared::<[u32]>::new_slice(comptime!(if shared { clusters } else { 1 }));
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

/// Per cluster, the votes of its members: `votes[row, c, b]` for `b < 32` counts the members
/// whose code sets bit `b`, `votes[row, c, 32]` counts the members. Each cube tallies its
/// chunk of queries in shared memory with integer atomics (when `shared`; otherwise straight
/// into global memory), then adds its tallies to `votes` with global atomics: `O(L)` work and
/// L-way parallelism per row. Integer sums do not depend on the order of the additions.
/// `votes` must be zero on entry (see [`kmeans_update_kernel`], which clears it).
///
/// Grid: X over chunks of `L` (one thread per query), Z over rows.
///
/// - `codes`, `assignments`: `[rows, L]`
/// - `votes`: `[rows, clusters * 33]`
#[cube(launch, create_dummy_kernel)]
fn kmeans_votes_kernel<I: Int>(
    codes: &Tensor<I>,
    assignments: &Tensor<I>,
    votes: &mut Tensor<Atomic<u32>>,
    #[comptime] clusters: usize,
    #[comptime] shared: bool,
    #[comptime] bits: bool,
    #[define(I)] _dtype: ElemType,
) {
    let len = codes.shape(1);
    let row = CUBE_POS_Z as usize;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let unit = UNIT_POS_X as usize;
    let threads = CUBE_DIM_X as usize;
    let i = cube * threads + unit;
    let size = comptime!(clusters * VOTES);
    let base = row * size;

    let tally = Shared::<[Atomic<u32>]>::new_slice(comptime!(if shared { size } else { 1 }));
    if shared {
        let mut at = unit;
        while at < size {
            tally[at].store(0u32);
            at += threads;
        }
        sync_cube();
    }

    if i < len {
        let cluster = i32::cast_from(assignments[row * len + i]);
        if cluster >= 0 {
            let first = (u32::cast_from(cluster) as usize) * VOTES;
            let code = u32::cast_from(codes[row * len + i]);
            if shared {
                tally[first + 32].fetch_add(1u32);
            } else {
                votes[base + first + 32].fetch_add(1u32);
            }
            if bits {
                for b in 0..32usize {
                    if (code >> u32::cast_from(b)) & 1u32 == 1u32 {
                        if shared {
                            tally[first + b].fetch_add(1u32);
                        } else {
                            votes[base + first + b].fetch_add(1u32);
                        }
                    }
                }
            }
        }
    }

    if shared {
        sync_cube();
        let mut at = unit;
        while at < size {
            let count = tally[at].load();
            if count > 0u32 {
                votes[base + at].fetch_add(count);
            }
            at += threads;
        }
    }
}

/// Update step and counts, one thread per `(row, cluster)`: reads the cluster's votes
/// ([`kmeans_votes_kernel`]), writes its member count and, when `update`, sets each centroid
/// bit to the majority of its members' bits, an exact tie (an empty cluster included) keeping
/// the previous bit. Clears the votes for the next round.
///
/// Grid: X over chunks of clusters, Z over rows.
///
/// - `votes`: `[rows, clusters * 33]`
/// - `lengths`: `[rows]`
/// - `centroids`, `counts`: `[rows, clusters]`
#[cube(launch, create_dummy_kernel)]
fn kmeans_update_kernel<I: Int>(
    votes: &mut Tensor<u32>,
    lengths: &Tensor<I>,
    centroids: &mut Tensor<I>,
    counts: &mut Tensor<I>,
    #[comptime] update: bool,
    #[define(I)] _dtype: ElemType,
) {
    let clusters = centroids.shape(1);
    let row = CUBE_POS_Z as usize;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let c = cube * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if c >= clusters {
        terminate!();
    }
    let n = u32::cast_from(lengths[row]) as usize;
    let first = (row * clusters + c) * VOTES;
    let count = votes[first + 32];
    counts[row * clusters + c] = I::cast_from(count);
    votes[first + 32] = 0u32;

    if update {
        // Rows with no more valid queries than clusters keep their (identity) clustering.
        let majority = n > clusters;
        let mut centroid = u32::cast_from(centroids[row * clusters + c]);
        for b in 0..32usize {
            let twice = 2u32 * votes[first + b];
            votes[first + b] = 0u32;
            let bit = 1u32 << u32::cast_from(b);
            if twice > count {
                centroid |= bit;
            } else if twice < count {
                centroid &= !bit;
            }
        }
        if majority {
            centroids[row * clusters + c] = I::cast_from(i32::reinterpret(centroid));
        }
    }
}

/// The whole Lloyd loop of one row per cube, from the initial centroids' positions to the
/// assignments and counts: `iterations` rounds of assignment and majority
/// update, then a last assignment and the member counts, with the same rules as
/// [`kmeans_assign_kernel`], [`kmeans_votes_kernel`] and [`kmeans_update_kernel`] (ties to the
/// lowest index, an exact tie of the votes keeps the bit, `-1` for padded queries, the
/// identity clustering for rows with no more valid queries than clusters). The row's centroids
/// and votes stay in shared memory (`clusters · 34` words, at most 16 KiB); each round is
/// separated from the next by cube barriers.
///
/// Grid: one cube per row (Z), its threads striding over `L`.
///
/// - `codes`, `assignments`: `[rows, L]`
/// - `positions`: `[rows · clusters]`, the queries whose codes are the initial centroids
/// - `counts`: `[rows, clusters]`
/// - `lengths`: `[rows]`
#[cube(launch, create_dummy_kernel)]
fn kmeans_loop_kernel<I: Int>(
    codes: &Tensor<I>,
    positions: &Tensor<I>,
    lengths: &Tensor<I>,
    assignments: &mut Tensor<I>,
    counts: &mut Tensor<I>,
    iterations: u32,
    #[comptime] clusters: usize,
    #[define(I)] _dtype: ElemType,
) {
    let len = codes.shape(1);
    let row = CUBE_POS_Z as usize;
    let unit = UNIT_POS_X as usize;
    let threads = CUBE_DIM_X as usize;
    let n = u32::cast_from(lengths[row]) as usize;
    let base = row * clusters;
    let identity = n <= clusters;
    let size = comptime!(clusters * VOTES);

    let mut cache = Shared::<[u32]>::new_slice(clusters);
    let tally = Shared::<[Atomic<u32>]>::new_slice(size);
    let mut c = unit;
    while c < clusters {
        let position = u32::cast_from(positions[base + c]) as usize;
        cache[c] = u32::cast_from(codes[row * len + position]);
        c += threads;
    }

    for round in 0..iterations + 1 {
        let last = round == iterations;
        let mut at = unit;
        while at < size {
            tally[at].store(0u32);
            at += threads;
        }
        sync_cube();

        let mut i = unit;
        while i < len {
            let mut assigned = i32::new(-1);
            if i < n {
                if identity {
                    assigned = i32::cast_from(i);
                } else {
                    let code = u32::cast_from(codes[row * len + i]);
                    let mut best = 33u32;
                    for c in 0..clusters {
                        let distance = (code ^ cache[c]).count_ones();
                        if distance < best {
                            best = distance;
                            assigned = i32::cast_from(c);
                        }
                    }
                }
            }
            if last {
                assignments[row * len + i] = I::cast_from(assigned);
            }
            if assigned >= 0 {
                let first = (u32::cast_from(assigned) as usize) * VOTES;
                tally[first + 32].fetch_add(1u32);
                if !last {
                    let code = u32::cast_from(codes[row * len + i]);
                    // Unrolled, so that it counts no loop pass (see `loop_kernel_passes`).
                    #[unroll]
                    for b in 0..32usize {
                        if (code >> u32::cast_from(b)) & 1u32 == 1u32 {
                            tally[first + b].fetch_add(1u32);
                        }
                    }
                }
            }
            i += threads;
        }
        sync_cube();

        let mut c = unit;
        while c < clusters {
            let first = c * VOTES;
            let count = tally[first + 32].load();
            if last {
                counts[base + c] = I::cast_from(count);
            } else if !identity {
                let mut centroid = cache[c];
                #[unroll]
                for b in 0..32usize {
                    let twice = 2u32 * tally[first + b].load();
                    let bit = 1u32 << u32::cast_from(b);
                    if twice > count {
                        centroid |= bit;
                    } else if twice < count {
                        centroid &= !bit;
                    }
                }
                cache[c] = centroid;
            }
            c += threads;
        }
        sync_cube();
    }
}

/// The lengths tensor `name` (`[batch]`) on the host, checked against its sequence's length
/// `seq_len`: `known` when the caller has its values there already ([`Lengths::Known`]),
/// otherwise read back from the device.
///
/// Returns one length per batch item (all `seq_len` when `None`).
///
/// # Panics
/// If the tensor is not `[batch]`, `known` does not hold one length per batch item, or a
/// length is outside `0..=seq_len`.
fn host_lengths(
    name: &str,
    lengths: Option<CubeTensor>,
    known: Option<&[usize]>,
    batch: usize,
    seq_len: usize,
) -> Vec<usize> {
    let dims = |lengths: &CubeTensor| lengths.shape().to_vec();
    let read = |lengths| match known {
        Some(known) => known_lengths(name, known, batch),
        None => {
            let data = read_sync(CubeBackend::int_into_data(lengths))
                .unwrap_or_else(|error| panic!("{name} could not be read: {error:?}"));
            data.iter::<i64>().collect()
        }
    };
    checked_lengths(name, lengths, batch, seq_len, dims, read)
}

/// Threads per cube of the K-means kernels.
const CUBE_THREADS: usize = 256;

/// The loop passes Mesa's llvmpipe lets one invocation run, over all its loops together
/// (`LP_MAX_TGSI_LOOP_ITERATIONS` in `lp_bld_limits.h`): once they are spent, every loop of the
/// invocation ends at its next pass, silently. llvmpipe runs the Vulkan device of a machine
/// without a GPU (lavapipe): at L = 16384, 100 clusters and 10 iterations, the one-launch loop
/// assigned each thread's first query alone in its last round and left the other 64,512
/// assignments of a `[4, 16384]` batch unwritten.
pub(super) const LLVMPIPE_LOOP_PASSES: usize = 65_535;

/// The loop passes one invocation of a kernel may run on the device `properties` describe:
/// [`LLVMPIPE_LOOP_PASSES`] on a WGPU adapter that is a CPU (no card behind it: lavapipe, the
/// only such Vulkan driver the crate runs on), no limit elsewhere (CUDA, WGPU on a GPU).
fn loop_pass_limit(properties: &DeviceProperties) -> Option<usize> {
    let identity = &properties.identity;
    (identity.physical.is_none() && identity.fingerprint.starts_with("spirv_"))
        .then_some(LLVMPIPE_LOOP_PASSES)
}

/// The loop passes of the thread of [`kmeans_loop_kernel`] that runs the most (the first, with
/// [`CUBE_THREADS`] threads a cube), counted as llvmpipe counts them: a loop of `n` iterations
/// takes `n + 1` passes, its exit included. Its loops: the initial centroids (its share of the
/// clusters), then the round loop (`iterations + 1` rounds) and in each round its share of the
/// votes to zero, of the queries (each one loop over the clusters) and of the clusters; the
/// loops over the 32 bits are unrolled and take none. Exact for a row with more valid queries
/// than clusters, and an upper bound for the others (an identity row or a padded query skips
/// the loop over the clusters); llvmpipe's SIMD lanes run as many passes as their busiest
/// lane, the first thread's, whose count this is.
pub(super) fn loop_kernel_passes(len: usize, clusters: usize, iterations: usize) -> usize {
    let share = |n: usize| n.div_ceil(CUBE_THREADS);
    // A loop of `n` iterations and the pass that exits it.
    let passes = |n: usize| n.saturating_add(1);
    let queries = passes(share(len)).saturating_add(share(len).saturating_mul(passes(clusters)));
    let round = passes(share(clusters * VOTES))
        .saturating_add(queries)
        .saturating_add(passes(share(clusters)));
    let rounds = iterations.saturating_add(1);
    passes(share(clusters))
        .saturating_add(passes(rounds))
        .saturating_add(rounds.saturating_mul(round))
}

/// The longest row (a multiple of [`CUBE_THREADS`]) whose one-launch loop stays within
/// [`LLVMPIPE_LOOP_PASSES`] at `clusters` clusters and `iterations` Lloyd iterations.
#[cfg(test)]
pub(super) fn longest_one_launch_row(clusters: usize, iterations: usize) -> usize {
    (1..)
        .map(|rows| rows * CUBE_THREADS)
        .take_while(|&len| loop_kernel_passes(len, clusters, iterations) <= LLVMPIPE_LOOP_PASSES)
        .last()
        .expect("a row within the limit")
}

/// How [`hamming_kmeans`] runs the Lloyd loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum KmeansPlan {
    /// The whole loop in one launch of [`kmeans_loop_kernel`], one cube a row.
    OneLaunch,
    /// A launch per step: [`kmeans_assign_kernel`] (the centroids in shared memory, or read
    /// from global memory), [`kmeans_votes_kernel`] (the votes tallied in shared memory, or in
    /// global memory) and [`kmeans_update_kernel`].
    Steps {
        shared_centroids: bool,
        shared_votes: bool,
    },
}

impl KmeansPlan {
    /// Every plan [`kmeans_plan`] can choose.
    #[cfg(test)]
    pub(super) const ALL: [KmeansPlan; 4] = [
        KmeansPlan::OneLaunch,
        KmeansPlan::Steps {
            shared_centroids: true,
            shared_votes: true,
        },
        KmeansPlan::Steps {
            shared_centroids: true,
            shared_votes: false,
        },
        KmeansPlan::Steps {
            shared_centroids: false,
            shared_votes: false,
        },
    ];
}

// The votes' shared memory holds fewer clusters than the centroids', so that a plan with shared
// votes and centroids in global memory does not exist and [`KmeansPlan::ALL`] is whole.
const _: () = assert!(SHARED_VOTES < SHARED_CENTROIDS);

/// The plan for rows of `len` queries, `clusters` clusters and `iterations` Lloyd iterations
/// on a device whose invocations may run at most `loop_limit` loop passes
/// ([`loop_pass_limit`]): one launch up to [`LOOP_CLUSTERS`] clusters, while
/// [`loop_kernel_passes`] stays within the limit; the step kernels otherwise.
pub(super) fn kmeans_plan(
    len: usize,
    clusters: usize,
    iterations: usize,
    loop_limit: Option<usize>,
) -> KmeansPlan {
    let within_limit =
        loop_limit.is_none_or(|limit| loop_kernel_passes(len, clusters, iterations) <= limit);
    if clusters <= LOOP_CLUSTERS && within_limit {
        KmeansPlan::OneLaunch
    } else {
        KmeansPlan::Steps {
            shared_centroids: clusters <= SHARED_CENTROIDS,
            shared_votes: clusters <= SHARED_VOTES,
        }
    }
}

/// The whole Lloyd loop on the device: the host only draws the initial centroid positions
/// (from the query lengths, `known` on the host or read back to draw them), then enqueues
/// one launch of the whole loop, or a gather of the initial centroids, `iterations`
/// assignment and update launches and a final assignment and count, as [`kmeans_plan`]
/// chooses for the device.
pub(super) fn hamming_kmeans(
    codes: CubeTensor,
    query_lengths: Option<CubeTensor>,
    known: Option<&[usize]>,
    clusters: usize,
    iterations: usize,
    seed: u64,
) -> (CubeTensor, CubeTensor) {
    let [_, _, len] = codes.shape().dims();
    let limit = loop_pass_limit(&super::device_properties(&codes.client));
    let plan = kmeans_plan(len, clusters, iterations, limit);
    hamming_kmeans_planned(
        codes,
        query_lengths,
        known,
        clusters,
        iterations,
        seed,
        plan,
    )
}

/// [`hamming_kmeans`] by `plan`, whatever the device's limits.
pub(super) fn hamming_kmeans_planned(
    codes: CubeTensor,
    query_lengths: Option<CubeTensor>,
    known: Option<&[usize]>,
    clusters: usize,
    iterations: usize,
    seed: u64,
    plan: KmeansPlan,
) -> (CubeTensor, CubeTensor) {
    assert!(clusters > 0, "clusters must be at least 1, got 0");
    let [batch, heads, len] = codes.shape().dims();
    let (client, device, dtype) = (codes.client.clone(), codes.device.clone(), codes.dtype);
    let lengths = host_lengths("query_lengths", query_lengths, known, batch, len);
    let rows = batch * heads;
    let initial = initial_centroid_positions(&lengths, heads, clusters, seed);
    let row_lengths: Vec<i64> = (0..rows).map(|r| lengths[r / heads] as i64).collect();

    let codes = reshape(into_contiguous(codes), Shape::new([rows, len]));
    let one_launch = plan == KmeansPlan::OneLaunch;
    // The initial centroids: the loop kernel reads the codes at these positions itself
    // (uploaded flat, so never pitched); the step kernels start from the gathered codes.
    let start = if one_launch {
        ints(initial, Shape::new([rows * clusters]), &device, dtype)
    } else {
        let positions = ints(initial, Shape::new([rows, clusters]), &device, dtype);
        CubeBackend::int_gather(1, codes.clone(), positions)
    };
    let start = into_contiguous(start);
    let codes = into_contiguous(codes);
    let row_lengths = ints(row_lengths, Shape::new([rows]), &device, dtype);
    let assignments = empty_device_contiguous_dtype(
        client.clone(),
        device.clone(),
        Shape::new([rows, len]),
        dtype,
    );
    let counts = empty_device_contiguous_dtype(
        client.clone(),
        device.clone(),
        Shape::new([rows, clusters]),
        dtype,
    );

    let reshape = |x: CubeTensor, last: usize| reshape(x, Shape::new([batch, heads, last]));
    if one_launch {
        launch!(kmeans_loop_kernel(
            &client,
            cube_count(1, rows),
            CubeDim::new_1d(CUBE_THREADS as u32),
            linear(codes.clone()),
            linear(start),
            linear(row_lengths.clone()),
            linear(assignments.clone()),
            linear(counts.clone()),
            u32::try_from(iterations)
                .ok()
                .filter(|&i| i < u32::MAX)
                .expect("iterations must be below 2^32 - 1"),
            clusters,
            dtype_to_storage_type(dtype),
        ));
        return (reshape(assignments, len), reshape(counts, clusters));
    }
    let centroids = start;

    // Burn's `zeros` may pitch its rows (CUDA does); the kernels index `votes` linearly.
    let votes = into_contiguous(zeros(
        device.clone(),
        Shape::new([rows, clusters * VOTES]),
        DType::U32,
    ));

    let KmeansPlan::Steps {
        shared_centroids,
        shared_votes,
    } = plan
    else {
        unreachable!("the one-launch plan returned above")
    };
    let assign = || {
        launch!(kmeans_assign_kernel(
            &client,
            cube_count(len.div_ceil(CUBE_THREADS), rows),
            CubeDim::new_1d(CUBE_THREADS as u32),
            linear(codes.clone()),
            linear(centroids.clone()),
            linear(row_lengths.clone()),
            linear(assignments.clone()),
            clusters,
            shared_centroids,
            dtype_to_storage_type(dtype),
        ))
    };
    let update = |update: bool| {
        launch!(kmeans_votes_kernel(
            &client,
            cube_count(len.div_ceil(CUBE_THREADS), rows),
            CubeDim::new_1d(CUBE_THREADS as u32),
            linear(codes.clone()),
            linear(assignments.clone()),
            linear(votes.clone()),
            clusters,
            shared_votes,
            update,
            dtype_to_storage_type(dtype),
        ));
        launch!(kmeans_update_kernel(
            &client,
            cube_count(clusters.div_ceil(CUBE_THREADS), rows),
            CubeDim::new_1d(CUBE_THREADS.min(clusters.next_power_of_two()) as u32),
            linear(votes.clone()),
            linear(row_lengths.clone()),
            linear(centroids.clone()),
            linear(counts.clone()),
            update,
            dtype_to_storage_type(dtype),
        ))
    };
    for _ in 0..iterations {
        assign();
        update(true);
    }
    assign();
    update(false);

    (reshape(assignments, len), reshape(counts, clusters))
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::backend::ops::IntTensorOps;
    use burn::tensor::{Device, Int, Tensor, TensorData, read_sync};
    use burn_cubecl::{CubeBackend, CubeDevice};
    use rand::rngs::Xoshiro256PlusPlus;
    use rand::{RngExt, SeedableRng};

    use super::*;

    /// `[1, 1, len]` codes, assignments and counts of K-means run by `plan` on `device`, and the
    /// same from Flex's host loop (the reference).
    fn run(
        device: &CubeDevice,
        len: usize,
        clusters: usize,
        iterations: usize,
        plan: KmeansPlan,
    ) -> [(Vec<i64>, Vec<i64>); 2] {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(len as u64);
        let codes: Vec<i32> = (0..len).map(|_| rng.random::<u32>() as i32).collect();
        let read = |tensor| -> Vec<i64> {
            read_sync(CubeBackend::int_into_data(tensor))
                .expect("the kernel's output reads back")
                .iter::<i64>()
                .collect()
        };
        let data = || TensorData::new(codes.clone(), [1, 1, len]);
        let (assignments, counts) = hamming_kmeans_planned(
            CubeBackend::int_from_data(data(), device),
            None,
            None,
            clusters,
            iterations,
            7,
            plan,
        );
        let kernel = (read(assignments), read(counts));
        let flex = Device::flex();
        let reference = crate::ops::hamming_kmeans(
            Tensor::<3, Int>::from_data(data(), &flex),
            None,
            clusters,
            iterations,
            7,
        );
        let host = |tensor: Tensor<3, Int>| tensor.into_data().iter::<i64>().collect();
        [
            kernel,
            (host(reference.assignments), host(reference.counts)),
        ]
    }

    /// Given the query lengths' values on the host (`known`, as [`Lengths::Known`] carries
    /// them), the K-means takes those instead of reading the tensor: with the same values it
    /// gives what it gives reading them, and with other values (the tensor left as it was)
    /// it gives what those lengths read from a tensor give.
    ///
    /// [`Lengths::Known`]: crate::ops::Lengths::Known
    #[test]
    fn known_lengths_are_taken_instead_of_read() {
        let device = CubeDevice::Wgpu(Default::default());
        let ([batch, heads, len], clusters) = ([2, 2, 300], 12);
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(3);
        let codes: Vec<i32> = (0..batch * heads * len)
            .map(|_| rng.random::<u32>() as i32)
            .collect();
        let read = |tensor| -> Vec<i64> {
            read_sync(CubeBackend::int_into_data(tensor))
                .expect("the kernel's output reads back")
                .iter::<i64>()
                .collect()
        };
        let run = |lengths: [i64; 2], known: Option<&[usize]>| {
            let codes = TensorData::new(codes.clone(), [batch, heads, len]);
            let lengths = TensorData::new(lengths.to_vec(), [batch]);
            let (assignments, counts) = hamming_kmeans(
                CubeBackend::int_from_data(codes, &device),
                Some(CubeBackend::int_from_data(lengths, &device)),
                known,
                clusters,
                5,
                7,
            );
            (read(assignments), read(counts))
        };
        let read_back = run([300, 200], None);
        assert_eq!(run([300, 200], Some(&[300, 200])), read_back);
        let other = run([300, 150], None);
        assert_ne!(
            other, read_back,
            "lengths 200 and 150 should cluster differently"
        );
        assert_eq!(run([300, 200], Some(&[300, 150])), other);
    }

    /// [`loop_kernel_passes`] is what llvmpipe counts: for two (clusters, iterations) pairs, the
    /// one-launch kernel reproduces Flex's K-means at the longest row the count admits within
    /// [`LLVMPIPE_LOOP_PASSES`], and on lavapipe fails one query past it (its first thread has
    /// one more query, and llvmpipe ends its loops early); `hamming_kmeans` takes the step
    /// kernels there and reproduces it. The pairs are those where one pass left out of the
    /// count for every query (as the loop over the clusters' exit pass) would admit the longer
    /// row; on a device without the limit, both rows must match.
    #[test]
    fn loop_pass_count_bounds_lavapipe() {
        let device = CubeDevice::Wgpu(Default::default());
        let limit = loop_pass_limit(&device.client().properties_shared());
        for (clusters, iterations) in [(100, 13), (80, 16)] {
            let longest = longest_one_launch_row(clusters, iterations);
            let past = longest + 1;
            let context = format!("C {clusters}, {iterations} iterations");
            let [kernel, reference] = run(
                &device,
                longest,
                clusters,
                iterations,
                KmeansPlan::OneLaunch,
            );
            assert!(
                kernel == reference,
                "one launch at L = {longest} ({} passes), {context}: differs from the reference",
                loop_kernel_passes(longest, clusters, iterations)
            );
            let [kernel, reference] =
                run(&device, past, clusters, iterations, KmeansPlan::OneLaunch);
            let passes = loop_kernel_passes(past, clusters, iterations);
            assert_eq!(
                kernel != reference,
                limit.is_some(),
                "one launch at L = {past} ({passes} passes), {context}, loop limit {limit:?}: \
                 the output should differ from the reference exactly where llvmpipe's limit \
                 applies"
            );
            if limit.is_some() {
                assert_ne!(
                    kmeans_plan(past, clusters, iterations, limit),
                    KmeansPlan::OneLaunch
                );
            }
            assert_eq!(
                kmeans_plan(longest, clusters, iterations, limit),
                KmeansPlan::OneLaunch
            );
            let plan = kmeans_plan(past, clusters, iterations, limit);
            let [kernel, reference] = run(&device, past, clusters, iterations, plan);
            assert!(
                kernel == reference,
                "{plan:?} at L = {past}, {context}: differs from the reference"
            );
        }
    }
}
