//! Inner loops of the host ops ([`super::host`]), compiled for the CPU's vector instructions.
//!
//! Each kernel is written once, as plain loops over fixed-width lanes that the compiler turns
//! into vector instructions, and compiled three times by `multiversion!`: with AVX-512, with
//! AVX2 and FMA, and for the build's baseline; each call runs the first version the CPU
//! supports ([`simd_level`], detected once), or the one the environment variable [`SIMD_ENV`]
//! caps it at. With FMA the multiply-adds are fused
//! (`f32::mul_add`), so the last bit of a float result can differ between machines, never
//! between runs on one machine. Integer results (codes, assignments, top-k sets) are the same
//! on every version.
//!
//! The products work on small blocks, gathered per cluster, four rows at a time against
//! [`LANES`] columns, so that the partial sums stay in registers (a register-blocked
//! micro-kernel, as in GotoBLAS).

use std::sync::OnceLock;

/// The vector instructions the host ops run with, from the least to the most capable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// The build's baseline (SSE2 on x86-64; every non-x86 target).
    Baseline,
    /// AVX2 with fused multiply-adds (FMA3).
    Avx2,
    /// AVX-512 (F and VL) with fused multiply-adds; K-means also needs BW and VPOPCNTDQ for its
    /// AVX-512 version and otherwise takes the AVX2 one.
    Avx512,
}

/// Environment variable that caps the vector instructions of the host ops: `avx512`, `avx2`
/// or `baseline`. Read once, at the first host op. A cap above what the CPU has changes
/// nothing. Used to run every compiled version on one machine (the test suite does) and to
/// compare them.
pub const SIMD_ENV: &str = "CLUSTERED_ATTENTION_SIMD";

/// The vector instructions the host ops use in this process: the best this CPU has, capped by
/// [`SIMD_ENV`] when it is set.
///
/// # Panics
/// If [`SIMD_ENV`] is set to anything but `avx512`, `avx2` or `baseline` (any case).
pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let detected = detected_level();
        match std::env::var(SIMD_ENV) {
            Err(std::env::VarError::NotPresent) => detected,
            Ok(cap) => {
                let cap = match cap.to_ascii_lowercase().as_str() {
                    "avx512" => SimdLevel::Avx512,
                    "avx2" => SimdLevel::Avx2,
                    "baseline" => SimdLevel::Baseline,
                    _ => panic!("{SIMD_ENV} must be avx512, avx2 or baseline, got {cap:?}"),
                };
                detected.min(cap)
            }
            Err(error) => panic!("{SIMD_ENV} must be avx512, avx2 or baseline: {error}"),
        }
    })
}

/// The best [`SimdLevel`] this CPU supports.
fn detected_level() -> SimdLevel {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512vl") && has!("avx2") && has!("fma") {
            return SimdLevel::Avx512;
        }
        if has!("avx2") && has!("fma") {
            return SimdLevel::Avx2;
        }
    }
    SimdLevel::Baseline
}

/// Width of the column blocks: one AVX-512 register, two AVX2 registers of `f32`.
pub(crate) const LANES: usize = 16;

/// Rows processed together by the products.
const GROUP: usize = 4;

/// Rounds `n` up to a multiple of [`LANES`].
pub(crate) fn padded(n: usize) -> usize {
    n.div_ceil(LANES) * LANES
}

/// Defines `fn $name(args) -> ret` that runs `body` compiled for AVX-512, AVX2 + FMA or the
/// baseline; `body` sees the const `$fma: bool`, true when fused multiply-adds are available,
/// and, when declared as `fn $name<$fma, $wide>`, the const `$wide: bool`, true in the AVX-512
/// version only, for code that calls AVX-512 intrinsics itself (the compiler's own loops use
/// 256-bit registers there too).
macro_rules! multiversion {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident<$fma:ident>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        multiversion! {
            $(#[$meta])*
            $vis fn $name<$fma, _WIDE>($($arg: $ty),*) $(-> $ret)? $body
        }
    };
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident<$fma:ident, $wide:ident>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body<const $fma: bool, const $wide: bool>($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                fn avx512($($arg: $ty),*) $(-> $ret)? {
                    body::<true, true>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    body::<true, false>($($arg),*)
                }
                match simd_level() {
                    // SAFETY: `simd_level` is never above what the CPU supports, so the CPU
                    // has the features the function is compiled for.
                    SimdLevel::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    SimdLevel::Avx2 => return unsafe { avx2($($arg),*) },
                    SimdLevel::Baseline => {}
                }
            }
            body::<false, false>($($arg),*)
        }
    };
}

/// `a · b + c`, fused when `FMA` (only then is `mul_add` an instruction, not a library call).
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

// ---------------------------------------------------------------------------------------------
// Sparse products

/// Products `Σ_e rows[g][e] · block[e, c..c + LANES]` of `G` rows with the columns
/// `c..c + LANES` of a `[inner, width]` block, `inner = block.len() / width`: dot products of
/// query rows with transposed keys, or weighted sums of value rows.
///
/// # Panics
/// If `c + LANES > width` or a row is shorter than `inner`.
#[inline(always)]
fn rows_times_block<const FMA: bool, const G: usize>(
    rows: [&[f32]; G],
    block: &[f32],
    width: usize,
    c: usize,
) -> [[f32; LANES]; G] {
    let mut acc = [[0f32; LANES]; G];
    let inner = block.len() / width;
    assert!(
        c + LANES <= width,
        "columns {c}..{} past {width}",
        c + LANES
    );
    let rows = rows.map(|row| &row[..inner]);
    // Indices checked above, so that nothing in the loop can panic: a panic edge would keep
    // the accumulators in memory instead of registers.
    for e in 0..inner {
        // SAFETY: e < inner and c + LANES ≤ width, so the block's row part lies in block
        // ([inner × width]).
        let columns = unsafe { &*block.as_ptr().add(e * width + c).cast::<[f32; LANES]>() };
        for g in 0..G {
            // SAFETY: e < inner, the length of every row.
            let x = unsafe { *rows[g].get_unchecked(e) };
            for l in 0..LANES {
                acc[g][l] = madd::<FMA>(x, columns[l], acc[g][l]);
            }
        }
    }
    acc
}

multiversion! {
    /// `out[i·n + j] = Σ_e x[i·inner + e] · block[e, j]` for every row `i` of `members`
    /// (`j < n`): the members' dot products with the `n` top keys (`x` the queries, `inner`
    /// their dimension, `block` the keys transposed) or their weighted sums of the `n`-wide top
    /// values (`x` the weights, `inner` the top-k).
    ///
    /// `x`: rows of `inner`; `block`: `[inner, padded(n)]`, columns `≥ n` zero; `out`: rows
    /// of `n`.
    pub(crate) fn members_times_block<FMA>(
        x: &[f32],
        inner: usize,
        members: &[u32],
        block: &[f32],
        n: usize,
        out: &mut [f32],
    ) {
        let width = block.len() / inner;
        let row = |i: u32| &x[i as usize * inner..(i as usize + 1) * inner];
        let mut groups = members.chunks_exact(GROUP);
        for group in &mut groups {
            let rows: [&[f32]; GROUP] = std::array::from_fn(|g| row(group[g]));
            for c in (0..width).step_by(LANES) {
                let acc = rows_times_block::<FMA, GROUP>(rows, block, width, c);
                let m = LANES.min(n - c);
                for (g, &i) in group.iter().enumerate() {
                    let i = i as usize;
                    out[i * n + c..i * n + c + m].copy_from_slice(&acc[g][..m]);
                }
            }
        }
        for &i in groups.remainder() {
            for c in (0..width).step_by(LANES) {
                let [acc] = rows_times_block::<FMA, 1>([row(i)], block, width, c);
                let m = LANES.min(n - c);
                let i = i as usize;
                out[i * n + c..i * n + c + m].copy_from_slice(&acc[..m]);
            }
        }
    }
}

/// One cluster's gathered operands of [`attend_members`].
pub(crate) struct ClusterBlock<'a> {
    /// The `k` top keys transposed, `[dim, kp]` with `kp = padded(k)`, columns `≥ k` zero.
    pub key_t: &'a [f32],
    /// `[kp]`: added to the scaled scores, `0` for a valid key and `-∞` for a padded key and
    /// for the columns `≥ k`.
    pub bias: &'a [f32],
    /// The `k` top values, `[k, padded(dv)]`, columns `≥ dv` zero.
    pub values: &'a [f32],
    /// `[padded(dv)]`: the first `dv` added to every output row, the rest zero.
    pub rest: &'a [f32],
    /// Width of the output rows.
    pub dv: usize,
    /// Multiplies the softmax.
    pub mass: f32,
    /// Multiplies the dot products.
    pub scale: f32,
    /// With attention dropout: the dropout, the `(batch, head)`'s index and the index of the
    /// query of member 0 (`ids` are relative to it); each member's weights are multiplied by
    /// their factors (keys: the ranks in the top-k).
    pub dropout: Option<(crate::dropout::AttentionDropout, u32, u32)>,
}

/// [`attend_members`] for `G` rows: the scores in `scratch` (`[G, kp]`), softmaxed in place.
#[inline(always)]
fn attend_group<const FMA: bool, const G: usize>(
    rows: [&[f32]; G],
    ids: &[u32],
    cluster: &ClusterBlock<'_>,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let kp = cluster.bias.len();
    let (dv, dp) = (cluster.dv, cluster.rest.len());
    let k = cluster.values.len() / dp;
    for c in (0..kp).step_by(LANES) {
        let acc = rows_times_block::<FMA, G>(rows, cluster.key_t, kp, c);
        for g in 0..G {
            for l in 0..LANES {
                scratch[g * kp + c + l] =
                    madd::<FMA>(acc[g][l], cluster.scale, cluster.bias[c + l]);
            }
        }
    }
    for row in scratch.chunks_exact_mut(kp).take(G) {
        softmax_scaled::<FMA>(row, cluster.mass);
    }
    if let Some((dropout, bh, first)) = &cluster.dropout {
        let stream = crate::dropout::AttentionDropout::QUERY_TOP;
        let rows = &ids[..G.min(ids.len())];
        dropout_rows(dropout, [stream, *bh, *first], rows, (kp, k), scratch);
    }
    let weights: [&[f32]; G] = std::array::from_fn(|g| &scratch[g * kp..g * kp + k]);
    for c in (0..dp).step_by(LANES) {
        let acc = rows_times_block::<FMA, G>(weights, cluster.values, dp, c);
        let rest: &[f32; LANES] = cluster.rest[c..c + LANES].try_into().unwrap();
        // All lanes summed, then the first `n` stored (as `members_times_block` does): a partial
        // loop over the lanes here makes the compiler split the accumulators into 128-bit
        // registers that spill.
        let n = LANES.min(dv - c);
        for (&i, acc) in ids.iter().zip(&acc) {
            let sum: [f32; LANES] = std::array::from_fn(|l| acc[l] + rest[l]);
            let start = i as usize * dv + c;
            out[start..start + n].copy_from_slice(&sum[..n]);
        }
    }
}

/// Asks the CPU to bring `x` into its caches ahead of use (nothing on other architectures).
#[inline(always)]
pub(crate) fn prefetch(x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in x.chunks(16) {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch reads nothing architecturally and never faults; the address
        // lies in `x`.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

multiversion! {
    /// For every row `i` of `members`, with `s_r = scale · x[i] · key_t[.., r] + bias[r]`:
    /// `out[i·dv + d] = mass · Σ_r softmax(s)_r · values[r, d] + rest[d]` (`d < dv`), the
    /// top-k part of improved clustered attention plus the rest of its cluster (paper
    /// eqs. 10–11). A row whose scores hold no finite maximum gives NaN, as the softmax does.
    ///
    /// `x`: rows of `dim`; `scratch`: at least `GROUP · padded(k)` floats; `out`: rows of `dv`.
    pub(crate) fn attend_members<FMA>(
        x: &[f32],
        dim: usize,
        members: &[u32],
        cluster: &ClusterBlock<'_>,
        scratch: &mut [f32],
        out: &mut [f32],
    ) {
        let row = |i: u32| &x[i as usize * dim..(i as usize + 1) * dim];
        let dv = cluster.dv;
        // The members are scattered over the sequence: the rows of the group after next are
        // fetched while this one is computed.
        let ahead = 2 * GROUP;
        for (t, group) in members.chunks_exact(GROUP).enumerate() {
            for &i in members.iter().skip(t * GROUP + ahead).take(GROUP) {
                prefetch(row(i));
                prefetch(&out[i as usize * dv..(i as usize + 1) * dv]);
            }
            let rows: [&[f32]; GROUP] = std::array::from_fn(|g| row(group[g]));
            attend_group::<FMA, GROUP>(rows, group, cluster, scratch, out);
        }
        let groups = members.chunks_exact(GROUP);
        for i in groups.remainder() {
            attend_group::<FMA, 1>([row(*i)], std::slice::from_ref(i), cluster, scratch, out);
        }
    }
}

multiversion! {
    /// The softmax part of the gradient of [`attend_members`], in place, for every row `i` of
    /// `members`: with `p = softmax(scale · scores[i] + bias)` and `g = grads[i]` (the
    /// gradient's dot products with the top-k values) and `δ = Σ_r p_r · g_r`,
    /// `scores[i] ← mass · p` (the weights of the values) and
    /// `grads[i] ← scale · mass · p ⊙ (g − δ)` (the gradient of the dot products).
    ///
    /// `scores`, `grads`: rows of `k = bias.len()`. Returns `Σ_i δ_i`, the gradient of `mass`.
    pub(crate) fn softmax_backward_members<FMA>(
        scores: &mut [f32],
        grads: &mut [f32],
        members: &[u32],
        bias: &[f32],
        scale: f32,
        mass: f32,
    ) -> f32 {
        let k = bias.len();
        let mut total = 0.0;
        for &i in members {
            let i = i as usize;
            let p = &mut scores[i * k..(i + 1) * k];
            let g = &mut grads[i * k..(i + 1) * k];
            for (s, &b) in p.iter_mut().zip(bias) {
                *s = madd::<FMA>(*s, scale, b);
            }
            softmax_scaled::<FMA>(p, 1.0);
            let delta = dot::<FMA>(p, g);
            let factor = scale * mass;
            for (g, s) in g.iter_mut().zip(p.iter_mut()) {
                *g = factor * *s * (*g - delta);
                *s *= mass;
            }
            total += delta;
        }
        total
    }
}

/// `Σ_t weights[members[t]·k + r0 + g] · rows[t, c..c + LANES]` for `g < G`.
#[inline(always)]
fn scatter_group<const FMA: bool, const G: usize>(
    weights: &[f32],
    k: usize,
    members: &[u32],
    rows: &[f32],
    fp: usize,
    r0: usize,
    c: usize,
) -> [[f32; LANES]; G] {
    let mut acc = [[0f32; LANES]; G];
    for (&i, row) in members.iter().zip(rows.chunks_exact(fp)) {
        let x: &[f32; LANES] = row[c..c + LANES].try_into().unwrap();
        let w: &[f32; G] = weights[i as usize * k + r0..i as usize * k + r0 + G]
            .try_into()
            .unwrap();
        for g in 0..G {
            for l in 0..LANES {
                acc[g][l] = madd::<FMA>(w[g], x[l], acc[g][l]);
            }
        }
    }
    acc
}

multiversion! {
    /// `block[r, ..] += Σ_t weights[members[t]·k + r] · rows[t, ..]` for `r < k`: the
    /// transpose of [`members_times_block`]'s weighted sums for one cluster.
    ///
    /// `weights`: rows of `k`; `rows`: the members' rows gathered in the order of `members`,
    /// `[members.len(), fp]` with `fp` a multiple of [`LANES`]; `block`: `[k, fp]`.
    pub(crate) fn scatter_members<FMA>(
        weights: &[f32],
        k: usize,
        members: &[u32],
        rows: &[f32],
        block: &mut [f32],
    ) {
        let fp = block.len() / k;
        let mut r0 = 0;
        while r0 + GROUP <= k {
            for c in (0..fp).step_by(LANES) {
                let acc = scatter_group::<FMA, GROUP>(weights, k, members, rows, fp, r0, c);
                for (g, acc) in acc.iter().enumerate() {
                    let out = &mut block[(r0 + g) * fp + c..(r0 + g) * fp + c + LANES];
                    for (o, &a) in out.iter_mut().zip(acc) {
                        *o += a;
                    }
                }
            }
            r0 += GROUP;
        }
        for r in r0..k {
            for c in (0..fp).step_by(LANES) {
                let [acc] = scatter_group::<FMA, 1>(weights, k, members, rows, fp, r, c);
                for (o, &a) in block[r * fp + c..r * fp + c + LANES].iter_mut().zip(&acc) {
                    *o += a;
                }
            }
        }
    }
}

multiversion! {
    /// `out[targets[i]] += weights[i] · x[i]` (rows of `dim`) for every `i` with
    /// `targets[i] != u32::MAX`, in increasing `i`: the sparse scatter with one key per
    /// cluster (`k = 1`, e.g. the centroids' sums), one pass over `x` in order.
    ///
    /// # Panics
    /// If `weights` or `x` holds fewer rows than `targets`, or a target row is outside `out`.
    pub(crate) fn scatter_rows<FMA>(
        weights: &[f32],
        x: &[f32],
        dim: usize,
        targets: &[u32],
        out: &mut [f32],
    ) {
        for ((&t, &w), x) in targets.iter().zip(weights).zip(x.chunks_exact(dim)) {
            if t == u32::MAX {
                continue;
            }
            let t = t as usize;
            for (o, &v) in out[t * dim..(t + 1) * dim].iter_mut().zip(x) {
                *o = madd::<FMA>(w, v, *o);
            }
        }
    }
}

multiversion! {
    /// `out[i] = weights[i] · x[sources[i]]` (rows of `dim`) for every `i` with
    /// `sources[i] != u32::MAX`, other rows left as they are: the sparse weighted sum with one
    /// key per cluster (`k = 1`, e.g. clustered attention's broadcast), written in order.
    ///
    /// # Panics
    /// If `weights` or `out` holds fewer rows than `sources`, or a source row is outside `x`.
    pub(crate) fn scale_rows<FMA>(
        weights: &[f32],
        x: &[f32],
        dim: usize,
        sources: &[u32],
        out: &mut [f32],
    ) {
        for ((&s, &w), out) in sources.iter().zip(weights).zip(out.chunks_exact_mut(dim)) {
            if s == u32::MAX {
                continue;
            }
            let s = s as usize;
            for (o, &v) in out.iter_mut().zip(&x[s * dim..(s + 1) * dim]) {
                *o = w * v;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Softmax

/// `e^x` in `f32` to within 2 ulp for `x ∈ [−87, 88]`, 0 below −87 (where `e^x < 1.7·10⁻³⁸`).
///
/// `e^x = 2ⁿ · e^r` with `n = round(x / ln 2)` and `|r| ≤ ln 2 / 2`; `e^r` by the degree-7
/// minimax polynomial of Cephes' `expf` (S. L. Moshier), `ln 2` split in two parts so that
/// `r` is exact (Cody and Waite). Branch-free, so that it vectorises.
#[inline(always)]
fn exp<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2²³: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let clamped = x.clamp(-87.0, 88.0);
    let shifted = clamped * LOG2E + ROUND;
    let n = shifted - ROUND;
    // The low mantissa bits of `shifted` hold n (two's complement): 2ⁿ without a float to
    // integer conversion, which would not vectorise.
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    let r = madd::<FMA>(n, -LN2_LO, madd::<FMA>(n, -LN2_HI, clamped));
    let mut p = 1.987_569_1e-4;
    p = madd::<FMA>(p, r, 1.398_199_9e-3);
    p = madd::<FMA>(p, r, 8.333_452e-3);
    p = madd::<FMA>(p, r, 4.166_579_6e-2);
    p = madd::<FMA>(p, r, 1.666_666_5e-1);
    p = madd::<FMA>(p, r, 0.5);
    let y = madd::<FMA>(p, r * r, r + 1.0);
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    if x < -87.0 { 0.0 } else { y * scale }
}

multiversion! {
    /// The softmax's Jacobian on one part of a row, given the row's log-sum-exp `lse` and
    /// `δ = Σ a ⊙ g` over the whole row (as flash attention's backward pass has them): with
    /// `a = e^(scores − lse)`, the part's weights, `scores ← a` and `grads ← a ⊙ (grads − δ)`.
    pub(crate) fn softmax_backward_part<FMA>(
        scores: &mut [f32],
        grads: &mut [f32],
        lse: f32,
        delta: f32,
    ) {
        let mut chunks = scores.chunks_exact_mut(LANES).zip(grads.chunks_exact_mut(LANES));
        for (s, g) in &mut chunks {
            for l in 0..LANES {
                let a = exp::<FMA>(s[l] - lse);
                s[l] = a;
                g[l] = a * (g[l] - delta);
            }
        }
        let tail = scores.len() - scores.len() % LANES;
        for (s, g) in scores[tail..].iter_mut().zip(&mut grads[tail..]) {
            let a = exp::<FMA>(*s - lse);
            *s = a;
            *g = a * (*g - delta);
        }
    }
}

multiversion! {
    /// Softmax, in place, of every row of `width` values of `rows`:
    /// `x ← e^(x − max) / Σ e^(x − max)`, with `−∞` giving 0. A row whose maximum is not
    /// finite, or that holds a NaN, gives NaN, as the decomposed softmax does.
    pub(crate) fn softmax_rows<FMA>(rows: &mut [f32], width: usize) {
        for row in rows.chunks_exact_mut(width) {
            softmax_scaled::<FMA>(row, 1.0);
        }
    }
}

/// The largest of `init` and the values of `row` (NaNs ignored, as `f32::max` does).
#[inline(always)]
fn row_max(row: &[f32], init: f32) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for chunk in &mut chunks {
        for l in 0..LANES {
            lanes[l] = lanes[l].max(chunk[l]);
        }
    }
    chunks
        .remainder()
        .iter()
        .fold(lane_fold(lanes, f32::max).max(init), |m, &v| m.max(v))
}

/// `lanes` folded by `op` pairwise (half the lanes onto the other half, four times): vector
/// operations instead of a chain of `LANES` dependent ones.
#[inline(always)]
fn lane_fold(mut lanes: [f32; LANES], op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            lanes[l] = op(lanes[l], lanes[l + width]);
        }
        width /= 2;
    }
    lanes[0]
}

/// `Σ_l sums[l]`, added pairwise by [`lane_fold`].
#[inline(always)]
fn lane_sum(sums: [f32; LANES]) -> f32 {
    lane_fold(sums, |a, b| a + b)
}

/// `Σ_r a[r] · b[r]` of two rows of one length, in [`LANES`] partial sums added by
/// [`lane_sum`], then the remainder: a short row's dot product without a chain of dependent
/// multiply-adds.
#[inline(always)]
fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len(), "dot of rows of different lengths");
    let mut sums = [0f32; LANES];
    let (mut a, mut b) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    for (x, y) in (&mut a).zip(&mut b) {
        for l in 0..LANES {
            sums[l] = madd::<FMA>(x[l], y[l], sums[l]);
        }
    }
    let rest = a.remainder().iter().zip(b.remainder());
    rest.fold(lane_sum(sums), |sum, (&x, &y)| madd::<FMA>(x, y, sum))
}

/// `row ← e^(row − max)` in place; returns the sum.
#[inline(always)]
fn exp_sum<const FMA: bool>(row: &mut [f32], max: f32) -> f32 {
    let mut sums = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for l in 0..LANES {
            chunk[l] = exp::<FMA>(chunk[l] - max);
            sums[l] += chunk[l];
        }
    }
    let mut sum = lane_sum(sums);
    for v in chunks.into_remainder() {
        *v = exp::<FMA>(*v - max);
        sum += *v;
    }
    sum
}

/// `row ← factor · e^(row − max) / Σ e^(row − max)` in place, with `−∞` giving 0; a row whose
/// maximum is not finite, or that holds a NaN, becomes NaN.
#[inline(always)]
fn softmax_scaled<const FMA: bool>(row: &mut [f32], factor: f32) {
    let max = row_max(row, f32::NEG_INFINITY);
    if !max.is_finite() {
        row.fill(f32::NAN);
        return;
    }
    let sum = exp_sum::<FMA>(row, max);
    let scale = factor / sum;
    for v in row.iter_mut() {
        *v *= scale;
    }
}

// ---------------------------------------------------------------------------------------------
// Top-k

multiversion! {
    /// Indices of the `out.len()` largest of `scores` in descending order (by
    /// [`f32::total_cmp`]), lower index first among equal scores: one pass keeping a sorted
    /// buffer of the best so far, skipping each block of [`LANES`] scores that holds none
    /// above the current k-th best.
    pub(crate) fn topk_row<FMA, WIDE>(
        scores: &[f32],
        out: &mut [i64],
        best: &mut Vec<(f32, u32)>,
    ) {
        best.clear();
        let _ = offer_scores::<FMA, WIDE>(scores, 0, out.len(), best, &mut Vec::new());
        for (o, e) in out.iter_mut().zip(best.iter()) {
            *o = e.1 as i64;
        }
    }
}

multiversion! {
    /// Offers `scores`, those of keys `offset..offset + scores.len()`, to `best`: the (score,
    /// key) pairs of the `k` highest scores seen so far in descending order (by
    /// [`f32::total_cmp`]), lower key first among equal scores, so that offering a row's
    /// scores in consecutive parts gives the same buffer as [`topk_row`] over the whole row.
    /// Pairs of keys before `offset` that leave the buffer are pushed to `evicted`. Returns
    /// whether any of these keys entered the buffer (it may have left it again).
    pub(crate) fn topk_offer<FMA, WIDE>(
        scores: &[f32],
        offset: usize,
        k: usize,
        best: &mut Vec<(f32, u32)>,
        evicted: &mut Vec<(f32, u32)>,
    ) -> bool {
        offer_scores::<FMA, WIDE>(scores, offset, k, best, evicted)
    }
}

/// Bit `l` set where `chunk[l] < threshold` does not hold: the scores not below the
/// threshold, NaN scores, and every score when the threshold is NaN. One vector comparison
/// (AVX-512: into a mask register; AVX2: two, through their sign bits), where the compiler
/// makes a plain loop build the mask lane by lane.
#[inline(always)]
fn not_below<const FMA: bool, const WIDE: bool>(chunk: &[f32; LANES], threshold: f32) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        if WIDE {
            // SAFETY: `WIDE` is true only in the AVX-512 version (`multiversion!`); the load
            // reads the 16 floats of `chunk`.
            return unsafe {
                let scores = _mm512_loadu_ps(chunk.as_ptr());
                u32::from(_mm512_cmp_ps_mask::<_CMP_NLT_UQ>(
                    scores,
                    _mm512_set1_ps(threshold),
                ))
            };
        }
        if FMA {
            // SAFETY: `FMA` is true only in the AVX2 and AVX-512 versions; the loads read the
            // two halves of `chunk`.
            return unsafe {
                let threshold = _mm256_set1_ps(threshold);
                let half = |at: usize| {
                    let scores = _mm256_loadu_ps(chunk.as_ptr().add(at));
                    _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(scores, threshold)) as u32
                };
                half(0) | half(8) << 8
            };
        }
    }
    let mut mask = 0;
    for (l, &s) in chunk.iter().enumerate() {
        mask |= u32::from(s >= threshold || s.is_nan() || threshold.is_nan()) << l;
    }
    mask
}

/// The body of [`topk_row`] and [`topk_offer`].
#[inline(always)]
fn offer_scores<const FMA: bool, const WIDE: bool>(
    scores: &[f32],
    offset: usize,
    k: usize,
    best: &mut Vec<(f32, u32)>,
    evicted: &mut Vec<(f32, u32)>,
) -> bool {
    use std::cmp::Ordering;
    if k == 0 {
        return false;
    }
    let mut entered = false;
    let mut offer = |best: &mut Vec<(f32, u32)>, i: usize, score: f32| {
        if best.len() == k {
            if score.total_cmp(&best[k - 1].0) != Ordering::Greater {
                return;
            }
            let out = best.pop().expect("k > 0");
            if (out.1 as usize) < offset {
                evicted.push(out);
            }
        }
        let at = best.partition_point(|e| e.0.total_cmp(&score) != Ordering::Less);
        best.insert(at, (score, i as u32));
        entered = true;
    };
    let mut chunks = scores.chunks_exact(LANES);
    for (c, chunk) in (&mut chunks).enumerate() {
        // Once the buffer is full, only the lanes whose score total_cmp could rank above the
        // k-th best (NaN included) are offered, in order; `offer` checks each against the
        // buffer as it is then.
        let mut candidates = u32::MAX >> (32 - LANES);
        if best.len() == k {
            let chunk: &[f32; LANES] = chunk.try_into().expect("LANES scores");
            candidates = not_below::<FMA, WIDE>(chunk, best[k - 1].0);
        }
        while candidates != 0 {
            let l = candidates.trailing_zeros() as usize;
            candidates &= candidates - 1;
            offer(best, offset + c * LANES + l, chunk[l]);
        }
    }
    let tail = offset + scores.len() - chunks.remainder().len();
    for (l, &score) in chunks.remainder().iter().enumerate() {
        offer(best, tail + l, score);
    }
    entered
}

multiversion! {
    /// The online softmax's step over one part of a row (as in flash attention): with `max`
    /// the row's largest score so far, `m = max(max, max(scores))`, replaces `scores` by
    /// `e^(scores − m)` and returns `(m, Σ e^(scores − m))`; the caller rescales what it
    /// accumulated by `e^(max − m)`. A NaN score or an infinite maximum gives NaN sums.
    pub(crate) fn exp_row<FMA>(scores: &mut [f32], max: f32) -> (f32, f32) {
        let max = row_max(scores, max);
        (max, exp_sum::<FMA>(scores, max))
    }
}

multiversion! {
    /// `out += Σ e^(score − max) · x[key]` over the `(score, key)` pairs, `x` holding rows of
    /// `out.len()`: the online softmax's weights of keys added to a row after their part was
    /// done (the centroid attention's keys that left the top-k). The rows are fetched
    /// together first, since they lie anywhere in `x`.
    pub(crate) fn add_weighted_rows<FMA>(
        pairs: &[(f32, u32)],
        max: f32,
        x: &[f32],
        out: &mut [f32],
    ) {
        let width = out.len();
        let row = |key: u32| &x[key as usize * width..(key as usize + 1) * width];
        for &(_, key) in pairs {
            prefetch(row(key));
        }
        for &(score, key) in pairs {
            let weight = exp::<FMA>(score - max);
            for (o, &v) in out.iter_mut().zip(row(key)) {
                *o = madd::<FMA>(weight, v, *o);
            }
        }
    }
}

/// `e^x` as the softmax kernels compute it, for single values.
pub(crate) fn exp_f32(x: f32) -> f32 {
    exp::<false>(x)
}

// ---------------------------------------------------------------------------------------------
// Hashing

multiversion! {
    /// Codes of `n` contiguous query rows of `dim`: bit `b` set when the row's dot product with
    /// column `b` of `planes_t` (`[dim, 32]`) exceeds `thresholds[b]`. Columns and thresholds
    /// of unused bits must be 0 and `+∞`.
    pub(crate) fn hash_rows<FMA>(
        queries: &[f32],
        dim: usize,
        planes_t: &[f32],
        thresholds: &[f32; 32],
        codes: &mut [u32],
    ) {
        let row = |i: usize| &queries[i * dim..(i + 1) * dim];
        let pack = |projections: [&[f32; LANES]; 2]| {
            let mut code = 0u32;
            for (half, p) in projections.iter().enumerate() {
                for l in 0..LANES {
                    let b = half * LANES + l;
                    code |= u32::from(p[l] > thresholds[b]) << b;
                }
            }
            code
        };
        let done = codes.len() / GROUP * GROUP;
        let mut groups = codes.chunks_exact_mut(GROUP);
        for (n, group) in (&mut groups).enumerate() {
            let rows: [&[f32]; GROUP] = std::array::from_fn(|g| row(n * GROUP + g));
            let low = rows_times_block::<FMA, GROUP>(rows, planes_t, 32, 0);
            let high = rows_times_block::<FMA, GROUP>(rows, planes_t, 32, LANES);
            for (g, code) in group.iter_mut().enumerate() {
                *code = pack([&low[g], &high[g]]);
            }
        }
        for (i, code) in codes.iter_mut().enumerate().skip(done) {
            let [low] = rows_times_block::<FMA, 1>([row(i)], planes_t, 32, 0);
            let [high] = rows_times_block::<FMA, 1>([row(i)], planes_t, 32, LANES);
            *code = pack([&low, &high]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every version of the candidate mask (each one the CPU supports, whatever version the
    /// ops dispatch to here) sets exactly the bits of the scores that `s < threshold` does not
    /// hold, on scores and thresholds that include ±0, ±∞, NaN and ties.
    #[test]
    fn not_below_matches_comparison() {
        let special = [
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        let mut state = 7u32;
        let mut next = || {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            state
        };
        #[cfg(target_arch = "x86_64")]
        for (feature, has) in [
            ("AVX2", std::arch::is_x86_feature_detected!("avx2")),
            ("AVX-512", std::arch::is_x86_feature_detected!("avx512f")),
        ] {
            if !has {
                eprintln!("skipped: the {feature} comparison (the CPU has no {feature})");
            }
        }
        for round in 0..500 {
            let chunk: [f32; LANES] = std::array::from_fn(|_| {
                let r = next();
                if r % 5 == 0 {
                    special[(r >> 8) as usize % special.len()]
                } else {
                    ((r >> 8) % 9) as f32 - 4.0
                }
            });
            let threshold = if round % 7 == 0 {
                special[round / 7 % special.len()]
            } else {
                ((next() >> 8) % 9) as f32 - 4.0
            };
            let expected = (0..LANES)
                .filter(|&l| {
                    !matches!(
                        chunk[l].partial_cmp(&threshold),
                        Some(std::cmp::Ordering::Less)
                    )
                })
                .fold(0u32, |mask, l| mask | 1 << l);
            assert_eq!(
                not_below::<false, false>(&chunk, threshold),
                expected,
                "plain loop"
            );
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx2") {
                    let avx2 = not_below::<true, false>(&chunk, threshold);
                    assert_eq!(avx2, expected, "AVX2, {chunk:?} against {threshold}");
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    let avx512 = not_below::<true, true>(&chunk, threshold);
                    assert_eq!(avx512, expected, "AVX-512, {chunk:?} against {threshold}");
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Attention dropout

mod dropout;
pub(crate) use dropout::{dropout_rows, dropout_run};
