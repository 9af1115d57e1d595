use burn::tensor::activation::softmax;
use burn::tensor::{Distribution, Int, Tensor, backend::Backend};
use clustered_attention::*;
use std::time::Instant;

fn stage<B: Backend, R>(name: &str, device: &B::Device, f: impl Fn() -> R) -> R {
    let _ = f();
    B::sync(device).unwrap();
    let t = Instant::now();
    let mut out = None;
    for _ in 0..3 {
        out = Some(f());
        B::sync(device).unwrap();
    }
    println!(
        "{name:<28} {:>8.2} ms",
        t.elapsed().as_secs_f64() * 1e3 / 3.0
    );
    out.unwrap()
}

fn run<B: ClusteringBackend>(name: &str) {
    println!("== {name}");
    let device = Default::default();
    let len = 16384;
    let (h, e, c) = (4, 64, 100);
    let q = Tensor::<B, 4>::random([1, h, len, e], Distribution::Normal(0., 1.), &device);
    let k = Tensor::<B, 4>::random([1, h, len, e], Distribution::Normal(0., 1.), &device);
    let v = Tensor::<B, 4>::random([1, h, len, e], Distribution::Normal(0., 1.), &device);
    let opts = ClusteringOptions::new(c);
    let planes = lsh_planes::<B>(32, e, true, 0, &device);
    let codes = stage::<B, _>("lsh_hash", &device, || lsh_hash(q.clone(), planes.clone()));
    let _ = stage::<B, _>("hamming_kmeans", &device, || {
        hamming_kmeans(codes.clone(), None, c, 10, 0)
    });
    let clusters = stage::<B, _>("cluster_queries", &device, || {
        cluster_queries(q.clone(), None, &opts)
    });
    let a = clusters.assignments.clone();
    let ones = Tensor::<B, 4>::ones([1, h, len, 1], &device);
    let ident = Tensor::<B, 1, Int>::arange(0..c as i64, &device)
        .reshape([1, 1, c, 1])
        .expand([1, h, c, 1]);
    let cent = stage::<B, _>("centroid sums", &device, || {
        sparse::sparse_scatter(ones.clone(), q.clone(), ident.clone(), a.clone(), c)
    });
    let kt = k.clone().swap_dims(2, 3);
    let scores = stage::<B, _>("centroid scores matmul", &device, || {
        cent.clone().matmul(kt.clone()).mul_scalar(0.125)
    });
    let w = stage::<B, _>("softmax C x S", &device, || softmax(scores.clone(), 3));
    let vc = stage::<B, _>("weights @ V", &device, || w.clone().matmul(v.clone()));
    let _ = stage::<B, _>("broadcast", &device, || {
        sparse::sparse_weighted_sum(ones.clone(), vc.clone(), ident.clone(), a.clone())
    });
    let top = stage::<B, _>("topk", &device, || sparse::topk_indices(scores.clone(), 32));
    let tw = stage::<B, _>("gather top weights", &device, || {
        w.clone().gather(3, top.clone())
    });
    let _ = stage::<B, _>("scatter rest", &device, || {
        w.clone().scatter(
            3,
            top.clone(),
            tw.clone().neg(),
            burn::tensor::IndexingUpdateOp::Add,
        )
    });
    let sd = stage::<B, _>("sparse_dot", &device, || {
        sparse::sparse_dot(q.clone(), k.clone(), top.clone(), a.clone())
    });
    let sm = stage::<B, _>("softmax L x k", &device, || softmax(sd.clone(), 3));
    let _ = stage::<B, _>("sparse_weighted_sum", &device, || {
        sparse::sparse_weighted_sum(sm.clone(), v.clone(), top.clone(), a.clone())
    });
    let _ = stage::<B, _>("clustered (total)", &device, || {
        clustered_attention(
            q.clone(),
            k.clone(),
            v.clone(),
            None,
            None,
            &opts,
            &AttentionOptions::new(),
        )
    });
    let _ = stage::<B, _>("improved (total)", &device, || {
        improved_clustered_attention(
            q.clone(),
            k.clone(),
            v.clone(),
            None,
            None,
            &opts,
            32,
            &AttentionOptions::new(),
        )
    });
}

fn main() {
    run::<burn::backend::NdArray>("ndarray");
    run::<burn::backend::Flex>("flex");
}
