//! The top-k selection, the attention softmax and the sparse products: the backends'
//! implementations (host loops on NdArray and Flex, kernels on WGPU and CUDA, custom backward
//! under Autodiff) against the default bodies and against plain loops; and `sparse_tests!`,
//! which runs these and the fused ops' tests (`fused.rs`) on every backend.

use burn::backend::Autodiff;
use burn::tensor::{Device, Int, Tensor, TensorData};
use clustered_attention::ops::{
    ClusteredAttentionBackend, ClusteredAttentionBackward, attention_softmax, sparse_dot,
    sparse_scatter, sparse_weighted_sum, topk_indices,
};
use rand::RngExt;

use crate::common::*;
use crate::defaults;

pub const TOLERANCE: f32 = 1e-5;

/// Random top-k sets (distinct keys per cluster) and assignments with padded queries.
pub struct Indices {
    pub topk: Vec<i64>,
    pub topk_dims: [usize; 4],
    pub assignments: Vec<i64>,
    pub assignment_dims: [usize; 3],
}

pub fn indices(
    batch: usize,
    heads: usize,
    len: usize,
    keys_len: usize,
    clusters: usize,
    k: usize,
    seed: u64,
) -> Indices {
    let mut rng = rng(seed);
    let mut topk = Vec::new();
    for _ in 0..batch * heads * clusters {
        let picked = rand::seq::index::sample(&mut rng, keys_len, k);
        topk.extend(picked.iter().map(|p| p as i64));
    }
    let assignments = (0..batch * heads * len)
        .map(|i| {
            let position = i % len;
            if position >= len - 3 && (i / len) % 2 == 1 {
                -1 // padded tail in every other row
            } else {
                rng.random_range(0..clusters as i64)
            }
        })
        .collect();
    Indices {
        topk,
        topk_dims: [batch, heads, clusters, k],
        assignments,
        assignment_dims: [batch, heads, len],
    }
}

impl Indices {
    /// The top-k sets and the assignments on `device`, in its int dtype.
    pub fn tensors(&self, device: &Device) -> (Tensor<4, Int>, Tensor<3, Int>) {
        (
            Tensor::from_data(TensorData::new(self.topk.clone(), self.topk_dims), device),
            Tensor::from_data(
                TensorData::new(self.assignments.clone(), self.assignment_dims),
                device,
            ),
        )
    }
}

pub fn max_diff(a: Tensor<4>, b: Tensor<4>) -> f32 {
    let a: Vec<f32> = a.into_data().iter::<f32>().collect();
    let b: Vec<f32> = b.into_data().iter::<f32>().collect();
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The backend's sparse products equal the default bodies, and `sparse_dot` equals plain loops:
/// a small case, and one whose queries span several cubes of the GPU kernels (256 queries).
/// A third case has widths across the 16-lane blocks of the host kernels (k = 33, E = 70,
/// cluster sizes not multiples of 4); its tolerance is scaled for 70-term sums of products of
/// unit normals (|q · k| up to about 30, f32 rounding about 2⁻²⁴ per term). `X` is the
/// backend of `device`.
fn sparse_products_match_reference<X: ClusteredAttentionBackend>(device: &Device) {
    check_sparse_products::<X>(device, (2, 3, 37, 29, 10, 5, 6), TOLERANCE);
    check_sparse_products::<X>(device, (1, 2, 700, 300, 8, 7, 5), TOLERANCE);
    check_sparse_products::<X>(device, (1, 2, 301, 90, 70, 6, 33), 1e-4);
    // Clusters of about 500 queries, which the host scatter takes in runs (a key's scattered
    // sum has 500 terms and a size of about 50: 1e-4).
    check_sparse_products::<X>(device, (1, 1, 1500, 200, 8, 3, 5), 1e-4);
    // One key per cluster (the centroids' sums and clustered attention's broadcast), keys
    // shared between clusters, rows wider than a vector block (70-term dot products: 1e-4).
    check_sparse_products::<X>(device, (2, 3, 150, 12, 70, 40, 1), 1e-4);
}

fn check_sparse_products<X: ClusteredAttentionBackend>(
    device: &Device,
    (batch, heads, len, keys_len, dim, clusters, k): (
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
    ),
    tolerance: f32,
) {
    let ix = indices(batch, heads, len, keys_len, clusters, k, 61);
    let queries = normal([batch, heads, len, dim], 62);
    let keys = normal([batch, heads, keys_len, dim], 63);
    let weights = normal([batch, heads, len, k], 64);
    let (q, kt) = (queries.to_tensor(device), keys.to_tensor(device));
    let w = weights.to_tensor(device);
    let (topk, assignments) = ix.tensors(device);

    let dots = sparse_dot(q.clone(), kt.clone(), topk.clone(), assignments.clone());
    let expected =
        defaults::sparse_dot::<X>(q.clone(), kt.clone(), topk.clone(), assignments.clone());
    let diff = max_diff(dots.clone(), expected);
    assert!(diff <= tolerance, "sparse_dot vs default body: {diff}");
    let dots = Host4::from_tensor(dots);
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..len {
                let a = ix.assignments[(b * heads + h) * len + i];
                for r in 0..k {
                    let expected = if a < 0 {
                        0.0
                    } else {
                        let key =
                            ix.topk[((b * heads + h) * clusters + a as usize) * k + r] as usize;
                        (0..dim)
                            .map(|e| queries.at(b, h, i, e) * keys.at(b, h, key, e))
                            .sum()
                    };
                    assert!((dots.at(b, h, i, r) - expected).abs() <= tolerance as f64);
                }
            }
        }
    }

    let sums = sparse_weighted_sum(w.clone(), kt.clone(), topk.clone(), assignments.clone());
    let expected = defaults::sparse_weighted_sum::<X>(
        w.clone(),
        kt.clone(),
        topk.clone(),
        assignments.clone(),
    );
    let diff = max_diff(sums, expected);
    assert!(
        diff <= tolerance,
        "sparse_weighted_sum vs default body: {diff}"
    );

    let scattered = sparse_scatter(
        w.clone(),
        q.clone(),
        topk.clone(),
        assignments.clone(),
        keys_len,
    );
    let expected = defaults::sparse_scatter::<X>(w, q, topk, assignments, keys_len);
    let diff = max_diff(scattered, expected);
    assert!(diff <= tolerance, "sparse_scatter vs default body: {diff}");
}

/// The backend's top-k equals a sort (no ties in random data); among ties it takes the
/// lowest index (host loops, CubeCL kernel), and k = S returns every index. `X` is the backend
/// of `device`.
fn topk_matches_sort<X: ClusteredAttentionBackend>(device: &Device) {
    let scores = normal([2, 2, 7, 40], 71);
    let t = scores.to_tensor(device);
    for k in [1, 5, 40] {
        let ours = host_ints(topk_indices(t.clone(), k));
        for row in 0..2 * 2 * 7 {
            let values = &scores.data[row * 40..(row + 1) * 40];
            let mut order: Vec<usize> = (0..40).collect();
            order.sort_by(|&a, &b| values[b].total_cmp(&values[a]));
            let expected: Vec<i64> = order[..k].iter().map(|&i| i as i64).collect();
            assert_eq!(
                ours[row * k..(row + 1) * k],
                expected[..],
                "k {k}, row {row}"
            );
        }
        let reference = host_ints(defaults::topk_indices::<X>(t.clone(), k));
        assert_eq!(ours, reference, "k {k}: backend vs default body");
    }
    let ties = Tensor::<4>::from_data(
        TensorData::new(
            vec![1.0f32, 3.0, 3.0, 2.0, 3.0, f32::NEG_INFINITY],
            [1, 1, 1, 6],
        ),
        device,
    );
    assert_eq!(host_ints(topk_indices(ties, 3)), vec![1, 2, 4]);
    // Long rows with many ties (scores rounded to 16 levels), across the units of a GPU
    // kernel: by score, descending, then by index.
    let long = normal([1, 1, 3, 5000], 72);
    let rounded: Vec<f32> = long.data.iter().map(|x| (x * 4.0).round() / 4.0).collect();
    let t = Tensor::<4>::from_data(TensorData::new(rounded.clone(), [1, 1, 3, 5000]), device);
    for k in [1, 32, 100] {
        let ours = host_ints(topk_indices(t.clone(), k));
        for row in 0..3 {
            let values = &rounded[row * 5000..(row + 1) * 5000];
            let mut order: Vec<usize> = (0..5000).collect();
            order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
            let expected: Vec<i64> = order[..k].iter().map(|&i| i as i64).collect();
            assert_eq!(
                ours[row * k..(row + 1) * k],
                expected[..],
                "ties: k {k}, row {row}"
            );
        }
    }
    // A tie at the boundary of the top-k keeps the earliest index.
    let boundary = Tensor::<4>::from_data(
        TensorData::new(vec![3.0f32, 1.0, 1.0, 1.0], [1, 1, 1, 4]),
        device,
    );
    assert_eq!(host_ints(topk_indices(boundary, 2)), vec![0, 1]);
}

/// The backend's attention softmax against an f64 softmax: random rows of several widths
/// (below, at and across the 16-lane blocks), rows with large scores and `−∞` (masked keys,
/// exactly 0), and scores spanning more than the f32 exponent range below the maximum.
fn attention_softmax_matches_reference(device: &Device) {
    for (width, seed) in [(1, 81), (7, 82), (16, 83), (37, 84), (300, 85)] {
        let mut x = normal([2, 3, 5, width], seed);
        for (n, v) in x.data.iter_mut().enumerate() {
            match n % 11 {
                3 if width > 1 => *v = f32::NEG_INFINITY,
                5 => *v *= 60.0,
                7 => *v -= 200.0,
                _ => {}
            }
        }
        let ours = Host4::from_tensor(attention_softmax(x.to_tensor(device)));
        for (row, values) in x.data.chunks(width).enumerate() {
            let max = values
                .iter()
                .fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let exps: Vec<f64> = values.iter().map(|&v| (v as f64 - max).exp()).collect();
            let sum: f64 = exps.iter().sum();
            for (c, (&v, e)) in values.iter().zip(&exps).enumerate() {
                let got = ours.data[row * width + c] as f64;
                let expected = e / sum;
                if v == f32::NEG_INFINITY {
                    assert_eq!(got, 0.0, "width {width}, row {row}, column {c}: masked");
                }
                assert!(
                    (got - expected).abs() <= 2e-6 * expected.max(1e-3),
                    "width {width}, row {row}, column {c}: {got} vs {expected}"
                );
            }
        }
    }
}

/// Under Autodiff, the custom backward of the sparse products (made of the inner backend's
/// sparse products) equals autodiff through the default bodies. `X` is the backend of `device`;
/// the ops run on its autodiff form, the default bodies as `Autodiff<X>`'s.
fn sparse_gradients_match_reference<X>(device: &Device)
where
    X: ClusteredAttentionBackward,
    Autodiff<X>: ClusteredAttentionBackend,
{
    let device = &autodiff(device);
    let (batch, heads, len, keys_len, dim, clusters, k) = (2, 2, 23, 17, 6, 4, 5);
    let ix = indices(batch, heads, len, keys_len, clusters, k, 81);
    let x = normal([batch, heads, len, dim], 82);
    let y = normal([batch, heads, keys_len, dim], 83);
    let w = normal([batch, heads, len, k], 84);
    let (topk, assignments) = ix.tensors(device);
    let outer_dot = normal([batch, heads, len, k], 85).to_tensor(device);
    let outer_sum = normal([batch, heads, len, dim], 86).to_tensor(device);
    let outer_scatter = normal([batch, heads, keys_len, dim], 87).to_tensor(device);

    type Op = fn(Tensor<4>, Tensor<4>, Tensor<4, Int>, Tensor<3, Int>) -> Tensor<4>;
    type Case<'a> = (&'a str, &'a Host4, &'a Host4, Op, Op, &'a Tensor<4>);
    let cases: [Case; 3] = [
        (
            "sparse_dot",
            &x,
            &y,
            |a, b, t, s| sparse_dot(a, b, t, s),
            |a, b, t, s| defaults::sparse_dot::<Autodiff<X>>(a, b, t, s),
            &outer_dot,
        ),
        (
            "sparse_weighted_sum",
            &w,
            &y,
            |a, b, t, s| sparse_weighted_sum(a, b, t, s),
            |a, b, t, s| defaults::sparse_weighted_sum::<Autodiff<X>>(a, b, t, s),
            &outer_sum,
        ),
        (
            "sparse_scatter",
            &w,
            &x,
            |a, b, t, s| sparse_scatter(a, b, t, s, 17),
            |a, b, t, s| defaults::sparse_scatter::<Autodiff<X>>(a, b, t, s, 17),
            &outer_scatter,
        ),
    ];
    for (name, first, second, ours, theirs, outer) in cases {
        let grads = |op: Op| {
            let a = first.to_tensor(device).require_grad();
            let b = second.to_tensor(device).require_grad();
            let loss =
                (op(a.clone(), b.clone(), topk.clone(), assignments.clone()) * outer.clone()).sum();
            let g = loss.backward();
            (a.grad(&g).unwrap(), b.grad(&g).unwrap())
        };
        let ((a1, b1), (a2, b2)) = (grads(ours), grads(theirs));
        let (da, db) = (max_diff(a1, a2), max_diff(b1, b2));
        assert!(
            da <= TOLERANCE && db <= TOLERANCE,
            "{name}: gradients differ by {da}, {db}"
        );
    }
}

macro_rules! sparse_tests {
    ($module:ident, $backend:ty, $device:expr $(, $ignore:meta)?) => {
        mod $module {
            #[test]
            $(#[$ignore])?
            fn sparse_products_match_reference() {
                super::sparse_products_match_reference::<$backend>(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn topk_matches_sort() {
                super::topk_matches_sort::<$backend>(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn attention_softmax_matches_reference() {
                super::attention_softmax_matches_reference(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn centroid_attention_matches_loops() {
                crate::fused::centroid_attention_matches_loops(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn top_attention_matches_loops() {
                crate::fused::top_attention_matches_loops::<$backend>(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn sparse_gradients_match_reference() {
                super::sparse_gradients_match_reference::<$backend>(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn centroid_attention_gradients_match_reference() {
                crate::fused::centroid_attention_gradients_match_reference::<$backend>(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn top_attention_gradients_match_reference() {
                crate::fused::top_attention_gradients_match_reference::<$backend>(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn improved_attention_gradients_match_reference() {
                crate::fused::improved_attention_gradients_match_reference::<$backend>(&$device);
            }
        }
    };
}

// `$backend` is the backend of `$device`, whose default bodies the tests call.
sparse_tests!(
    ndarray,
    crate::common::NdArrayBackend,
    crate::common::ndarray()
);
sparse_tests!(flex, crate::common::FlexBackend, crate::common::flex());

// The host loops' split between threads (the CubeCL backends do not use the pool).
#[test]
fn ndarray_top_attention_backward_is_deterministic_across_threads() {
    crate::fused::top_attention_backward_is_deterministic_across_threads::<
        crate::common::NdArrayBackend,
    >(&crate::common::ndarray());
}
#[test]
fn flex_top_attention_backward_is_deterministic_across_threads() {
    crate::fused::top_attention_backward_is_deterministic_across_threads::<
        crate::common::FlexBackend,
    >(&crate::common::flex());
}

// The CubeCL kernels, fused (`burn::backend::Cube`, the only CubeCL backend Burn 0.22's dispatch
// reaches with fusion on) and, forward, under `Autodiff` (the gradient tests run each backend
// under `Autodiff` themselves).
#[cfg(feature = "wgpu")]
sparse_tests!(wgpu, burn::backend::Cube, crate::common::wgpu());
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_autodiff_sparse_products_match_reference() {
    let device = autodiff(&wgpu());
    sparse_products_match_reference::<Autodiff<burn::backend::Cube>>(&device);
    topk_matches_sort::<Autodiff<burn::backend::Cube>>(&device);
}
#[cfg(feature = "cuda")]
sparse_tests!(
    cuda,
    burn::backend::Cube,
    crate::common::cuda(),
    ignore = "needs an NVIDIA GPU: run with --ignored"
);
