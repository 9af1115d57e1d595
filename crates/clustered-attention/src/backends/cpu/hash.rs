//! Host [`lsh_hash`]: the projections of four queries on all planes at a time.

use burn::backend::TensorMetadata;
use burn::backend::tensor::{FloatTensor, IntTensor};

use super::access::{HostAccess, dims, on_host, write_ints};
use super::parallel::for_each_row;
use super::simd;
use crate::ops::checks::check_planes;
use crate::ops::{ClusteredAttentionBackend, reference};

/// Host [`ClusteredAttentionBackend::lsh_hash`](ClusteredAttentionBackend::lsh_hash): the
/// projections of four queries on all planes at a time, compared and packed in registers.
pub fn lsh_hash<B: HostAccess + ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    planes: FloatTensor<B>,
) -> IntTensor<B> {
    if !on_host::<B>(&queries) || !on_host::<B>(&planes) {
        return reference::lsh_hash::<B>(queries, planes);
    }
    let device = queries.device();
    let [batch, heads, len, dim] = dims::<B, 4>(&queries);
    let [bits, columns] = dims::<B, 2>(&planes);
    check_planes([batch, heads, len, dim], [bits, columns]);
    // Planes transposed, `[E, 32]`; unused bits get zero normals and an infinite threshold.
    let mut normals = vec![0f32; dim * 32];
    let mut thresholds = [f32::INFINITY; 32];
    B::with_f32(&planes, |planes| {
        for (b, plane) in planes.chunks_exact(dim + 1).enumerate() {
            for (e, &v) in plane[..dim].iter().enumerate() {
                normals[e * 32 + b] = v;
            }
            thresholds[b] = plane[dim];
        }
    });
    let mut codes = vec![0u32; batch * heads * len];
    B::with_f32(&queries, |queries| {
        for_each_row(&mut codes, batch * heads, len * dim * 32, |row, out| {
            let queries = &queries[row * len * dim..(row + 1) * len * dim];
            simd::hash_rows(queries, dim, &normals, &thresholds, out);
        })
    });
    let codes = codes.into_iter().map(|c| i64::from(c as i32)).collect();
    write_ints::<B, 3>(codes, [batch, heads, len], &device)
}
