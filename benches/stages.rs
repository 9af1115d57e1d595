//! Times each stage of clustered and improved clustered attention on its own, to find the
//! bottleneck of a backend (the bench CLI times whole attentions).
//!
//! `cargo bench -p bench --bench stages -- [L] [backend]` with `backend` one of `flex`
//! (default), `ndarray`, `wgpu` or `cuda` (with `--features cuda`); batch 1, 4 heads
//! (`STAGE_HEADS`), E = D = 64, C = 100, topk = 32. On the CPU backends it then times improved
//! clustered attention under `Autodiff`, forward alone and forward + backward.

use std::time::Instant;

use burn::tensor::{Device, Distribution, Int, Tensor};
use clustered_attention::ops::{
    CentroidAttention, ClusterTop, ClusteredAttentionBackward, Lengths, attention_softmax,
    centroid_attention, sparse_dot, sparse_scatter, sparse_weighted_sum, top_attention,
    topk_indices,
};
use clustered_attention::{
    AttentionInput, ClusteredAttention, ClusteringOptions, ImprovedClusteredAttention,
    cluster_queries, hamming_kmeans, lsh_hash, lsh_planes,
};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// E = D, C and topk of every stage (batch 1).
const SHAPE: (usize, usize, usize) = (64, 100, 32);

/// The positive number in the environment variable `name`, else `default`.
fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
        .max(1)
}

/// Heads of every stage (`STAGE_HEADS`, default 4).
fn heads() -> usize {
    env_count("STAGE_HEADS", 4)
}

/// Runs per stage, after a warm-up (`STAGE_RUNS`, default 5).
fn runs() -> usize {
    env_count("STAGE_RUNS", 5)
}

/// Minimum and median of synchronised runs after a warm-up; a stage whose name does not contain
/// `STAGE_FILTER` (when set) runs once, untimed.
fn stage<R>(name: &str, device: &Device, f: impl Fn() -> R) -> R {
    if std::env::var("STAGE_FILTER").is_ok_and(|filter| !name.contains(&filter)) {
        return f();
    }
    let _ = f();
    device.sync().expect("sync");
    let mut times = Vec::new();
    let mut out = None;
    for _ in 0..runs() {
        let start = Instant::now();
        out = Some(f());
        device.sync().expect("sync");
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    println!(
        "{name:<24} {:>9.2} ms (min {:.2})",
        times[times.len() / 2] * 1e3,
        times[0] * 1e3
    );
    out.expect("five runs")
}

/// Every stage on `device`, whose backend is `B` (the backward ops are called on its
/// primitives).
fn run<B: ClusteredAttentionBackward>(len: usize, device: &Device) {
    let device = device.clone();
    let ((dim, clusters, topk), heads) = (SHAPE, heads());
    let shape = [1, heads, len, dim];
    let [q, k, v] =
        [0, 1, 2].map(|_| Tensor::<4>::random(shape, Distribution::Normal(0., 1.), &device));
    let options = ClusteringOptions::new(clusters);

    let planes = lsh_planes(32, dim, true, 0, &device);
    let codes = stage("lsh_hash", &device, || lsh_hash(q.clone(), planes.clone()));
    stage("hamming_kmeans", &device, || {
        hamming_kmeans(codes.clone(), None, clusters, 10, 0)
    });
    let groups = cluster_queries(q.clone(), None, &options);
    let assignments = groups.assignments;
    let ones = Tensor::<4>::ones([1, heads, len, 1], &device);
    let identity = Tensor::<1, Int>::arange(0..clusters as i64, &device)
        .reshape([1, 1, clusters, 1])
        .expand([1, heads, clusters, 1]);
    let centroids = stage("centroid sums", &device, || {
        sparse_scatter(
            ones.clone(),
            q.clone(),
            identity.clone(),
            assignments.clone(),
            clusters,
        )
    });
    let keys_t = k.clone().swap_dims(2, 3);
    let scores = stage("centroid scores", &device, || {
        centroids.clone().matmul(keys_t.clone())
    });
    let weights = stage("softmax [C, S]", &device, || {
        attention_softmax(scores.clone())
    });
    let cluster_values = stage("weights @ values", &device, || {
        weights.clone().matmul(v.clone())
    });
    stage("broadcast", &device, || {
        sparse_weighted_sum(
            ones.clone(),
            cluster_values.clone(),
            identity.clone(),
            assignments.clone(),
        )
    });
    let top = stage("topk", &device, || topk_indices(scores.clone(), topk));
    stage("centroid attention", &device, || {
        centroid_attention(centroids.clone(), k.clone(), v.clone(), None, 0, None)
    });
    stage("centroid attention + topk", &device, || {
        centroid_attention(centroids.clone(), k.clone(), v.clone(), None, topk, None)
    });
    let dots = stage("sparse_dot", &device, || {
        sparse_dot(q.clone(), k.clone(), top.clone(), assignments.clone())
    });
    let top_weights = stage("softmax [L, k]", &device, || {
        attention_softmax(dots.clone())
    });
    stage("sparse_weighted_sum", &device, || {
        sparse_weighted_sum(
            top_weights.clone(),
            v.clone(),
            top.clone(),
            assignments.clone(),
        )
    });
    let mass = stage("gather top mass", &device, || {
        weights.clone().gather(3, top.clone()).sum_dim(3)
    });
    stage("top attention (fused)", &device, || {
        top_attention(
            q.clone(),
            k.clone(),
            v.clone(),
            assignments.clone(),
            top.clone(),
            mass.clone(),
            cluster_values.clone(),
            None,
            0.125,
            None,
        )
    });
    let float = |x: &Tensor<4>| B::float_primitive(x.clone());
    let int = |x: &Tensor<4, Int>| B::int_primitive(x.clone());
    let normal =
        |shape: [usize; 4]| Tensor::<4>::random(shape, Distribution::Normal(0., 1.), &device);
    let forward = B::centroid_attention_forward(
        float(&centroids),
        float(&k),
        float(&v),
        Lengths::All,
        topk,
        None,
    );
    let (grad_rest, grad_top_weights) = (
        normal([1, heads, clusters, dim]),
        normal([1, heads, clusters, topk]),
    );
    stage("centroid attention backward", &device, || {
        B::centroid_attention_backward(
            float(&centroids),
            float(&k),
            float(&v),
            Lengths::All,
            CentroidAttention {
                values: forward.values.clone(),
                top: forward.top.clone(),
                log_sum_exp: forward.log_sum_exp.clone(),
            },
            float(&grad_rest),
            Some(float(&grad_top_weights)),
            None,
        )
    });
    let grad = normal(shape);
    stage("top attention backward", &device, || {
        B::top_attention_backward(
            float(&q),
            float(&k),
            float(&v),
            ClusterTop {
                assignments: B::int_primitive(assignments.clone()),
                topk: int(&top),
                mass: float(&mass),
                rest: float(&cluster_values),
            },
            Lengths::All,
            0.125,
            float(&grad),
            None,
        )
    });
    stage("clustered (whole)", &device, || {
        ClusteredAttention::new(clusters).forward(AttentionInput::new(
            q.clone(),
            k.clone(),
            v.clone(),
        ))
    });
    stage("improved (whole)", &device, || {
        ImprovedClusteredAttention::new(clusters, topk).forward(AttentionInput::new(
            q.clone(),
            k.clone(),
            v.clone(),
        ))
    });
}

/// The whole improved clustered attention under autodiff: its forward pass, then forward and
/// backward of the sum of its output with respect to the queries, keys and values (on the CPU
/// backends).
#[cfg(any(feature = "flex", feature = "ndarray"))]
fn train(len: usize, device: &Device) {
    let device = device.clone().autodiff();
    let ((dim, clusters, topk), heads) = (SHAPE, heads());
    let [q, k, v] = [0, 1, 2].map(|_| {
        Tensor::<4>::random([1, heads, len, dim], Distribution::Normal(0., 1.), &device)
            .require_grad()
    });
    let attend = || {
        ImprovedClusteredAttention::new(clusters, topk).forward(AttentionInput::new(
            q.clone(),
            k.clone(),
            v.clone(),
        ))
    };
    stage("improved train: forward", &device, attend);
    stage("improved train: forward + backward", &device, || {
        attend().sum().backward()
    });
}

fn main() {
    // `cargo bench` passes `--bench`; the positional arguments are the others.
    let mut args = std::env::args().skip(1).filter(|a| !a.starts_with("--"));
    let len = args
        .next()
        .map_or(16384, |l| l.parse().expect("L must be a number"));
    match args.next().as_deref().unwrap_or("flex") {
        #[cfg(feature = "flex")]
        "flex" => {
            run::<burn::backend::Flex>(len, &Device::flex());
            train(len, &Device::flex());
        }
        #[cfg(feature = "ndarray")]
        #[allow(deprecated)] // Burn 0.22 deprecates NdArray in favour of Flex.
        "ndarray" => {
            run::<burn::backend::NdArray>(len, &Device::ndarray());
            train(len, &Device::ndarray());
        }
        #[cfg(feature = "wgpu")]
        "wgpu" => {
            run::<burn::backend::Cube>(len, &Device::wgpu(burn::tensor::DeviceKind::DefaultDevice))
        }
        #[cfg(feature = "cuda")]
        "cuda" => run::<burn::backend::Cube>(len, &Device::cuda(0)),
        other => panic!("unknown or uncompiled backend {other:?} (flex, ndarray, wgpu, cuda)"),
    }
}
