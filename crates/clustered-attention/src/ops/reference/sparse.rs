//! Default bodies of [`ClusteredAttentionBackend::sparse_dot`],
//! [`ClusteredAttentionBackend::sparse_weighted_sum`] and
//! [`ClusteredAttentionBackend::sparse_scatter`].

use core::ops::Range;

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::tensor::{Bool, Int, Tensor};

use super::device_ints;
#[cfg(doc)]
use crate::ops::ClusteredAttentionBackend;
use crate::ops::TensorConversion;

/// The top-k indices of each query's cluster, `[batch, heads, L, k]` (padded queries read
/// cluster 0), and the `[batch, heads, L, 1]` mask of the padded queries; both index tensors in
/// the int type of their device's settings.
fn query_topk(
    topk: Tensor<4, Int>,
    assignments: Tensor<3, Int>,
) -> (Tensor<4, Int>, Tensor<4, Bool>) {
    let (topk, assignments) = (device_ints(topk), device_ints(assignments));
    let [batch, heads, len] = assignments.dims();
    let [_, _, _, k] = topk.dims();
    let padded = assignments.clone().lower_elem(0).unsqueeze_dim::<4>(3);
    let index = assignments
        .clamp_min(0)
        .unsqueeze_dim::<4>(3)
        .expand([batch, heads, len, k]);
    (topk.gather(2, index), padded)
}

/// Rows `index[b, h, i, r]` of `x[b, h]`: `[batch, heads, N, k, F]`.
fn gather_rows(x: Tensor<4>, index: Tensor<4, Int>) -> Tensor<5> {
    let [batch, heads, rows, features] = x.dims();
    let [_, _, n, k] = index.dims();
    let offsets =
        Tensor::<1, Int>::arange(0..(batch * heads) as i64, (&index.device(), index.dtype()))
            .mul_scalar(rows as i64)
            .reshape([batch, heads, 1, 1]);
    let flat_index = (index + offsets).reshape([batch * heads * n * k]);
    x.reshape([batch * heads * rows, features])
        .select(0, flat_index)
        .reshape([batch, heads, n, k, features])
}

/// Largest tensor a sparse product materialises at once, in bytes: the gathered rows are built
/// for a chunk of queries at a time. (Below WebGPU's guaranteed 128 MiB storage binding.)
const GATHER_BYTES: usize = 64 << 20;

/// Ranges of queries whose gathered `[batch, heads, chunk, k, features]` rows fit in
/// [`GATHER_BYTES`].
fn query_chunks(len: usize, rows: usize, k: usize, features: usize) -> Vec<Range<usize>> {
    query_chunks_within(GATHER_BYTES, len, rows, k, features)
}

fn query_chunks_within(
    budget: usize,
    len: usize,
    rows: usize,
    k: usize,
    features: usize,
) -> Vec<Range<usize>> {
    #[cfg(all(test, feature = "ndarray"))]
    let budget = tests::BUDGET.with(|b| b.get().unwrap_or(budget));
    let per_query = (rows * k * features * 4).max(1);
    let chunk = (budget / per_query).clamp(1, len.max(1));
    (0..len)
        .step_by(chunk)
        .map(|start| start..(start + chunk).min(len))
        .collect()
}

/// Default body of [`ClusteredAttentionBackend::sparse_dot`]:
/// gathers the `[batch, heads, chunk, k, E]` keys of a chunk of queries at a time.
pub fn sparse_dot<B: TensorConversion>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
) -> FloatTensor<B> {
    let (index, padded) = query_topk(B::int_tensor(topk), B::int_tensor(assignments));
    B::float_primitive(gathered_products(
        B::float_tensor(queries),
        B::float_tensor(keys),
        index,
        padded,
        Product::Dot,
    ))
}

/// Default body of
/// [`ClusteredAttentionBackend::sparse_weighted_sum`]:
/// gathers the `[batch, heads, chunk, k, D]` values of a chunk of queries at a time.
pub fn sparse_weighted_sum<B: TensorConversion>(
    weights: FloatTensor<B>,
    values: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
) -> FloatTensor<B> {
    let (index, padded) = query_topk(B::int_tensor(topk), B::int_tensor(assignments));
    B::float_primitive(gathered_products(
        B::float_tensor(weights),
        B::float_tensor(values),
        index,
        padded,
        Product::WeightedSum,
    ))
}

/// What [`gathered_products`] sums.
#[derive(Clone, Copy)]
enum Product {
    /// Each row times each of its `k` gathered rows, summed over the features: `[.., k]`.
    Dot,
    /// The gathered rows weighted by the row's `k` entries, summed over `k`: `[.., F]`.
    WeightedSum,
}

/// The products of each row `rows[b, h, i]` with the `k` rows `table[b, h, index[b, h, i, r]]`
/// (`table`: `[batch, heads, S, F]`), gathered for a chunk of queries at a time
/// ([`query_chunks`]); zero for the padded queries (`padded`: `[batch, heads, L, 1]`).
fn gathered_products(
    rows: Tensor<4>,
    table: Tensor<4>,
    index: Tensor<4, Int>,
    padded: Tensor<4, Bool>,
    product: Product,
) -> Tensor<4> {
    let [batch, heads, len, width] = rows.dims();
    let [_, _, _, k] = index.dims();
    let features = table.dims()[3];
    // The gathered rows are `[batch, heads, chunk, k, F]`: a row of features broadcast over
    // the `k` slots, or a row of `k` weights over the features.
    let (broadcast, summed) = match product {
        Product::Dot => (3, 4),
        Product::WeightedSum => (4, 3),
    };
    let parts = query_chunks(len, batch * heads, k, features)
        .into_iter()
        .map(|r| {
            let rows = rows
                .clone()
                .slice([0..batch, 0..heads, r.clone(), 0..width]);
            let index = index.clone().slice([0..batch, 0..heads, r, 0..k]);
            (rows.unsqueeze_dim::<5>(broadcast) * gather_rows(table.clone(), index))
                .sum_dim(summed)
                .squeeze_dim::<4>(summed)
        })
        .collect();
    let products = Tensor::cat(parts, 2);
    let shape = products.dims();
    products.mask_fill(padded.expand(shape), 0.0)
}

/// Default body of [`ClusteredAttentionBackend::sparse_scatter`]:
/// scatter-adds the `[batch, heads, chunk · k, F]` products `weights[i, r] · x[i]` of a chunk
/// of queries at a time into the key rows.
pub fn sparse_scatter<B: TensorConversion>(
    weights: FloatTensor<B>,
    x: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
    keys_len: usize,
) -> FloatTensor<B> {
    let (weights, x) = (B::float_tensor::<4>(weights), B::float_tensor::<4>(x));
    let [batch, heads, len, k] = weights.dims();
    let [_, _, _, features] = x.dims();
    let (index, padded) = query_topk(B::int_tensor(topk), B::int_tensor(assignments));
    // Padded rows may hold anything, even NaN: zero them (and their weights) before summing.
    let x = x.mask_fill(padded.clone().expand([batch, heads, len, features]), 0.0);
    let weights = weights.mask_fill(padded.expand([batch, heads, len, k]), 0.0);
    let mut out = Tensor::<4>::zeros([batch, heads, keys_len, features], (&x.device(), x.dtype()));
    for r in query_chunks(len, batch * heads, k, features) {
        let n = r.len();
        let weights = weights.clone().slice([0..batch, 0..heads, r.clone(), 0..k]);
        let x = x
            .clone()
            .slice([0..batch, 0..heads, r.clone(), 0..features]);
        let products = weights.unsqueeze_dim::<5>(4) * x.unsqueeze_dim::<5>(3); // [b, h, n, k, F]
        let index = index
            .clone()
            .slice([0..batch, 0..heads, r, 0..k])
            .unsqueeze_dim::<5>(4)
            .expand([batch, heads, n, k, features])
            .reshape([batch, heads, n * k, features]);
        out = out.scatter(
            2,
            index,
            products.reshape([batch, heads, n * k, features]),
            burn::tensor::IndexingUpdateOp::Add,
        );
    }
    B::float_primitive(out)
}

#[cfg(all(test, feature = "ndarray"))]
#[allow(deprecated)] // `NdArray`
mod tests {
    use std::cell::Cell;

    use burn::backend::NdArray;
    use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};

    use crate::ops::TensorConversion;

    thread_local! {
        /// Overrides [`super::GATHER_BYTES`] on this thread.
        pub(super) static BUDGET: Cell<Option<usize>> = const { Cell::new(None) };
    }

    type B = NdArray;

    /// The sparse products, with the gathered rows built for all queries at once and for
    /// chunks of 3 queries (a budget of 3 queries' rows), equal plain loops over their
    /// definitions (the trait's docs) in `f64`, to 1e-5.
    #[test]
    fn chunked_sparse_products_match_loops() {
        let device = Device::ndarray();
        let (batch, heads, len, keys_len, dim, clusters, k) = (2, 2, 10, 7, 5, 3, 4);
        let q = Tensor::<4>::random([batch, heads, len, dim], Distribution::Default, &device);
        let keys = Tensor::<4>::random(
            [batch, heads, keys_len, dim],
            Distribution::Default,
            &device,
        );
        let w = Tensor::<4>::random([batch, heads, len, k], Distribution::Default, &device);
        let top: Vec<i64> = (0..batch * heads * clusters * k)
            .map(|i| (i % keys_len) as i64)
            .collect();
        let top =
            Tensor::<4, Int>::from_data(TensorData::new(top, [batch, heads, clusters, k]), &device);
        let assign: Vec<i64> = (0..batch * heads * len)
            .map(|i| {
                if i % len == len - 1 {
                    -1
                } else {
                    (i % clusters) as i64
                }
            })
            .collect();
        let assign =
            Tensor::<3, Int>::from_data(TensorData::new(assign, [batch, heads, len]), &device);
        let run = |budget: Option<usize>| {
            BUDGET.with(|b| b.set(budget));
            let f = B::float_tensor::<4>;
            let p = |x: &Tensor<4>| B::float_primitive(x.clone());
            let (t, a) = (
                || B::int_primitive(top.clone()),
                || B::int_primitive(assign.clone()),
            );
            [
                f(super::sparse_dot::<B>(p(&q), p(&keys), t(), a())),
                f(super::sparse_weighted_sum::<B>(p(&w), p(&keys), t(), a())),
                f(super::sparse_scatter::<B>(p(&w), p(&q), t(), a(), keys_len)),
            ]
        };
        let whole = run(None);
        let chunked = run(Some(3 * batch * heads * k * dim * 4));
        BUDGET.with(|b| b.set(None));

        let floats =
            |x: &Tensor<4>| -> Vec<f64> { x.to_data().iter::<f32>().map(f64::from).collect() };
        let (qh, kh, wh) = (floats(&q), floats(&keys), floats(&w));
        let toph: Vec<i64> = top.to_data().iter::<i64>().collect();
        let ah: Vec<i64> = assign.to_data().iter::<i64>().collect();
        let mut dot = vec![0.0; batch * heads * len * k];
        let mut weighted = vec![0.0; batch * heads * len * dim];
        let mut scattered = vec![0.0; batch * heads * keys_len * dim];
        for bh in 0..batch * heads {
            for i in 0..len {
                let Ok(a) = usize::try_from(ah[bh * len + i]) else {
                    continue;
                };
                for r in 0..k {
                    let key = toph[(bh * clusters + a) * k + r] as usize;
                    let weight = wh[(bh * len + i) * k + r];
                    for e in 0..dim {
                        let (query, key_e) = (
                            qh[(bh * len + i) * dim + e],
                            kh[(bh * keys_len + key) * dim + e],
                        );
                        dot[(bh * len + i) * k + r] += query * key_e;
                        weighted[(bh * len + i) * dim + e] += weight * key_e;
                        scattered[(bh * keys_len + key) * dim + e] += weight * query;
                    }
                }
            }
        }
        for (name, results) in [("whole", whole), ("chunked", chunked)] {
            for ((op, result), expected) in ["sparse_dot", "sparse_weighted_sum", "sparse_scatter"]
                .iter()
                .zip(results)
                .zip([&dot, &weighted, &scattered])
            {
                let diff = floats(&result)
                    .iter()
                    .zip(expected.iter())
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f64::max);
                assert!(diff <= 1e-5, "{name} {op} differs from the loops by {diff}");
            }
        }
    }
}
