//! `BackendName::device` gives the device of the backend it names, and refuses one the crate
//! does not compile.

use backend_select::{BackendName, DeviceError};
use burn::tensor::{Device, Tensor};

/// The backend a device's tensors live on, by its Debug form (`Flex`, `NdArray`, ...), which
/// is Burn's, not this crate's.
fn backend_of(device: &Device) -> String {
    format!("{:?}", device.as_dispatch())
}

#[test]
fn gives_the_named_backends_device() {
    let ndarray = BackendName::Ndarray.device().expect("ndarray is compiled");
    assert!(backend_of(&ndarray).contains("NdArray"), "{ndarray:?}");
    let flex = BackendName::Flex.device().expect("flex is compiled");
    assert!(backend_of(&flex).contains("Flex"), "{flex:?}");
    // A tensor made there lives there.
    let x = Tensor::<1>::zeros([2], &flex);
    assert_eq!(x.device(), flex);
}

/// The backends the test crate compiles in are the ones its features name, CPU first.
#[test]
fn lists_the_compiled_backends() {
    let compiled = BackendName::compiled();
    assert_eq!(&compiled[..2], &[BackendName::Ndarray, BackendName::Flex]);
    // A backend is listed exactly when `device` does not refuse it as not compiled in (CUDA
    // may still refuse a machine without the CUDA headers).
    for name in BackendName::ALL {
        match name.device() {
            Err(DeviceError::NotCompiled(refused)) => {
                assert_eq!(refused, name);
                assert!(!compiled.contains(&name), "{name}");
            }
            Ok(_) | Err(DeviceError::CudaHeaders(_)) => {
                assert!(compiled.contains(&name), "{name}")
            }
        }
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn refuses_a_backend_not_compiled_in() {
    let error = BackendName::Cuda.device().unwrap_err();
    assert_eq!(error, DeviceError::NotCompiled(BackendName::Cuda));
    assert_eq!(
        error.to_string(),
        "backend cuda is not compiled into this program: rebuild it with `--features cuda`"
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
