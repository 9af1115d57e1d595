//! What the `cuda` feature needs at run time, and a check of it that a program can make before
//! the first kernel.
//!
//! With the `cuda` feature the crate's CubeCL kernels, and Burn's, are compiled to CUDA C++ and
//! handed to NVRTC at their first launch (cubecl's `cuda-cpp`). Besides an NVIDIA GPU, the
//! machine needs:
//!
//! - the NVIDIA driver (`libcuda.so.1`), for CUDA 13 (driver 580 or later);
//! - NVRTC (`libnvrtc.so`, and its `libnvrtc-builtins.so`) where the loader finds it: the CUDA
//!   toolkit's, or PyPI's `nvidia-cuda-nvrtc` (which PyTorch installs), its `lib/` folder on
//!   `LD_LIBRARY_PATH`;
//! - the CUDA headers the kernels include (`cuda_fp16.h`, `cuda_bf16.h`, `mma.h` and what they
//!   include) under `$CUDA_PATH/include`: cubecl-cuda 0.11.3 takes `CUDA_PATH`, else
//!   `/usr/local/cuda`, else `/opt/cuda`, else `/usr` where `/usr/bin/nvcc` exists, and panics
//!   ("CUDA installation not found") at the first kernel when there is none. NVRTC 12.9 and
//!   13 have no built-in `cuda_fp16.h`: without the headers every kernel fails to compile. The
//!   toolkit has them; without it, PyPI's `nvidia-cuda-runtime`, `nvidia-cuda-crt` and
//!   `nvidia-cuda-cccl` install a tree that serves as `CUDA_PATH` (their `nvidia/cu13` folder).
//!
//! [`toolkit`] checks the last point as cubecl-cuda will search, so that a program can fail
//! with an error naming what is missing instead of panicking inside CubeCL; the workspace's
//! programs call it when `--backend cuda` is chosen. The driver and NVRTC are loaded by CubeCL
//! itself when the device is first used.

use std::path::PathBuf;

/// A header every kernel source includes (the half-precision types).
const PROBE_HEADER: &str = "cuda_fp16.h";

/// Where the CUDA headers are, as cubecl-cuda 0.11.3 will look for them (its
/// `install::cuda_path`, called here): the folder it will use as `CUDA_PATH`, whose `include/`
/// holds `cuda_fp16.h`.
///
/// # Errors
/// [`ToolkitError::NotFound`] when cubecl-cuda finds no CUDA installation (no `CUDA_PATH`,
/// `/usr/local/cuda`, `/opt/cuda` or `/usr/bin/nvcc`: it would panic at the first kernel),
/// [`ToolkitError::NoHeaders`] when the folder it takes has no `include/cuda_fp16.h` (every
/// kernel would fail to compile).
pub fn toolkit() -> Result<PathBuf, ToolkitError> {
    let cuda_path = cubecl::cuda::install::cuda_path().ok_or(ToolkitError::NotFound)?;
    if cuda_path.join("include").join(PROBE_HEADER).is_file() {
        Ok(cuda_path)
    } else {
        Err(ToolkitError::NoHeaders(cuda_path))
    }
}

/// Why [`toolkit`] found no CUDA headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolkitError {
    /// No `CUDA_PATH`, `/usr/local/cuda`, `/opt/cuda` or `/usr/bin/nvcc`.
    NotFound,
    /// The folder cubecl-cuda would use as `CUDA_PATH` has no `include/cuda_fp16.h`.
    NoHeaders(PathBuf),
}

impl core::fmt::Display for ToolkitError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NotFound => write!(
                f,
                "no CUDA installation for NVRTC's headers: set CUDA_PATH to a folder whose \
                 include/ holds {PROBE_HEADER} (the CUDA toolkit, or the nvidia/cu13 folder of \
                 PyPI's nvidia-cuda-runtime, nvidia-cuda-crt and nvidia-cuda-cccl); \
                 /usr/local/cuda, /opt/cuda and /usr/bin/nvcc do not exist"
            ),
            Self::NoHeaders(path) => write!(
                f,
                "CUDA_PATH {} (as the CUDA runtime would take it) has no include/{PROBE_HEADER}: \
                 NVRTC cannot compile the kernels; set CUDA_PATH to a folder with the CUDA \
                 headers (the CUDA toolkit, or the nvidia/cu13 folder of PyPI's \
                 nvidia-cuda-runtime, nvidia-cuda-crt and nvidia-cuda-cccl)",
                path.display()
            ),
        }
    }
}

impl std::error::Error for ToolkitError {}
