//! Training-time data augmentation: what makes a model trained on synthesized voices hear
//! real recordings.
//!
//! Every training utterance is altered afresh each time it is batched, in this order:
//!
//! 1. [`Augmentation::Speed`]: speed perturbation by a factor in 0.9–1.1 (tempo, pitch and
//!    formants together; Ko et al., *Audio augmentation for speech recognition*, 2015), by
//!    linear interpolation;
//! 2. [`Augmentation::Reverb`]: convolution with a synthetic room impulse response (a direct
//!    path plus exponentially decaying noise, RT60 0.15–0.6 s);
//! 3. [`Augmentation::BandLimit`]: a low-pass at 3.3–5.5 kHz (telephone to 11 kHz audio);
//! 4. [`Augmentation::Noise`]: white or brown noise at 5–35 dB SNR;
//! 5. [`Augmentation::Quantize`]: a random level, then 8-bit linear or μ-law quantization;
//! 6. [`Augmentation::SpecAugment`]: after the log-mel front end, two frequency masks of up
//!    to 8 bands (of 40) and one time mask of up to 25 frames per second of audio
//!    (Park et al., *SpecAugment*, 2019, policy LB scaled to this front end).
//!
//! Each waveform step fires with its probability ([`WAVE_PROBABILITY`]); SpecAugment always.
//! Steps 2 and 3 share one FFT (realfft).

use rand::{Rng, RngExt, SeedableRng, rngs::Xoshiro256PlusPlus};
use realfft::RealFftPlanner;
use std::str::FromStr;

use crate::audio::SAMPLE_RATE_HZ;
use crate::features::Features;

/// One augmentation of the training pipeline (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Augmentation {
    /// Speed perturbation, factor 0.9–1.1.
    Speed,
    /// Synthetic room reverberation.
    Reverb,
    /// Low-pass at 3.3–5.5 kHz.
    BandLimit,
    /// White or brown noise at 5–35 dB SNR.
    Noise,
    /// 8-bit linear or μ-law quantization at a random level.
    Quantize,
    /// SpecAugment frequency and time masks on the log-mel features.
    SpecAugment,
}

/// Probability that a waveform augmentation is applied to an utterance.
pub const WAVE_PROBABILITY: f64 = 0.5;

impl Augmentation {
    /// All augmentations, in pipeline order.
    pub const ALL: [Augmentation; 6] = [
        Augmentation::Speed,
        Augmentation::Reverb,
        Augmentation::BandLimit,
        Augmentation::Noise,
        Augmentation::Quantize,
        Augmentation::SpecAugment,
    ];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Augmentation::Speed => "speed",
            Augmentation::Reverb => "reverb",
            Augmentation::BandLimit => "band",
            Augmentation::Noise => "noise",
            Augmentation::Quantize => "quantize",
            Augmentation::SpecAugment => "specaugment",
        }
    }
}

impl FromStr for Augmentation {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Self::ALL.iter().map(|a| a.name()).collect();
                format!(
                    "unknown augmentation {s:?}: expected one of {}",
                    names.join(", ")
                )
            })
    }
}

impl std::fmt::Display for Augmentation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The augmentations enabled for a training run (the random source is passed to each call).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AugmentSet {
    enabled: Vec<Augmentation>,
}

impl AugmentSet {
    /// The given augmentations (duplicates are ignored).
    pub fn new(augmentations: &[Augmentation]) -> Self {
        let mut enabled = Vec::new();
        for a in augmentations {
            if !enabled.contains(a) {
                enabled.push(*a);
            }
        }
        Self { enabled }
    }

    /// Whether `augmentation` is enabled.
    pub fn has(&self, augmentation: Augmentation) -> bool {
        self.enabled.contains(&augmentation)
    }

    /// Whether any waveform augmentation (all but SpecAugment) is enabled.
    pub fn alters_waveform(&self) -> bool {
        self.enabled.iter().any(|a| *a != Augmentation::SpecAugment)
    }

    /// Whether nothing is enabled.
    pub fn is_empty(&self) -> bool {
        self.enabled.is_empty()
    }

    /// Applies the enabled waveform augmentations (steps 1–5) to 16 kHz `samples`.
    /// The result has `round(len / factor)` samples under speed perturbation, `len` otherwise.
    pub fn waveform<R: Rng>(&self, samples: &[f32], rng: &mut R) -> Vec<f32> {
        let fire = |a: Augmentation, rng: &mut R| self.has(a) && rng.random_bool(WAVE_PROBABILITY);
        let mut x = if fire(Augmentation::Speed, rng) {
            speed(samples, rng.random_range(0.9..=1.1))
        } else {
            samples.to_vec()
        };
        let rir = fire(Augmentation::Reverb, rng).then(|| {
            let rt60 = rng.random_range(0.15..=0.6);
            let direct_db = rng.random_range(-3.0..=12.0);
            room_impulse_response(rt60, direct_db, rng)
        });
        let cutoff =
            fire(Augmentation::BandLimit, rng).then(|| rng.random_range(3300.0..=5500.0f32));
        if rir.is_some() || cutoff.is_some() {
            x = filter(&x, rir.as_deref(), cutoff);
        }
        if fire(Augmentation::Noise, rng) {
            let snr_db = rng.random_range(5.0..=35.0);
            let brown = rng.random_bool(0.5);
            add_noise(&mut x, snr_db, brown, rng);
        }
        if fire(Augmentation::Quantize, rng) {
            let peak = rng.random_range(0.05..=0.9f32);
            let mu_law = rng.random_bool(0.5);
            quantize_8bit(&mut x, peak, mu_law);
        }
        x
    }

    /// Applies SpecAugment masks (when enabled) to normalised log-mel features: masked
    /// values are set to 0, the features' mean.
    pub fn spec_augment(&self, features: &mut Features, rng: &mut impl Rng) {
        if !self.has(Augmentation::SpecAugment) || features.frames == 0 {
            return;
        }
        let (frames, n_mels) = (features.frames, features.n_mels);
        let max_bands = (n_mels / 5).max(1);
        for _ in 0..2 {
            let width = rng.random_range(0..=max_bands);
            let start = rng.random_range(0..=n_mels - width);
            for t in 0..frames {
                features.data[t * n_mels + start..t * n_mels + start + width].fill(0.0);
            }
        }
        // One mask of up to 25 frames (0.25 s) per second, at most 20 % of the frames.
        let masks = frames.div_ceil(100);
        let max_frames = 25.min(frames / (5 * masks).max(1));
        for _ in 0..masks {
            let width = rng.random_range(0..=max_frames);
            let start = rng.random_range(0..=frames - width);
            features.data[start * n_mels..(start + width) * n_mels].fill(0.0);
        }
    }
}

/// A deterministic random source for utterance `index` of call `call` under `seed`.
pub fn rng_for(seed: u64, call: u64, index: usize) -> Xoshiro256PlusPlus {
    let mix = seed
        ^ call.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (index as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    Xoshiro256PlusPlus::seed_from_u64(mix)
}

/// Speed perturbation: `round(len / factor)` samples, `y[i] = x(i · factor)` by linear
/// interpolation (factor > 1 is faster and higher).
///
/// # Panics
/// When `factor` is not positive and finite.
pub fn speed(samples: &[f32], factor: f64) -> Vec<f32> {
    assert!(
        factor.is_finite() && factor > 0.0,
        "speed factor must be positive and finite, got {factor}"
    );
    let n = (samples.len() as f64 / factor).round() as usize;
    (0..n)
        .map(|i| {
            let t = i as f64 * factor;
            let j = t.floor() as usize;
            let frac = (t - j as f64) as f32;
            let a = samples.get(j).copied().unwrap_or(0.0);
            let b = samples.get(j + 1).copied().unwrap_or(a);
            a + (b - a) * frac
        })
        .collect()
}

/// A synthetic room impulse response at 16 kHz: a unit direct path, then Gaussian noise under
/// an exponential envelope reaching −60 dB at `rt60_s`, starting 2.5 ms later, scaled so that
/// the direct path is `direct_db` above the reverberant energy.
pub fn room_impulse_response(rt60_s: f64, direct_db: f64, rng: &mut impl Rng) -> Vec<f32> {
    let n = (rt60_s * SAMPLE_RATE_HZ as f64).ceil() as usize + 1;
    let delay = SAMPLE_RATE_HZ * 5 / 2000;
    let mut h = vec![0f32; n.max(delay + 2)];
    h[0] = 1.0;
    let decay = 6.9 / (rt60_s * SAMPLE_RATE_HZ as f64);
    let mut energy = 0.0;
    for (i, x) in h.iter_mut().enumerate().skip(delay) {
        let gauss: f64 = {
            // Box–Muller.
            let u1: f64 = rng.random_range(f64::EPSILON..1.0);
            let u2: f64 = rng.random();
            (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
        };
        let v = gauss * (-decay * (i - delay) as f64).exp();
        energy += v * v;
        *x = v as f32;
    }
    let scale = (10f64.powf(-direct_db / 10.0) / energy.max(1e-12)).sqrt() as f32;
    h.iter_mut().skip(delay).for_each(|x| *x *= scale);
    h
}

/// Convolves `samples` with `rir` (if any; the output keeps the input's length) and removes
/// everything above `cutoff_hz` (if any; bins above it are zeroed, with a 200 Hz cosine
/// roll-off below), in one FFT. The level is restored to the input's peak.
pub fn filter(samples: &[f32], rir: Option<&[f32]>, cutoff_hz: Option<f32>) -> Vec<f32> {
    let len = samples.len() + rir.map_or(0, <[f32]>::len);
    let n = len.next_power_of_two().max(2);
    let mut planner = RealFftPlanner::<f32>::new();
    let (forward, inverse) = (planner.plan_fft_forward(n), planner.plan_fft_inverse(n));
    let mut buffer = vec![0f32; n];
    buffer[..samples.len()].copy_from_slice(samples);
    let mut spectrum = forward.make_output_vec();
    forward
        .process(&mut buffer, &mut spectrum)
        .expect("buffers made by the plan");
    if let Some(h) = rir {
        let mut hb = vec![0f32; n];
        hb[..h.len()].copy_from_slice(h);
        let mut hs = forward.make_output_vec();
        forward
            .process(&mut hb, &mut hs)
            .expect("buffers made by the plan");
        spectrum.iter_mut().zip(&hs).for_each(|(x, h)| *x *= h);
    }
    if let Some(cutoff) = cutoff_hz {
        let hz_per_bin = SAMPLE_RATE_HZ as f32 / n as f32;
        let roll_off = 200.0;
        for (k, x) in spectrum.iter_mut().enumerate() {
            let f = k as f32 * hz_per_bin;
            let gain = if f >= cutoff {
                0.0
            } else if f > cutoff - roll_off {
                0.5 + 0.5 * (std::f32::consts::PI * (f - cutoff + roll_off) / roll_off).cos()
            } else {
                1.0
            };
            *x *= gain;
        }
    }
    let mut out = inverse.make_output_vec();
    inverse
        .process(&mut spectrum, &mut out)
        .expect("buffers made by the plan");
    out.truncate(samples.len());
    let peak_in = samples.iter().fold(0f32, |m, x| m.max(x.abs()));
    let peak_out = out.iter().fold(0f32, |m, x| m.max(x.abs()));
    let scale = if peak_out > 0.0 {
        peak_in / peak_out
    } else {
        1.0 / n as f32
    };
    out.iter_mut().for_each(|x| *x *= scale);
    out
}

/// Adds uniform white noise (or brown noise: white noise through a leaky integrator) at
/// `snr_db` below the signal's mean power.
pub fn add_noise(samples: &mut [f32], snr_db: f64, brown: bool, rng: &mut impl Rng) {
    if samples.is_empty() {
        return;
    }
    let mut noise: Vec<f32> = (0..samples.len())
        .map(|_| rng.random_range(-1.0..=1.0f32))
        .collect();
    if brown {
        let mut acc = 0f32;
        for x in noise.iter_mut() {
            acc = 0.995 * acc + *x;
            *x = acc;
        }
    }
    let power = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64;
    let (signal, noise_power) = (power(samples), power(&noise));
    if signal <= 0.0 || noise_power <= 0.0 {
        return;
    }
    let gain = (signal / noise_power / 10f64.powf(snr_db / 10.0)).sqrt() as f32;
    samples
        .iter_mut()
        .zip(&noise)
        .for_each(|(x, n)| *x += gain * n);
}

/// Scales `samples` to the peak `peak`, then quantizes to 8 bits: 255 linear levels, or
/// G.711 μ-law (μ = 255) levels when `mu_law`.
pub fn quantize_8bit(samples: &mut [f32], peak: f32, mu_law: bool) {
    let max = samples.iter().fold(0f32, |m, x| m.max(x.abs()));
    if max <= 0.0 {
        return;
    }
    let scale = peak / max;
    const MU: f32 = 255.0;
    for x in samples.iter_mut() {
        let v = (*x * scale).clamp(-1.0, 1.0);
        *x = if mu_law {
            let y = v.signum() * (1.0 + MU * v.abs()).ln() / (1.0 + MU).ln();
            let q = (y * 127.0).round() / 127.0;
            q.signum() * ((1.0 + MU).powf(q.abs()) - 1.0) / MU
        } else {
            (v * 127.0).round() / 127.0
        };
    }
}
