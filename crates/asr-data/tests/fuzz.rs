//! Fuzzing of the readers of bytes from outside: the RNC unpacker, *Beneath a Steel Sky*'s
//! `sky.dnr` index and `sky.dsk` files (texts and voices), *Flight of the Amazon Queen*'s
//! `queen.1c` bundle (its table, cutscenes, dialogues and voices), corpus manifests, the
//! transcript files of `asr manifest`'s LibriSpeech, Kaldi and TSV layouts with the
//! transcripts' normalisation, and the audio front door (WAV, FLAC, MP3 through symphonia).
//!
//! Each target starts from seed inputs, the fixtures the tests build from the formats'
//! descriptions (`common/`), and reads them mutated at random ([`fuzz_harness`]). A target
//! passes when every input gives a value or an error within the deadline, without a panic,
//! and without an allocation over [`fuzz_harness::ALLOCATION_CAP`] (this binary's global
//! allocator refuses one, which aborts the process: a reader must check a length read from a
//! file against the bytes there before it sizes a buffer).
//!
//! `FUZZ_CASES` sets the inputs per target (default 300, as CI runs them) and `FUZZ_SEED`
//! the generator's seed (default 0); `scripts/fuzz.sh` runs the long campaign. A failing
//! input is written to `target/tmp/fuzz-<target>-<hash>.bin` and named in the failure.

use std::path::Path;

use asr_data::audio::{decode_audio, write_flac};
use asr_data::games::{queen, rnc, sky};
use asr_data::manifest::import::{Source, normalize_text, scan};
use asr_data::manifest::{ManifestEntry, read_manifest, write_manifest};
use asr_data::phones::PhoneInventory;
use fuzz_harness::CappedAllocator;

mod common;
use common::*;

#[global_allocator]
static ALLOCATOR: CappedAllocator = CappedAllocator;

/// Runs target `name` ([`fuzz_harness::fuzz`]), failing inputs kept in the test target's
/// temporary directory.
fn fuzz(name: &str, seeds: Vec<Vec<u8>>, read: impl Fn(&[u8]) + Send + Sync + 'static) {
    fuzz_harness::fuzz(name, Path::new(env!("CARGO_TARGET_TMPDIR")), seeds, read);
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

/// The transcript files of `asr manifest`'s three layouts (LibriSpeech's `*.trans.txt`,
/// Kaldi's `wav.scp`, `text` and `utt2spk`, a TSV), one target each, written with their
/// audio's names beside them: the transcripts hold numbers, ordinals, decimals, years,
/// abbreviations and symbols, for [`normalize_text`].
const IMPORT_SEEDS: [(&str, &str, &str); 5] = [
    (
        "librispeech",
        "1-2/1-2.trans.txt",
        "1-2-0001 IT WAS THE 25TH OF MAY 1999\n1-2-0002 D.N.A. & 3.5 PERCENT, SAID MR. O'HARA\n",
    ),
    (
        "kaldi-wav.scp",
        "wav.scp",
        "a audio/a.flac\nb /abs/b.wav\nc sox c.wav -t wav - |\n",
    ),
    (
        "kaldi-text",
        "text",
        "a the 1st of 2,000 days\nb we'll go at 10 + 2 @ home\nc 42%\n",
    ),
    ("kaldi-utt2spk", "utt2spk", "a s1\nb s2\nc s1\n"),
    (
        "tsv",
        "list.tsv",
        "path\ttranscript\tspeaker\na.wav\tthe 3rd and 1,234th\ts1\nsub/a.wav\t9.75 — yes\n",
    ),
];

/// Mutations of each layout's transcript file, scanned as `asr manifest` scans a source (the
/// Kaldi layout's other files unchanged), every transcript found then normalised. Besides
/// giving a value or an error, every problem reported must name its file and line.
#[test]
fn fuzz_import_sources() {
    for (name, path, text) in IMPORT_SEEDS {
        fuzz(name, vec![text.as_bytes().to_vec()], move |bytes| {
            let dir = tempfile::tempdir().unwrap();
            for (_, other, text) in IMPORT_SEEDS {
                let other = dir.path().join(other);
                std::fs::create_dir_all(other.parent().unwrap()).unwrap();
                std::fs::write(other, text).unwrap();
            }
            for audio in ["1-2/1-2-0001.flac", "1-2/1-2-0002.wav"] {
                std::fs::write(dir.path().join(audio), b"").unwrap();
            }
            let file = dir.path().join(path);
            std::fs::write(&file, bytes).unwrap();
            let source = match name {
                "librispeech" => Source::LibriSpeech(dir.path().to_path_buf()),
                "tsv" => Source::Tsv(file.clone()),
                _ => Source::Kaldi(dir.path().to_path_buf()),
            };
            let Ok((found, problems)) = scan(&source) else {
                return;
            };
            for problem in &problems {
                let (at, _) = problem.split_once(": ").unwrap_or_else(|| {
                    panic!("{name}: a problem without its file and line: {problem:?}")
                });
                let line = at
                    .rsplit_once(':')
                    .and_then(|(_, n)| n.parse::<usize>().ok());
                assert!(
                    at.starts_with(&*dir.path().to_string_lossy()) && line.is_some_and(|n| n > 0),
                    "{name}: a problem without its file and line: {problem:?}"
                );
            }
            for utterance in &found {
                let _ = normalize_text(&utterance.transcript);
            }
        });
    }
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
