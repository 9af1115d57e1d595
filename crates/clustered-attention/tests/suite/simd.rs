//! Every compiled version of the host ops' vector loops against the same references.
//!
//! The host ops of NdArray and Flex run the best version of their vector loops the CPU has
//! (AVX-512, AVX2 + FMA, or the baseline), so the rest of the suite checks only that one. The
//! test here runs the suite's CPU tests again in child processes of the test binary, with
//! [`SIMD_ENV`] capping the level at each version below this CPU's best.

use clustered_attention::backends::cpu::{SIMD_ENV, SimdLevel, simd_level};

use crate::common::{child_purpose, run_child};

/// What the children this test starts are for.
const PURPOSE: &str = "simd";

/// The levels below the best, with their names in [`SIMD_ENV`].
const LOWER: [(SimdLevel, &str); 2] =
    [(SimdLevel::Avx2, "avx2"), (SimdLevel::Baseline, "baseline")];

/// In the parent: the CPU tests of the suite (every test but the WGPU and CUDA ones) pass
/// with the host ops capped at each level below this CPU's best. In each child: the cap took
/// effect, so the tests there ran that level.
#[test]
fn every_vector_version_passes_the_cpu_tests() {
    if child_purpose().as_deref() == Some(PURPOSE) {
        let cap = std::env::var(SIMD_ENV).expect("the parent sets the cap");
        let (level, _) = LOWER
            .iter()
            .find(|(_, name)| *name == cap)
            .expect("the parent sets a level it knows");
        assert_eq!(simd_level(), *level, "{SIMD_ENV}={cap}");
        return;
    }
    let best = simd_level();
    if best < SimdLevel::Avx512 {
        eprintln!("skipped: the host ops' AVX-512 loops (this CPU's best level is {best:?})");
    }
    for (level, name) in LOWER {
        if level < best {
            eprintln!("the CPU tests with {SIMD_ENV}={name}");
            run_child(
                PURPOSE,
                &["--skip", "wgpu", "--skip", "cuda", "--skip", "gpu::", "-q"],
                &[(SIMD_ENV, name)],
            );
        }
    }
}
