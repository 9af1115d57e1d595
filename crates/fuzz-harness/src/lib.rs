//! Byte-level fuzzing on the stable toolchain, for the readers of files from outside: seed
//! inputs (real fixtures) are mutated at random with [proptest](mod@proptest) (bit flips,
//! overwritten bytes and 32-bit words, truncations, insertions, copies of a run) and read,
//! each on a thread of its own with a deadline. A target passes when every input gives a value or an error within
//! [`DEADLINE`], without a panic; a test binary that installs [`CappedAllocator`] also fails
//! (aborts) on any allocation over [`ALLOCATION_CAP`], so a length field that sizes a buffer
//! before it is checked against the bytes there shows.
//!
//! `FUZZ_CASES` sets the inputs per target (default 300) and `FUZZ_SEED` the generator's seed
//! (default 0).

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

/// The largest single allocation [`CappedAllocator`] grants: 256 MiB. Seeds are a few hundred
/// kilobytes; a larger request comes from a length field that was not checked.
pub const ALLOCATION_CAP: usize = 256 << 20;

/// A global allocator: the system's, refusing any allocation over [`ALLOCATION_CAP`] (the
/// process then aborts with "memory allocation of N bytes failed"). A fuzz test binary
/// installs it with
/// `#[global_allocator] static ALLOCATOR: CappedAllocator = CappedAllocator;`.
pub struct CappedAllocator;

// SAFETY: every call is forwarded unchanged to `System`, or refused with a null pointer,
// which `GlobalAlloc` allows.
unsafe impl GlobalAlloc for CappedAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOCATION_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOCATION_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOCATION_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// The time one input may take to read (10 s; the seeds read in milliseconds).
pub const DEADLINE: Duration = Duration::from_secs(10);

/// One byte-level change; positions are taken modulo the input's length.
#[derive(Debug, Clone)]
pub enum Mutation {
    /// Flips bit `bit` of the byte at `at`.
    Flip { at: usize, bit: u8 },
    /// Overwrites the byte at `at`.
    Set { at: usize, byte: u8 },
    /// Overwrites the 4 bytes at `at` with `value` (a length or an offset field), big- or
    /// little-endian.
    Word { at: usize, value: u32, big: bool },
    /// Cuts the input at `at`.
    Truncate { at: usize },
    /// Inserts `bytes` before `at`.
    Insert { at: usize, bytes: Vec<u8> },
    /// Copies `len` bytes from `from` over those at `to`.
    Copy { from: usize, to: usize, len: usize },
}

/// A random [`Mutation`]: bit flips most often, truncations, insertions and copies least.
pub fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 0..8u8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        2 => (any::<usize>(), any::<u32>(), any::<bool>())
            .prop_map(|(at, value, big)| Mutation::Word { at, value, big }),
        1 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        1 => (any::<usize>(), vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (any::<usize>(), any::<usize>(), 1..64usize)
            .prop_map(|(from, to, len)| Mutation::Copy { from, to, len }),
    ]
}

/// `seed` with `mutations` applied in order.
pub fn mutate(seed: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    let mut bytes = seed.to_vec();
    for m in mutations {
        let n = bytes.len();
        match m {
            Mutation::Insert { at, bytes: new } => {
                let tail = bytes.split_off(at % (n + 1));
                bytes.extend_from_slice(new);
                bytes.extend(tail);
            }
            _ if n == 0 => {}
            Mutation::Flip { at, bit } => bytes[at % n] ^= 1 << bit,
            Mutation::Set { at, byte } => bytes[at % n] = *byte,
            Mutation::Word { at, value, big } => {
                let word = if *big {
                    value.to_be_bytes()
                } else {
                    value.to_le_bytes()
                };
                let at = at % n;
                let end = (at + 4).min(n);
                bytes[at..end].copy_from_slice(&word[..end - at]);
            }
            Mutation::Truncate { at } => bytes.truncate(at % n),
            Mutation::Copy { from, to, len } => {
                let (from, to) = (from % n, to % n);
                let len = (*len).min(n - from).min(n - to);
                bytes.copy_within(from..from + len, to);
            }
        }
    }
    bytes
}

/// A target's reader of one input, shared with the thread that runs it.
type Reader = Arc<dyn Fn(&[u8]) + Send + Sync>;

/// Reads `input` with `read` on a thread of its own: an error only when it panicked or took
/// longer than [`DEADLINE`] (the thread is then left running, and the target fails).
fn read_within_deadline(input: Vec<u8>, read: Reader) -> Result<(), String> {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        read(&input);
        let _ = done.send(());
    });
    match finished.recv_timeout(DEADLINE) {
        Ok(()) => Ok(()),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err("panicked".into()),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            Err(format!("no result within {DEADLINE:?}"))
        }
    }
}

/// An environment variable's number, or `default`.
fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).map_or(default, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{name}={v:?}: expected a whole number"))
    })
}

/// Runs target `name`: `FUZZ_CASES` inputs (default 300), each a random `seeds[i]` with 1 to 7
/// [`Mutation`]s, read by `read` within [`DEADLINE`]; the stream of inputs is fixed by `name`
/// and `FUZZ_SEED` (default 0).
///
/// # Panics
/// When an input makes `read` panic or overrun the deadline (after shrinking it), naming the
/// input's file: `failures/fuzz-<name>-<hash>.bin`. A test binary passes its
/// `env!("CARGO_TARGET_TMPDIR")` as `failures`.
pub fn fuzz(
    name: &str,
    failures: &Path,
    seeds: Vec<Vec<u8>>,
    read: impl Fn(&[u8]) + Send + Sync + 'static,
) {
    let cases = env_number("FUZZ_CASES", 300);
    let seed = env_number("FUZZ_SEED", 0);
    // One stream per target and seed, the same on every run.
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    for (i, b) in name.bytes().enumerate() {
        key[8 + i % 24] ^= b;
    }
    let config = Config {
        cases: u32::try_from(cases).expect("FUZZ_CASES fits in 32 bits"),
        failure_persistence: None,
        max_shrink_iters: 512,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &key));
    let read: Reader = Arc::new(read);
    let strategy = (0..seeds.len(), vec(mutation(), 1..8));
    let result = runner.run(&strategy, |(which, mutations)| {
        let input = mutate(&seeds[which], &mutations);
        read_within_deadline(input.clone(), read.clone()).map_err(|why| {
            let hash = input.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
                (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
            });
            let path = failures.join(format!("fuzz-{name}-{hash:016x}.bin"));
            let _ = std::fs::write(&path, &input);
            TestCaseError::fail(format!("{why}; the input is in {}", path.display()))
        })
    });
    if let Err(e) = result {
        panic!("fuzz target {name} (FUZZ_SEED={seed}): {e}");
    }
    eprintln!("fuzz target {name}: {cases} inputs (FUZZ_SEED={seed}), none failed");
}
