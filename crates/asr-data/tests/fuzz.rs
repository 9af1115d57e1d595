//! Fuzzing of the readers of bytes from outside: the RNC unpacker, *Beneath a Steel Sky*'s
//! `sky.dnr` index and `sky.dsk` files (texts and voices), *Flight of the Amazon Queen*'s
//! `queen.1c` bundle (its table, cutscenes, dialogues and voices), corpus manifests, and the
//! audio front door (WAV, FLAC, MP3 through symphonia).
//!
//! Each target starts from seed inputs, the fixtures the tests build from the formats'
//! descriptions (`common/`), applies random byte-level mutations (proptest: bit flips,
//! overwritten bytes and 32-bit words, truncations, insertions, copies of a run) and reads
//! the result. A target passes when every input gives a value or an error within
//! [`DEADLINE`], without a panic, and without an allocation over [`ALLOCATION_CAP`] (this
//! binary's global allocator refuses one, which aborts the process: a reader must check a
//! length read from a file against the bytes there before it sizes a buffer).
//!
//! `FUZZ_CASES` sets the inputs per target (default 300, as CI runs them) and `FUZZ_SEED`
//! the generator's seed (default 0); `scripts/fuzz.sh` runs the long campaign. A failing
//! input is written to `target/tmp/fuzz-<target>-<hash>.bin` and named in the failure.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use asr_data::audio::{decode_audio, write_flac};
use asr_data::games::{queen, rnc, sky};
use asr_data::manifest::{ManifestEntry, read_manifest, write_manifest};
use asr_data::phones::PhoneInventory;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

mod common;
use common::*;

/// The largest single allocation this test binary grants: 256 MiB. The seeds are a few
/// hundred kilobytes; a larger request comes from a length field that was not checked.
const ALLOCATION_CAP: usize = 256 << 20;

/// The global allocator: the system's, refusing any allocation over [`ALLOCATION_CAP`]
/// (the process then aborts with "memory allocation of N bytes failed").
struct CappedAllocator;

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

#[global_allocator]
static ALLOCATOR: CappedAllocator = CappedAllocator;

/// The time one input may take to read (10 s; the seeds read in milliseconds).
const DEADLINE: Duration = Duration::from_secs(10);

/// One byte-level change; positions are taken modulo the input's length.
#[derive(Debug, Clone)]
enum Mutation {
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

fn mutation() -> impl Strategy<Value = Mutation> {
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
fn mutate(seed: &[u8], mutations: &[Mutation]) -> Vec<u8> {
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

/// Runs target `name`: `FUZZ_CASES` inputs, each `seeds[i]` mutated, read by `read`.
fn fuzz(name: &str, seeds: Vec<Vec<u8>>, read: impl Fn(&[u8]) + Send + Sync + 'static) {
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
            let path =
                Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("fuzz-{name}-{hash:016x}.bin"));
            let _ = std::fs::write(&path, &input);
            TestCaseError::fail(format!("{why}; the input is in {}", path.display()))
        })
    });
    if let Err(e) = result {
        panic!("fuzz target {name} (FUZZ_SEED={seed}): {e}");
    }
    eprintln!("fuzz target {name}: {cases} inputs (FUZZ_SEED={seed}), none failed");
}

/// Two RNC streams: the two-chunk stream of `games.rs` and a one-chunk one.
fn rnc_seeds() -> Vec<Vec<u8>> {
    let a = square_wave(700, 13);
    let b: Vec<u8> = (0..300u32).map(|i| (i * 7 % 251) as u8).collect();
    let two = rnc_pack(&[
        vec![
            (&a[..], Some((1, 40))),
            (&b[..5], Some((300, 17))),
            (&b[5..], None),
        ],
        vec![(&[][..], Some((26, 1000))), (&a[..3], None)],
    ])
    .0;
    let one = rnc_pack(&[vec![(&b[..40], Some((7, 9))), (&b[40..60], None)]]).0;
    vec![two, one]
}

/// Mutations of whole RNC streams: most stop at the CRC of the packed data, the rest probe
/// the header's fields.
#[test]
fn fuzz_rnc_streams() {
    fuzz("rnc", rnc_seeds(), |bytes| {
        let _ = rnc::unpack(bytes);
    });
}

/// Mutations of RNC streams' packed data with the header's packed length and CRC made to
/// match: the Huffman tables, runs and matches are read from garbage.
#[test]
fn fuzz_rnc_packed_data() {
    fuzz("rnc-packed", rnc_seeds(), |bytes| {
        let Some(packed) = bytes.get(rnc::HEADER_LEN..) else {
            return;
        };
        let mut stream = bytes.to_vec();
        stream[8..12].copy_from_slice(&(packed.len() as u32).to_be_bytes());
        stream[14..16].copy_from_slice(&crc16(packed).to_be_bytes());
        let _ = rnc::unpack(&stream);
    });
}

/// Mutations of the Sky fixture's `sky.dnr` (index) or `sky.dsk` (texts, voices, one
/// RNC-packed), read as `asr import --game sky` reads the game.
#[test]
fn fuzz_sky_files() {
    let fixture = tempfile::tempdir().unwrap();
    sky_fixture(fixture.path());
    for file in ["sky.dnr", "sky.dsk"] {
        let seed = std::fs::read(fixture.path().join(file)).unwrap();
        let fixture = fixture.path().to_path_buf();
        fuzz(file, vec![seed], move |bytes| {
            let dir = tempfile::tempdir().unwrap();
            for other in ["sky.dnr", "sky.dsk"] {
                std::fs::copy(fixture.join(other), dir.path().join(other)).unwrap();
            }
            std::fs::write(dir.path().join(file), bytes).unwrap();
            let _ = sky::read_clips(dir.path());
        });
    }
}

/// Mutations of the Sky fixture's two text sections, decoded as the game's text code.
#[test]
fn fuzz_sky_text_sections() {
    fuzz(
        "sky-text",
        vec![SECTION_0.to_vec(), SECTION_1.to_vec()],
        |bytes| {
            let _ = sky::decode_section(bytes, "section");
        },
    );
}

/// Mutations of the Queen fixture's `queen.1c` (table, cutscene, dialogue, MP3 voices).
#[test]
fn fuzz_queen_bundle() {
    let fixture = tempfile::tempdir().unwrap();
    queen_fixture(fixture.path());
    let seed = std::fs::read(fixture.path().join("queen.1c")).unwrap();
    fuzz("queen.1c", vec![seed], |bytes| {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("queen.1c"), bytes).unwrap();
        let _ = queen::read_clips(dir.path());
    });
}

/// Mutations of a two-line manifest (its audio checked: one FLAC file beside it).
#[test]
fn fuzz_manifests() {
    let fixture = tempfile::tempdir().unwrap();
    let samples: Vec<f32> = (0..1600).map(|i| (i as f32 * 0.05).sin() * 0.3).collect();
    write_flac(&fixture.path().join("a.flac"), &samples, 16_000, 16).unwrap();
    let inventory = PhoneInventory::standard();
    let phones = inventory.phones()[..3].join(" ");
    let entries: Vec<ManifestEntry> = ["one", "two"]
        .iter()
        .map(|id| ManifestEntry {
            id: id.to_string(),
            audio: "a.flac".into(),
            duration_s: 0.1,
            text: "a word".into(),
            phones: phones.clone(),
            voice: "v".into(),
        })
        .collect();
    write_manifest(&fixture.path().join("train.jsonl"), &entries).unwrap();
    let seed = std::fs::read(fixture.path().join("train.jsonl")).unwrap();
    let fixture = fixture.path().to_path_buf();
    fuzz("manifest", vec![seed], move |bytes| {
        let path = fixture.join(format!("{:?}.jsonl", std::thread::current().id()));
        std::fs::write(&path, bytes).unwrap();
        let _ = read_manifest(&path, &inventory, true);
        let _ = std::fs::remove_file(&path);
    });
}

/// A mono 16-bit WAV file of `samples` at 8 kHz (hound; its rate at bytes 24..28).
fn wav_16bit(samples: impl IntoIterator<Item = i16>) -> Vec<u8> {
    let mut wav = std::io::Cursor::new(Vec::new());
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 8_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut writer = hound::WavWriter::new(&mut wav, spec).unwrap();
    for s in samples {
        writer.write_sample(s).unwrap();
    }
    writer.finalize().unwrap();
    wav.into_inner()
}

/// Mutations of audio files in three formats (16-bit WAV, FLAC, MP3), decoded as the front
/// door decodes any file.
#[test]
fn fuzz_audio() {
    let dir = tempfile::tempdir().unwrap();
    let samples: Vec<f32> = (0..800).map(|i| (i as f32 * 0.07).sin() * 0.5).collect();
    let flac = dir.path().join("a.flac");
    write_flac(&flac, &samples, 16_000, 16).unwrap();
    let wav = wav_16bit(samples.iter().map(|&s| (s * 32_000.0) as i16));
    let seeds = vec![std::fs::read(&flac).unwrap(), wav, silent_mp3(4)];
    fuzz("audio", seeds, |bytes| {
        let _ = decode_audio(bytes.to_vec(), Path::new("fuzzed"));
    });
}

/// The input class that the fuzz target `audio` found (`FUZZ_SEED=1`, 30,000 inputs): a WAV
/// header giving a sample rate of tens of MHz made the resampler ask for 281,019,368 bytes
/// (this binary's allocator refuses over 256 MiB). Such a rate is an error naming it.
#[test]
fn audio_of_an_extreme_sample_rate_is_refused() {
    let mut bytes = wav_16bit((0..800).map(|i| (i % 100) as i16 * 300));
    assert_eq!(&bytes[24..28], &8_000u32.to_le_bytes());
    bytes[24..28].copy_from_slice(&45_000_001u32.to_le_bytes());
    let err = decode_audio(bytes, Path::new("x.wav"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("x.wav") && err.contains("45000001 Hz"),
        "{err}"
    );
}
