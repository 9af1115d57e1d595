//! A child process under a memory cap, and what its exit says of how it ended.
//!
//! The cap is on the child's data segment (`setrlimit(RLIMIT_DATA)`): on Linux since 4.7 that
//! counts every private writable mapping (the heap, the allocator's arenas, thread stacks), so
//! it bounds the virtual memory the child may map for its data, not the pages it touches (its
//! resident set, which no `setrlimit` caps). Past the cap the kernel refuses the mapping and
//! the allocator returns null. The child's global allocator ([`ExitOnFailure`]) then ends it
//! with the exit status [`ALLOCATION_FAILED`], so the parent tells an allocation failure from a
//! crash by the exit alone ([`Exit`], [`Outcome`]), never by the child's messages.

use std::alloc::{GlobalAlloc, Layout};
use std::fmt;
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};

/// The exit status of a child whose allocation failed (after [`exit_on_allocation_failure`]).
/// No library of the bench exits with it, and it is not a shell's 126–128 + signal.
pub const ALLOCATION_FAILED: i32 = 86;

/// Whether a failed allocation ends the process ([`exit_on_allocation_failure`]).
static EXIT_ON_FAILURE: AtomicBool = AtomicBool::new(false);

/// From now on, an allocation of this process that the global allocator ([`ExitOnFailure`])
/// cannot serve writes "memory allocation of N bytes failed" to standard error and ends the
/// process at once with the exit status [`ALLOCATION_FAILED`] (Unix; elsewhere the failure goes
/// on to Rust's handler, which aborts). For the child processes of a measurement: before, a
/// failed allocation returns null as the standard allocators do (`try_reserve` sees an error,
/// anything else aborts through `handle_alloc_error`).
pub fn exit_on_allocation_failure() {
    EXIT_ON_FAILURE.store(true, Ordering::Relaxed);
}

/// A global allocator that serves every request from `A` and, once
/// [`exit_on_allocation_failure`] has been called, ends the process with the exit status
/// [`ALLOCATION_FAILED`] where `A` returns null. Rust's own handler for a failed allocation
/// (`std::alloc::set_alloc_error_hook`) is unstable, and the default one aborts (`SIGABRT`),
/// which any other abort also raises.
pub struct ExitOnFailure<A>(pub A);

// SAFETY: every method forwards to `A`'s with the caller's arguments and returns what it
// returned (the process ends instead of returning a null that `A` returned), so `A`'s
// guarantees hold.
unsafe impl<A: GlobalAlloc> GlobalAlloc for ExitOnFailure<A> {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's guarantees for `layout`, forwarded.
        checked(unsafe { self.0.alloc(layout) }, layout.size())
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's guarantees for `layout`, forwarded.
        checked(unsafe { self.0.alloc_zeroed(layout) }, layout.size())
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `A` (through this wrapper) with `layout`.
        unsafe { self.0.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from `A` (through this wrapper) with `layout`; the caller's
        // guarantees for `new_size`, forwarded.
        checked(unsafe { self.0.realloc(ptr, layout, new_size) }, new_size)
    }
}

/// `ptr`, where it is not null; at null, [`failed`] first.
#[inline]
fn checked(ptr: *mut u8, size: usize) -> *mut u8 {
    if ptr.is_null() {
        failed(size);
    }
    ptr
}

/// An allocation of `size` bytes failed: after [`exit_on_allocation_failure`], says so on
/// standard error and ends the process with [`ALLOCATION_FAILED`]; returns otherwise. Allocates
/// nothing and takes no lock (it may run inside any allocation, on any thread).
#[cold]
#[inline(never)]
fn failed(size: usize) {
    if !EXIT_ON_FAILURE.load(Ordering::Relaxed) {
        return;
    }
    #[cfg(unix)]
    {
        let mut digits = [0u8; 20];
        let mut start = digits.len();
        let mut rest = size;
        loop {
            start -= 1;
            digits[start] = b'0' + (rest % 10) as u8;
            rest /= 10;
            if rest == 0 {
                break;
            }
        }
        for part in [
            b"memory allocation of ".as_slice(),
            &digits[start..],
            b" bytes failed\n".as_slice(),
        ] {
            write_stderr(part);
        }
        // SAFETY: `_exit` ends the process without running anything of it (no destructor, no
        // `atexit` handler, no flush), which is what a process whose allocator failed can do.
        unsafe { libc::_exit(ALLOCATION_FAILED) }
    }
}

/// Writes `bytes` to standard error with `write(2)`, as far as it goes.
#[cfg(unix)]
fn write_stderr(mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: `bytes` is valid for `bytes.len()` bytes; `write` reads nothing more.
        let written =
            unsafe { libc::write(libc::STDERR_FILENO, bytes.as_ptr().cast(), bytes.len()) };
        let Ok(written @ 1..) = usize::try_from(written) else {
            return;
        };
        bytes = &bytes[written..];
    }
}

/// How a child process ended, from its exit status alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Exit status 0.
    Success,
    /// Exit status [`ALLOCATION_FAILED`]: an allocation failed ([`exit_on_allocation_failure`]).
    AllocationFailed,
    /// Killed by `SIGKILL`: the kernel's out-of-memory killer (or a person, or another program).
    Killed,
    /// Another exit status (a Rust panic's is 101, an error returned from `main` 1).
    Code(i32),
    /// Killed by another signal, by its number: `SIGABRT` (an abort: `std::process::abort`, a
    /// C++ `std::terminate`, a failed allocation of Rust's default handler), `SIGSEGV`, …
    Signal(i32),
}

impl Exit {
    /// The exit of a process from its status.
    pub fn of(status: ExitStatus) -> Self {
        if let Some(code) = status.code() {
            return match code {
                0 => Self::Success,
                ALLOCATION_FAILED => Self::AllocationFailed,
                code => Self::Code(code),
            };
        }
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            if let Some(signal) = status.signal() {
                return if signal == libc::SIGKILL {
                    Self::Killed
                } else {
                    Self::Signal(signal)
                };
            }
        }
        unreachable!("a process that ended has an exit status or a signal: {status}")
    }

    /// Whether the exit says the process ran out of memory: an allocation failed, or the
    /// kernel killed it (`SIGKILL`).
    pub fn out_of_memory(self) -> bool {
        matches!(self, Self::AllocationFailed | Self::Killed)
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Success => write!(f, "exit status 0"),
            Self::AllocationFailed => {
                write!(f, "exit status {ALLOCATION_FAILED}: an allocation failed")
            }
            Self::Killed => write!(f, "killed by signal 9 (SIGKILL)"),
            Self::Code(code) => write!(f, "exit status {code}"),
            Self::Signal(signal) => match signal_name(signal) {
                Some(name) => write!(f, "killed by signal {signal} ({name})"),
                None => write!(f, "killed by signal {signal}"),
            },
        }
    }
}

/// The name of a signal that ends a process, by its number.
#[cfg(unix)]
fn signal_name(signal: i32) -> Option<&'static str> {
    Some(match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        _ => return None,
    })
}

/// The name of a signal: none off Unix.
#[cfg(not(unix))]
fn signal_name(_signal: i32) -> Option<&'static str> {
    None
}

/// Runs `command` to its end, its standard output and error captured, with its data segment
/// capped at `cap` bytes (`setrlimit(RLIMIT_DATA)`, soft and hard limit, set in the child
/// before it runs `command`'s program; Unix only, no cap elsewhere), or uncapped with `None`.
/// Returns how it ended and what it wrote.
///
/// # Errors
/// When the program cannot be started, or the cap cannot be set (the error is the system's
/// from `setrlimit`, e.g. a cap above the hard limit this process inherited).
pub fn run(mut command: Command, cap: Option<u64>) -> Result<(Exit, Output)> {
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    #[cfg(unix)]
    if let Some(cap) = cap {
        use std::os::unix::process::CommandExt;
        let cap = cap as libc::rlim_t;
        // SAFETY: between fork and exec the closure calls `setrlimit` alone, which is
        // async-signal-safe and allocates nothing.
        unsafe {
            command.pre_exec(move || {
                let limit = libc::rlimit {
                    rlim_cur: cap,
                    rlim_max: cap,
                };
                if libc::setrlimit(libc::RLIMIT_DATA, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    #[cfg(not(unix))]
    let _ = cap;
    let program = command.get_program().to_string_lossy().into_owned();
    let output = command
        .output()
        .with_context(|| format!("running {program} as a child measurement"))?;
    Ok((Exit::of(output.status), output))
}

/// What a child measurement came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It exited with status 0: its standard output holds its report.
    Reported,
    /// Capped, it ran out of memory ([`Exit::out_of_memory`]): an allocation failed, or it was
    /// killed by `SIGKILL`.
    OverCap(Exit),
    /// Uncapped (CUDA), it failed and its standard error says that an allocation of the
    /// device's memory failed ([`device_out_of_memory`]): the one outcome read from the
    /// child's messages, since the device's allocator reports its failures as errors and
    /// panics of its own.
    OverDeviceMemory(Exit),
    /// It failed otherwise: how it ended, and the last line it wrote to standard error
    /// ("no message" where there is none).
    Crashed(Exit, String),
}

impl Outcome {
    /// The outcome of a child that ended with `exit` after writing `stderr`, run under a cap
    /// ([`run`] with `Some`) where `capped`.
    pub fn of(exit: Exit, stderr: &str, capped: bool) -> Self {
        if exit == Exit::Success {
            Self::Reported
        } else if capped && exit.out_of_memory() {
            Self::OverCap(exit)
        } else if !capped && device_out_of_memory(stderr) {
            Self::OverDeviceMemory(exit)
        } else {
            let last = stderr
                .lines()
                .rev()
                .find(|line| !line.trim().is_empty())
                .unwrap_or("no message");
            Self::Crashed(exit, last.trim().to_string())
        }
    }
}

/// Whether a child's standard error says that an allocation of the device's memory failed:
/// CubeCL's pools ("out of device memory allocating …", "An out-of-memory error happened
/// during launch") or the CUDA driver (`CUDA_ERROR_OUT_OF_MEMORY`).
pub fn device_out_of_memory(stderr: &str) -> bool {
    let stderr = stderr.to_lowercase();
    [
        "out of memory",
        "out of device memory",
        "out-of-memory",
        "outofmemory",
        "cuda_error_out_of_memory",
    ]
    .iter()
    .any(|needle| stderr.contains(needle))
}

/// Child processes of this test binary, run through [`run`] under a cap and judged by
/// [`Outcome::of`] as the bench's encoder children are: one allocates past the cap, the others
/// end otherwise.
#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Set in a child of the test binary to what [`probe`] does there.
    const PROBE: &str = "BENCH_TEST_PROBE";

    /// The children's data-segment cap, bytes.
    const CAP: u64 = 256 << 20;

    /// What the allocating probe allocates at a time, bytes.
    const CHUNK: usize = 16 << 20;

    /// Runs [`probe`] in a child of this test binary doing `what`, under [`CAP`]; returns its
    /// outcome and its standard error.
    fn run_probe(what: &str) -> (Outcome, String) {
        let mut command = Command::new(std::env::current_exe().expect("the test binary's path"));
        command
            .args([
                "--exact",
                "capped::tests::probe",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(PROBE, what);
        let (exit, output) = run(command, Some(CAP)).expect("the test binary runs");
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        (Outcome::of(exit, &stderr, true), stderr)
    }

    /// In a child of [`run_probe`], does what [`PROBE`] says, as a measurement's child
    /// ([`exit_on_allocation_failure`]); nothing in the test run itself.
    #[test]
    fn probe() {
        let Ok(what) = std::env::var(PROBE) else {
            return;
        };
        exit_on_allocation_failure();
        match what.as_str() {
            "allocate" => {
                let mut limit = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                // SAFETY: `getrlimit` writes the limit into `limit`.
                assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_DATA, &mut limit) }, 0);
                assert_ne!(limit.rlim_cur, libc::RLIM_INFINITY, "no data-segment cap");
                // 16 MiB at a time, every page written, up to twice the cap: well before
                // that, an allocation fails and the process ends.
                let mut chunks = Vec::new();
                while (chunks.len() * CHUNK) as u64 <= 2 * limit.rlim_cur {
                    chunks.push(std::hint::black_box(vec![1u8; CHUNK]));
                }
                panic!(
                    "allocated {} MiB under a data-segment cap of {} MiB",
                    (chunks.len() * CHUNK) >> 20,
                    limit.rlim_cur >> 20
                );
            }
            "panic" => panic!("a probe's deliberate panic"),
            "abort" => {
                // No core dump of a deliberate abort.
                let off: libc::c_ulong = 0;
                // SAFETY: `prctl(PR_SET_DUMPABLE, 0)` changes this process's flag alone.
                unsafe { libc::prctl(libc::PR_SET_DUMPABLE, off) };
                std::process::abort()
            }
            "sigkill" => {
                // SAFETY: sends SIGKILL to this process, which ends it.
                unsafe { libc::raise(libc::SIGKILL) };
                unreachable!("SIGKILL ends the process");
            }
            other => panic!("unknown probe {other:?}"),
        }
    }

    #[test]
    fn allocation_past_the_cap_is_over_the_cap() {
        let (outcome, stderr) = run_probe("allocate");
        assert_eq!(
            outcome,
            Outcome::OverCap(Exit::AllocationFailed),
            "standard error: {stderr}"
        );
        assert!(
            stderr.contains("memory allocation of "),
            "standard error: {stderr}"
        );
    }

    #[test]
    fn sigkill_is_over_the_cap() {
        let (outcome, stderr) = run_probe("sigkill");
        assert_eq!(
            outcome,
            Outcome::OverCap(Exit::Killed),
            "standard error: {stderr}"
        );
    }

    #[test]
    fn panic_is_a_crash() {
        let (outcome, stderr) = run_probe("panic");
        assert!(
            matches!(outcome, Outcome::Crashed(Exit::Code(101), _)),
            "{outcome:?}, standard error: {stderr}"
        );
        assert!(
            stderr.contains("a probe's deliberate panic"),
            "standard error: {stderr}"
        );
    }

    #[test]
    fn abort_without_allocation_failure_is_a_crash() {
        let (outcome, stderr) = run_probe("abort");
        let Outcome::Crashed(exit, _) = &outcome else {
            panic!("{outcome:?}, standard error: {stderr}");
        };
        assert_eq!(
            *exit,
            Exit::Signal(libc::SIGABRT),
            "standard error: {stderr}"
        );
        assert_eq!(exit.to_string(), "killed by signal 6 (SIGABRT)");
    }

    /// Without a cap, an out-of-memory exit is a crash and only the messages can say the
    /// device's memory ran out; under a cap, the messages say nothing.
    #[test]
    fn messages_count_for_the_device_memory_alone() {
        assert_eq!(
            Outcome::of(Exit::Code(101), "x\nCUDA_ERROR_OUT_OF_MEMORY\n", false),
            Outcome::OverDeviceMemory(Exit::Code(101))
        );
        assert_eq!(
            Outcome::of(Exit::Killed, "", false),
            Outcome::Crashed(Exit::Killed, "no message".to_string())
        );
        // Capped, the messages do not count.
        assert_eq!(
            Outcome::of(Exit::Code(101), "out of memory\n", true),
            Outcome::Crashed(Exit::Code(101), "out of memory".to_string())
        );
    }
}
