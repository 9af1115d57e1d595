//! `run_on!` runs a task on the backend it names, and refuses one the crate does not compile.

use backend_select::{BackendName, BackendTask, NotCompiled, compiled_backends, run_on};
use clustered_attention::ClusteredAttentionBackend;

/// Returns the name of the backend type it runs on and the name it was given.
struct TypeName;

impl BackendTask for TypeName {
    type Output = (&'static str, BackendName);

    fn run<B: ClusteredAttentionBackend>(self, name: BackendName, _: B::Device) -> Self::Output {
        (std::any::type_name::<B>(), name)
    }
}

#[test]
fn runs_on_the_named_backend() {
    let (ndarray, name) = run_on!(BackendName::Ndarray, TypeName).expect("ndarray is compiled");
    assert!(ndarray.contains("NdArray"), "ran on {ndarray}");
    assert_eq!(name, BackendName::Ndarray);
    let (flex, name) = run_on!(BackendName::Flex, TypeName).expect("flex is compiled");
    assert!(flex.contains("Flex"), "ran on {flex}");
    assert_eq!(name, BackendName::Flex);
}

/// The backends the test crate compiles in are the ones its features name, CPU first.
#[test]
fn lists_the_compiled_backends() {
    let compiled = compiled_backends!();
    assert_eq!(&compiled[..2], &[BackendName::Ndarray, BackendName::Flex]);
    for name in &compiled {
        assert!(
            run_on!(*name, TypeName).is_ok(),
            "{name} is listed but not run"
        );
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn refuses_a_backend_not_compiled_in() {
    let error = run_on!(BackendName::CudaUnfused, TypeName).unwrap_err();
    assert_eq!(error, NotCompiled(BackendName::CudaUnfused));
    assert_eq!(
        error.to_string(),
        "backend cuda-unfused is not compiled into this program: rebuild it with `--features cuda`"
    );
}

/// The command-line names parse back to the same backend.
#[test]
fn names_round_trip_through_clap() {
    use clap::ValueEnum;
    for &name in BackendName::value_variants() {
        assert_eq!(BackendName::from_str(name.name(), false), Ok(name));
    }
}
