//! burn-train's distributed data parallel on CUDA (`--strategy ddp`): compiled only with the
//! `ddp` feature (which turns CUDA on), and run on a machine with a GPU:
//! `cargo test -p asr-model --no-default-features --features ddp --test ddp`.
#![cfg(feature = "ddp")]

mod common;

use asr_model::train::Strategy;
use burn::tensor::{Device, DeviceType};
use common::data_parallel_against_one_device;

/// DDP on every CUDA device of the machine (at least one) ends two steps with the same
/// weights as one device on a batch of as many utterances: with one device this checks the
/// plumbing (a one-member all-reduce, the schedule, the loss weight), with several the
/// all-reduce itself. To 1e-5, as the multi-device test on the CPU.
#[test]
fn ddp_trains_as_one_device_on_the_whole_batch() {
    let devices: Vec<Device> = Device::enumerate(DeviceType::Cuda).into_vec();
    let count = devices.len();
    assert!(count >= 1, "no CUDA device: this test needs one");
    let run = data_parallel_against_one_device("ddp", &devices, Strategy::Ddp);
    eprintln!(
        "ddp on {count} device(s): largest difference {}, largest change {}",
        run.worst, run.moved
    );
    assert!(run.worst <= 1e-5, "largest difference {}", run.worst);
    assert!(run.moved > 1e-3, "largest change {}", run.moved);
}
