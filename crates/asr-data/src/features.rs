//! Log-mel filterbank features, computed on the host.
//!
//! Framing without centring (frame `t` covers samples `t·hop .. t·hop + win_length`), a periodic
//! Hann window, the power spectrum of an `n_fft`-point real FFT (`realfft`), a bank of
//! triangular mel filters on the Slaney mel scale with Slaney area normalisation (Slaney,
//! *Auditory Toolbox*, 1998; librosa's default), the natural log with a floor, and per-utterance
//! mean/variance normalisation of each band.

use std::sync::Arc;

use burn::config::Config;
use realfft::{RealFftPlanner, RealToComplex};

/// Settings of the log-mel front end (all sizes in samples).
#[derive(Config, Debug, PartialEq)]
pub struct LogMelConfig {
    /// Sample rate of the audio, in Hz.
    #[config(default = 16000)]
    pub sample_rate_hz: usize,
    /// FFT size (400 = 25 ms at 16 kHz).
    #[config(default = 400)]
    pub n_fft: usize,
    /// Window length (25 ms at 16 kHz); at most `n_fft`.
    #[config(default = 400)]
    pub win_length: usize,
    /// Hop between frames (10 ms at 16 kHz).
    #[config(default = 160)]
    pub hop_length: usize,
    /// Number of mel bands.
    #[config(default = 40)]
    pub n_mels: usize,
    /// Lowest filter edge, in Hz.
    #[config(default = 0.0)]
    pub f_min_hz: f64,
    /// Highest filter edge, in Hz (`None` = Nyquist).
    #[config(default = "None")]
    pub f_max_hz: Option<f64>,
    /// Floor applied to the mel power before the log.
    #[config(default = 1e-10)]
    pub log_floor: f64,
}

/// Hz → mel on the Slaney scale: linear below 1 kHz (3 mel per 200 Hz), logarithmic above.
pub fn hz_to_mel(hz: f64) -> f64 {
    let (f_sp, min_log_hz) = (200.0 / 3.0, 1000.0);
    let min_log_mel = min_log_hz / f_sp;
    let log_step = 6.4f64.ln() / 27.0;
    if hz >= min_log_hz {
        min_log_mel + (hz / min_log_hz).ln() / log_step
    } else {
        hz / f_sp
    }
}

/// Mel → Hz on the Slaney scale (inverse of [`hz_to_mel`]).
pub fn mel_to_hz(mel: f64) -> f64 {
    let (f_sp, min_log_hz) = (200.0 / 3.0, 1000.0);
    let min_log_mel = min_log_hz / f_sp;
    let log_step = 6.4f64.ln() / 27.0;
    if mel >= min_log_mel {
        min_log_hz * (log_step * (mel - min_log_mel)).exp()
    } else {
        f_sp * mel
    }
}

/// The log-mel front end: window, FFT plan and filterbank, built once.
pub struct LogMel {
    config: LogMelConfig,
    window: Vec<f32>,
    /// `[n_mels, n_fft / 2 + 1]`, row-major.
    filterbank: Vec<f32>,
    /// Per mel band, the FFT bins where its filter is nonzero (the others add nothing).
    supports: Vec<std::ops::Range<usize>>,
    fft: Arc<dyn RealToComplex<f32>>,
}

impl std::fmt::Debug for LogMel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogMel")
            .field("config", &self.config)
            .finish()
    }
}

/// Log-mel features of one utterance: `[frames, n_mels]`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Features {
    /// Number of frames.
    pub frames: usize,
    /// Number of mel bands.
    pub n_mels: usize,
    /// The values, frame after frame.
    pub data: Vec<f32>,
}

impl LogMel {
    /// Builds the front end.
    ///
    /// # Panics
    /// When `win_length` is 0 or exceeds `n_fft`, `hop_length` or `n_mels` is 0, or the
    /// filter edges are not `0 ≤ f_min_hz < f_max_hz ≤ sample_rate_hz / 2`.
    pub fn new(config: LogMelConfig) -> Self {
        assert!(
            config.win_length > 0 && config.win_length <= config.n_fft,
            "win_length ({}) must be in 1..=n_fft ({})",
            config.win_length,
            config.n_fft
        );
        assert!(config.hop_length > 0, "hop_length must be positive");
        assert!(config.n_mels > 0, "n_mels must be positive");
        let nyquist = config.sample_rate_hz as f64 / 2.0;
        let f_max = config.f_max_hz.unwrap_or(nyquist);
        assert!(
            0.0 <= config.f_min_hz && config.f_min_hz < f_max && f_max <= nyquist,
            "filter edges f_min_hz = {} and f_max_hz = {f_max} must satisfy 0 ≤ f_min_hz < f_max_hz ≤ {nyquist}",
            config.f_min_hz
        );
        // Periodic Hann window, centred in the FFT frame when shorter.
        let n = config.win_length;
        let window = (0..n)
            .map(|i| (0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / n as f64).cos()) as f32)
            .collect();
        let bins = config.n_fft / 2 + 1;
        let fft_hz: Vec<f64> = (0..bins)
            .map(|k| k as f64 * config.sample_rate_hz as f64 / config.n_fft as f64)
            .collect();
        let (mel_min, mel_max) = (hz_to_mel(config.f_min_hz), hz_to_mel(f_max));
        let edges: Vec<f64> = (0..config.n_mels + 2)
            .map(|i| {
                mel_to_hz(mel_min + (mel_max - mel_min) * i as f64 / (config.n_mels + 1) as f64)
            })
            .collect();
        let mut filterbank = vec![0f32; config.n_mels * bins];
        for m in 0..config.n_mels {
            let (lo, centre, hi) = (edges[m], edges[m + 1], edges[m + 2]);
            let norm = 2.0 / (hi - lo);
            for (k, &f) in fft_hz.iter().enumerate() {
                let rising = (f - lo) / (centre - lo);
                let falling = (hi - f) / (hi - centre);
                filterbank[m * bins + k] = (rising.min(falling).max(0.0) * norm) as f32;
            }
        }
        let supports = filterbank
            .chunks(bins)
            .map(|row| {
                let first = row.iter().position(|&w| w != 0.0).unwrap_or(0);
                let last = row.iter().rposition(|&w| w != 0.0).map_or(first, |k| k + 1);
                first..last
            })
            .collect();
        let fft = RealFftPlanner::<f32>::new().plan_fft_forward(config.n_fft);
        Self {
            config,
            window,
            filterbank,
            supports,
            fft,
        }
    }

    /// The settings.
    pub fn config(&self) -> &LogMelConfig {
        &self.config
    }

    /// The filterbank, `[n_mels, n_fft / 2 + 1]` row-major.
    pub fn filterbank(&self) -> &[f32] {
        &self.filterbank
    }

    /// Number of frames of `n_samples` samples: `1 + (n_samples − win_length) / hop_length`,
    /// and 1 for a signal shorter than a window (zero-padded).
    pub fn n_frames(&self, n_samples: usize) -> usize {
        1 + n_samples.saturating_sub(self.config.win_length) / self.config.hop_length
    }

    /// Mel power spectrogram (before the log): `[frames, n_mels]` row-major.
    pub fn mel_power(&self, samples: &[f32]) -> Vec<f32> {
        let c = &self.config;
        let bins = c.n_fft / 2 + 1;
        let frames = self.n_frames(samples.len());
        let offset = (c.n_fft - c.win_length) / 2;
        let mut input = self.fft.make_input_vec();
        let mut spectrum = self.fft.make_output_vec();
        let mut scratch = self.fft.make_scratch_vec();
        let mut power = vec![0f32; bins];
        let mut out = vec![0f32; frames * c.n_mels];
        for t in 0..frames {
            input.iter_mut().for_each(|x| *x = 0.0);
            let start = t * c.hop_length;
            for (i, w) in self.window.iter().enumerate() {
                input[offset + i] = samples.get(start + i).copied().unwrap_or(0.0) * w;
            }
            self.fft
                .process_with_scratch(&mut input, &mut spectrum, &mut scratch)
                .expect("buffers made by the FFT plan have its sizes");
            for (p, z) in power.iter_mut().zip(&spectrum) {
                *p = z.norm_sqr();
            }
            for (m, support) in self.supports.iter().enumerate() {
                let row = &self.filterbank[m * bins..(m + 1) * bins];
                out[t * c.n_mels + m] = row[support.clone()]
                    .iter()
                    .zip(&power[support.clone()])
                    .map(|(w, p)| w * p)
                    .sum();
            }
        }
        out
    }

    /// Log-mel features with per-utterance mean/variance normalisation of each band:
    /// `ln(max(mel_power, log_floor))`, then `(x − mean) / sqrt(var + 1e-5)` over frames.
    pub fn features(&self, samples: &[f32]) -> Features {
        let n_mels = self.config.n_mels;
        let mut data = self.mel_power(samples);
        let floor = self.config.log_floor as f32;
        data.iter_mut().for_each(|x| *x = x.max(floor).ln());
        let frames = data.len() / n_mels;
        for m in 0..n_mels {
            let mean = (0..frames)
                .map(|t| data[t * n_mels + m] as f64)
                .sum::<f64>()
                / frames as f64;
            let var = (0..frames)
                .map(|t| (data[t * n_mels + m] as f64 - mean).powi(2))
                .sum::<f64>()
                / frames as f64;
            let inv = 1.0 / (var + 1e-5).sqrt();
            for t in 0..frames {
                let x = &mut data[t * n_mels + m];
                *x = ((*x as f64 - mean) * inv) as f32;
            }
        }
        Features {
            frames,
            n_mels,
            data,
        }
    }
}
