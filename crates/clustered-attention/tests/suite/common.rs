//! Host-side data and independent references.

use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand_distr::{Distribution, StandardNormal};

/// Set in the child processes of the test binary that [`run_child`] starts, to what the
/// child is for.
const CHILD: &str = "CLUSTERED_ATTENTION_TEST_CHILD";

/// What this process is for, when it is a child that [`run_child`] started.
pub fn child_purpose() -> Option<String> {
    std::env::var(CHILD).ok()
}

/// Runs the test binary again, as the child `purpose`, with the test-harness arguments `args`
/// and the environment variables `envs` added, and asserts that every test it ran passed. For
/// tests that change process-wide state, or that need a process of their own or one started
/// with a given environment.
pub fn run_child(purpose: &str, args: &[&str], envs: &[(&str, &str)]) {
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(args)
        .envs(envs.iter().copied())
        .env(CHILD, purpose)
        .status()
        .expect("the test binary runs");
    assert!(
        status.success(),
        "the child process {args:?} with {envs:?} failed: {status}"
    );
}

/// Whether this is the child process of the test `name` (a full path in the suite); otherwise
/// runs that test alone in a child process of the test binary, asserts that it passed and
/// returns false. For tests that change process-wide state, or need it to themselves.
pub fn in_child_process(name: &str) -> bool {
    if child_purpose().as_deref() == Some(name) {
        return true;
    }
    run_child(
        name,
        &["--exact", name, "--test-threads=1", "--nocapture"],
        &[],
    );
    false
}

/// The concrete backends whose primitives the tests hand to the default bodies
/// ([`crate::defaults`]) and to the backward ops; their tensors live on [`ndarray`] and [`flex`].
#[allow(deprecated)]
pub type NdArrayBackend = burn::backend::NdArray;
pub type FlexBackend = burn::backend::Flex;

/// The NdArray device (deprecated in Burn 0.22 in favour of Flex; the crate still serves it).
#[allow(deprecated)]
pub fn ndarray() -> Device {
    Device::ndarray()
}

/// The Flex device.
pub fn flex() -> Device {
    Device::flex()
}

/// The default WGPU device (what `burn::backend::Wgpu`'s default device was on Burn 0.21).
#[cfg(feature = "wgpu")]
pub fn wgpu() -> Device {
    Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)
}

/// The first CUDA device.
#[cfg(feature = "cuda")]
pub fn cuda() -> Device {
    Device::cuda(0)
}

/// `device` with autodiff on (tensors created on it are tracked once they `require_grad`).
pub fn autodiff(device: &Device) -> Device {
    device.clone().autodiff()
}

/// A host copy of a `[batch, heads, rows, cols]` tensor.
#[derive(Clone, Debug)]
pub struct Host4 {
    pub dims: [usize; 4],
    pub data: Vec<f32>,
}

impl Host4 {
    pub fn at(&self, b: usize, h: usize, i: usize, j: usize) -> f64 {
        let [_, heads, rows, cols] = self.dims;
        self.data[((b * heads + h) * rows + i) * cols + j] as f64
    }

    pub fn row(&self, b: usize, h: usize, i: usize) -> Vec<f64> {
        (0..self.dims[3]).map(|j| self.at(b, h, i, j)).collect()
    }

    pub fn to_tensor(&self, device: &Device) -> Tensor<4> {
        Tensor::from_data(TensorData::new(self.data.clone(), self.dims), device)
    }

    pub fn from_tensor(tensor: Tensor<4>) -> Self {
        let dims = tensor.dims();
        let data = tensor.into_data().iter::<f32>().collect();
        Self { dims, data }
    }
}

/// Absolute error allowed in an `f32` output that passes through Burn's matrix product, given
/// the tolerance on the other backends. On CUDA, Burn's matmul (cubek-matmul 0.2,
/// `definition/blueprint.rs`) runs `f32` products on tensor cores in TF32, which keeps 10
/// mantissa bits (unit roundoff 2^-11 ≈ 4.9e-4): outputs of size about 1 then carry errors of
/// a few 1e-4 (8.5e-4 for full attention on an H200), and 5e-3 allows for that.
pub fn matmul_tolerance(device: &Device, tolerance: f64) -> f64 {
    if is_cuda(device) {
        tolerance.max(TF32_TOLERANCE)
    } else {
        tolerance
    }
}

/// Whether `device` (with or without autodiff) is a CUDA device: a Cube device on the CUDA
/// runtime, which Burn's `Debug` prints as `Cube(Cuda(CudaDevice { .. }))`.
pub fn is_cuda(device: &Device) -> bool {
    format!("{device:?}").contains("Cuda(")
}

/// See [`matmul_tolerance`].
const TF32_TOLERANCE: f64 = 5e-3;

/// `host` on `device` in `dtype`: the host copy of the values as rounded to `dtype`, and the
/// tensor in `dtype` (`host` itself, as a tensor, for `f32`).
pub fn rounded(host: &Host4, dtype: DType, device: &Device) -> (Host4, Tensor<4>) {
    let tensor = host.to_tensor(device);
    if dtype == DType::F32 {
        return (host.clone(), tensor);
    }
    let tensor = tensor.cast(dtype);
    (Host4::from_tensor(tensor.clone().cast(DType::F32)), tensor)
}

/// The largest absolute entry of `host`.
pub fn largest(host: &Host4) -> f64 {
    host.data.iter().fold(0.0, |m, &x| m.max(x.abs() as f64))
}

pub fn rng(seed: u64) -> Xoshiro256PlusPlus {
    Xoshiro256PlusPlus::seed_from_u64(seed)
}

/// Standard normal entries.
pub fn normal(dims: [usize; 4], seed: u64) -> Host4 {
    let mut rng = rng(seed);
    let data = (0..dims.iter().product::<usize>())
        .map(|_| StandardNormal.sample(&mut rng))
        .collect();
    Host4 { dims, data }
}

/// Queries scattered around `centres` random centres per (batch, head): centre · `spread` +
/// 0.1 · noise, the structure clustered attention relies on.
pub fn clustered_queries(dims: [usize; 4], centres: usize, spread: f32, seed: u64) -> Host4 {
    let [batch, heads, len, dim] = dims;
    let mut rng = rng(seed);
    let mut data = Vec::with_capacity(dims.iter().product());
    for _ in 0..batch * heads {
        let centre_values: Vec<f32> = (0..centres * dim)
            .map(|_| spread * Distribution::<f32>::sample(&StandardNormal, &mut rng))
            .collect();
        for i in 0..len {
            let c = (i * 7 + i / 3) % centres;
            for e in 0..dim {
                let noise: f32 = StandardNormal.sample(&mut rng);
                data.push(centre_values[c * dim + e] + 0.1 * noise);
            }
        }
    }
    Host4 { dims, data }
}

/// `[batch, heads, S, S]` identity values: the attention output is then the attention matrix.
pub fn identity_values(batch: usize, heads: usize, len: usize) -> Host4 {
    let mut data = vec![0.0; batch * heads * len * len];
    for bh in 0..batch * heads {
        for i in 0..len {
            data[(bh * len + i) * len + i] = 1.0;
        }
    }
    Host4 {
        dims: [batch, heads, len, len],
        data,
    }
}

/// Sequence lengths as an int tensor on `device` (in the device's int dtype: `i32` on Flex and
/// the Cube backends, `i64` on NdArray).
pub fn lengths(values: &[usize], device: &Device) -> Tensor<1, Int> {
    Tensor::from_data(
        TensorData::new(values.iter().map(|&n| n as i64).collect(), [values.len()]),
        device,
    )
}

/// The values of an int tensor of any int dtype, as `i64`.
pub fn host_ints<const D: usize>(tensor: Tensor<D, Int>) -> Vec<i64> {
    tensor.into_data().iter::<i64>().collect()
}

/// Softmax of f64 scores (`-inf` gives 0).
pub fn softmax(scores: &[f64]) -> Vec<f64> {
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Attention weights of one query row against the valid keys (zeros past `key_len`).
fn weights(
    query: &[f64],
    keys: &Host4,
    b: usize,
    h: usize,
    key_len: usize,
    scale: f64,
) -> Vec<f64> {
    let scores: Vec<f64> = (0..key_len)
        .map(|s| scale * dot(query, &keys.row(b, h, s)))
        .collect();
    let mut w = softmax(&scores);
    w.resize(keys.dims[2], 0.0);
    w
}

fn weighted_values(w: &[f64], values: &Host4, b: usize, h: usize) -> Vec<f64> {
    let mut out = vec![0.0; values.dims[3]];
    for (s, ws) in w.iter().enumerate() {
        if *ws != 0.0 {
            for (d, o) in out.iter_mut().enumerate() {
                *o += ws * values.at(b, h, s, d);
            }
        }
    }
    out
}

/// Everything the references need besides the tensors.
pub struct Setup<'a> {
    pub query_lengths: &'a [usize],
    pub key_lengths: &'a [usize],
    pub scale: f64,
}

/// Output `[batch, heads, L, D]` as nested rows, zero rows for padded queries.
pub type Rows = Vec<Vec<f64>>;

fn for_each_query(
    q: &Host4,
    setup: &Setup,
    mut f: impl FnMut(usize, usize, usize) -> Vec<f64>,
    width: usize,
) -> Rows {
    let [batch, heads, len, _] = q.dims;
    let mut rows = Vec::with_capacity(batch * heads * len);
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..len {
                rows.push(if i < setup.query_lengths[b] {
                    f(b, h, i)
                } else {
                    vec![0.0; width]
                });
            }
        }
    }
    rows
}

/// Full softmax attention (eqs. 1–2).
pub fn full_reference(q: &Host4, k: &Host4, v: &Host4, setup: &Setup) -> Rows {
    for_each_query(
        q,
        setup,
        |b, h, i| {
            let w = weights(&q.row(b, h, i), k, b, h, setup.key_lengths[b], setup.scale);
            weighted_values(&w, v, b, h)
        },
        v.dims[3],
    )
}

/// Mean of the valid queries of cluster `j` (eq. 3).
fn centroid(q: &Host4, assignments: &[i64], b: usize, h: usize, j: usize) -> Vec<f64> {
    let [_, heads, len, dim] = q.dims;
    let mut sum = vec![0.0; dim];
    let mut count = 0.0;
    for i in 0..len {
        if assignments[(b * heads + h) * len + i] == j as i64 {
            for (e, s) in sum.iter_mut().enumerate() {
                *s += q.at(b, h, i, e);
            }
            count += 1.0;
        }
    }
    sum.iter().map(|s| s / count).collect()
}

/// Clustered attention (eqs. 3–6) for given assignments.
pub fn clustered_reference(
    q: &Host4,
    k: &Host4,
    v: &Host4,
    assignments: &[i64],
    setup: &Setup,
) -> Rows {
    let [_, heads, len, _] = q.dims;
    for_each_query(
        q,
        setup,
        |b, h, i| {
            let j = assignments[(b * heads + h) * len + i] as usize;
            let c = centroid(q, assignments, b, h, j);
            let w = weights(&c, k, b, h, setup.key_lengths[b], setup.scale);
            weighted_values(&w, v, b, h)
        },
        v.dims[3],
    )
}

/// Improved clustered attention (eqs. 9–11) for given assignments.
pub fn improved_reference(
    q: &Host4,
    k: &Host4,
    v: &Host4,
    assignments: &[i64],
    topk: usize,
    setup: &Setup,
) -> Rows {
    let [_, heads, len, _] = q.dims;
    for_each_query(
        q,
        setup,
        |b, h, i| {
            let key_len = setup.key_lengths[b];
            let j = assignments[(b * heads + h) * len + i] as usize;
            let c = centroid(q, assignments, b, h, j);
            let ac = weights(&c, k, b, h, key_len, setup.scale);
            // Top-k valid keys by centroid attention.
            let mut order: Vec<usize> = (0..key_len).collect();
            order.sort_by(|&x, &y| ac[y].partial_cmp(&ac[x]).unwrap());
            order.truncate(topk);
            let mass: f64 = order.iter().map(|&l| ac[l]).sum();
            let query = q.row(b, h, i);
            let top_scores: Vec<f64> = order
                .iter()
                .map(|&l| setup.scale * dot(&query, &k.row(b, h, l)))
                .collect();
            let top = softmax(&top_scores);
            let mut at = ac.clone();
            for (r, &l) in order.iter().enumerate() {
                at[l] = mass * top[r];
            }
            weighted_values(&at, v, b, h)
        },
        v.dims[3],
    )
}

/// Largest absolute difference between an output tensor and reference rows.
pub fn max_abs_diff(out: &Host4, reference: &Rows) -> f64 {
    let [batch, heads, len, dim] = out.dims;
    let mut worst: f64 = 0.0;
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..len {
                let row = &reference[(b * heads + h) * len + i];
                for (d, expected) in row.iter().enumerate().take(dim) {
                    worst = worst.max((out.at(b, h, i, d) - expected).abs());
                }
            }
        }
    }
    worst
}

/// A padding mask `[batch, len]` (burn-nn's `mask_pad`): true at positions `≥ lengths[b]`.
pub fn padding_mask(lengths: &[usize], len: usize, device: &Device) -> Tensor<2, Bool> {
    let mask: Vec<bool> = lengths
        .iter()
        .flat_map(|&n| (0..len).map(move |i| i >= n))
        .collect();
    Tensor::from_data(TensorData::new(mask, [lengths.len(), len]), device)
}
