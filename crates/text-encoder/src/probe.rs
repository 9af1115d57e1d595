//! A logistic-regression probe on sentence embeddings (the downstream task of the
//! approximation experiment).

use burn::module::Module;
use burn::nn::loss::BinaryCrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};

/// Training settings of [`LinearProbe::fit`].
#[derive(Debug, Clone, Copy)]
pub struct ProbeOptions {
    /// Full-batch Adam steps.
    pub steps: usize,
    /// Adam learning rate.
    pub learning_rate: f64,
    /// L2 penalty (Adam's weight decay; burn-optim applies it to the bias too).
    pub weight_decay: f32,
    /// Seed of the initial weights.
    pub seed: u64,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        Self {
            steps: 500,
            learning_rate: 1e-2,
            weight_decay: 1e-3,
            seed: 0,
        }
    }
}

/// Logistic regression on standardised features: `p(positive) = σ(w · (x − μ) / σ + b)`.
#[derive(Debug, Clone)]
pub struct LinearProbe {
    /// Per-feature mean of the training features.
    pub mean: Vec<f32>,
    /// Per-feature standard deviation of the training features (at least 1e-6).
    pub std: Vec<f32>,
    /// Weights `w`.
    pub weights: Vec<f32>,
    /// Bias `b`.
    pub bias: f32,
}

impl LinearProbe {
    /// Fits the probe by minimising the binary cross-entropy (burn-nn) with Adam (burn-optim)
    /// on the whole training set, on `device` with autodiff.
    ///
    /// # Panics
    /// If `features` is empty, its rows differ in length, or `labels` has another length.
    pub fn fit(
        features: &[Vec<f32>],
        labels: &[bool],
        options: ProbeOptions,
        device: &Device,
    ) -> Self {
        assert!(!features.is_empty(), "no training features");
        assert_eq!(
            features.len(),
            labels.len(),
            "features ({}) and labels ({}) must pair up",
            features.len(),
            labels.len()
        );
        let device = &device.clone().autodiff();
        let d = features[0].len();
        assert!(
            features.iter().all(|row| row.len() == d),
            "feature rows must all have {d} values"
        );
        let n = features.len();
        let mut mean = vec![0.0f64; d];
        for row in features {
            for (m, &x) in mean.iter_mut().zip(row) {
                *m += x as f64 / n as f64;
            }
        }
        let mut var = vec![0.0f64; d];
        for row in features {
            for ((v, &x), m) in var.iter_mut().zip(row).zip(&mean) {
                *v += (x as f64 - m).powi(2) / n as f64;
            }
        }
        let mean: Vec<f32> = mean.iter().map(|&m| m as f32).collect();
        let std: Vec<f32> = var.iter().map(|&v| (v.sqrt() as f32).max(1e-6)).collect();
        let standardised: Vec<f32> = features
            .iter()
            .flat_map(|row| {
                row.iter()
                    .zip(&mean)
                    .zip(&std)
                    .map(|((&x, &m), &s)| (x - m) / s)
            })
            .collect();
        let x = Tensor::<2>::from_data(TensorData::new(standardised, [n, d]), device);
        let targets: Vec<i64> = labels.iter().map(|&l| l as i64).collect();
        let y = Tensor::<1, Int>::from_data(TensorData::new(targets, [n]), device);

        device.seed(options.seed);
        let mut model: Linear = LinearConfig::new(d, 1).init(device);
        let loss = BinaryCrossEntropyLossConfig::new()
            .with_logits(true)
            .init(device);
        let mut optimizer = AdamConfig::new()
            .with_weight_decay(Some(WeightDecayConfig::new(options.weight_decay)))
            .init();
        for _ in 0..options.steps {
            let logits = model.forward(x.clone()).reshape([n]);
            let grads = loss.forward(logits, y.clone()).backward();
            let grads = GradientsParams::from_grads(grads, &model);
            model = optimizer.step(options.learning_rate, model, grads);
        }
        let model = model.valid();
        let weights = model
            .weight
            .val()
            .into_data()
            .convert::<f32>()
            .try_to_vec()
            .expect("f32");
        let bias = model
            .bias
            .expect("Linear has a bias")
            .val()
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .expect("f32")[0];
        Self {
            mean,
            std,
            weights,
            bias,
        }
    }

    /// The logit `w · (x − μ) / σ + b`.
    ///
    /// # Panics
    /// If `features` has another length than the training features.
    pub fn logit(&self, features: &[f32]) -> f32 {
        assert_eq!(
            features.len(),
            self.weights.len(),
            "features of length {} for a probe of {}",
            features.len(),
            self.weights.len()
        );
        features
            .iter()
            .zip(&self.mean)
            .zip(&self.std)
            .zip(&self.weights)
            .map(|(((&x, &m), &s), &w)| (x - m) / s * w)
            .sum::<f32>()
            + self.bias
    }

    /// Fraction of `features` whose predicted label (`logit > 0`) equals `labels`.
    ///
    /// # Panics
    /// If the lengths differ, or as [`Self::logit`].
    pub fn accuracy(&self, features: &[Vec<f32>], labels: &[bool]) -> f64 {
        assert_eq!(
            features.len(),
            labels.len(),
            "features and labels must pair up"
        );
        let correct = features
            .iter()
            .zip(labels)
            .filter(|(row, label)| (self.logit(row) > 0.0) == **label)
            .count();
        correct as f64 / features.len().max(1) as f64
    }
}
