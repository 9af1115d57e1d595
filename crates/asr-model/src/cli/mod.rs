//! The commands of `asr`, one file each: its arguments and what it runs.
//!
//! - `corpus.rs`: `asr corpus`, the synthesized corpus.
//! - `manifest.rs`: `asr manifest`, a corpus split from one's own recordings.
//! - `import.rs`: `asr import`, a corpus from an installed game's voice track.
//! - `join.rs`: `asr join`, long-form utterances joined from a corpus.
//! - `train.rs`: `asr train`.
//! - `eval.rs`: `asr eval`, the phone error rates of trained models (the paper's Table 1).
//! - `compare.rs`: `asr compare`, the paper's Table 2 and Figure 1.
//! - `clusters.rs`: `asr clusters`, which steps share a cluster, per layer and head.
//! - `transcribe.rs`: `asr transcribe`, one audio file.
//! - `step_time.rs`: `asr step-time`, the time of a training step per attention.

pub mod clusters;
pub mod compare;
pub mod corpus;
pub mod eval;
pub mod import;
pub mod join;
pub mod manifest;
pub mod step_time;
pub mod train;
pub mod transcribe;

use asr_model::train::TrainingBackend;
use backend_select::{BackendName, BackendTask, run_on};
use burn::tensor::backend::AutodiffBackend;
use clustered_attention::ClusteredAttentionBackend;

/// Runs a command on the backend `name` chosen on the command line.
///
/// # Errors
/// The command's error, or the backend's when it is not compiled in.
pub fn on_backend<T: BackendTask<Output = anyhow::Result<()>>>(
    name: BackendName,
    command: T,
) -> anyhow::Result<()> {
    run_on!(name, command)?
}

/// A command that trains: it runs on `Autodiff<B>` of the backend `B` chosen on the command
/// line ([`on_training_backend`]).
pub trait TrainingTask {
    /// Runs the command on the autodiff backend `A`, named `name`, with its default `device`.
    fn run<A>(self, name: BackendName, device: A::Device) -> anyhow::Result<()>
    where
        A: AutodiffBackend + ClusteredAttentionBackend + TrainingBackend,
        A::InnerBackend: ClusteredAttentionBackend;
}

/// Runs a training command on `Autodiff<B>` of the backend `name` chosen on the command line.
///
/// # Errors
/// The command's error, or the backend's when it is not compiled in.
#[cfg(not(feature = "ddp"))]
pub fn on_training_backend<T: TrainingTask>(name: BackendName, command: T) -> anyhow::Result<()> {
    struct OnAutodiff<T>(T);

    impl<T: TrainingTask> BackendTask for OnAutodiff<T> {
        type Output = anyhow::Result<()>;

        fn run<B: ClusteredAttentionBackend>(
            self,
            name: BackendName,
            device: B::Device,
        ) -> Self::Output {
            self.0.run::<burn::backend::Autodiff<B>>(name, device)
        }
    }

    on_backend(name, OnAutodiff(command))
}

/// Runs a training command on `Autodiff<B>` of the backend `name` chosen on the command line:
/// in a build with the `ddp` feature, a CUDA backend (see `asr_model::train::Strategy::Ddp`).
///
/// # Errors
/// The command's error, or when `name` is not a CUDA backend.
#[cfg(feature = "ddp")]
pub fn on_training_backend<T: TrainingTask>(name: BackendName, command: T) -> anyhow::Result<()> {
    use backend_select::types::{Cuda, CudaUnfused};
    use burn::backend::Autodiff;
    match name {
        BackendName::Cuda => command.run::<Autodiff<Cuda>>(name, Default::default()),
        BackendName::CudaUnfused => command.run::<Autodiff<CudaUnfused>>(name, Default::default()),
        other => anyhow::bail!(
            "--backend {other}: this build of asr has the `ddp` feature, with which Burn 0.21 \
             trains on the CUDA backends alone; build it without `ddp` to train on {other}"
        ),
    }
}
