//! `asr import`'s readers of the two games' data on fixtures built here from the format
//! descriptions (an RNC method-1 packer, a `sky.dnr`/`sky.dsk` pair, a `queen.1c` bundle),
//! the corpus they import to, the speaker split and the training mix; and, when the Debian
//! packages are there (`bash scripts/get-real-speech.sh`), the real data: clip counts and the
//! link between transcripts and recordings (skipped with a `skipped:` line on stderr when
//! absent, unless `ASR_REQUIRE_GAMES=1`, as `scripts/test.sh` sets).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use asr_data::data::{Example, mix};
use asr_data::features::Features;
use asr_data::games::{
    Clip, ClipAudio, Game, GameImportOptions, import_game, queen, rnc, sky, split_by_speaker,
};
use asr_data::manifest::read_manifest;
use asr_data::phones::PhoneInventory;

mod common;
use common::*;

#[test]
fn crc16_check_value() {
    assert_eq!(crc16(b"123456789"), 0xBB3D);
    assert_eq!(rnc::crc16(b"123456789"), 0xBB3D);
}

#[test]
fn rnc_streams_unpack_and_corruption_is_reported() {
    let a = square_wave(700, 13);
    let b: Vec<u8> = (0..300u32).map(|i| (i * 7 % 251) as u8).collect();
    // Two chunks: literal runs, overlapping matches (distance < length) and long ones.
    let (stream, expected) = rnc_pack(&[
        vec![
            (&a[..], Some((1, 40))),
            (&b[..5], Some((300, 17))),
            (&b[5..], None),
        ],
        vec![(&[][..], Some((26, 1000))), (&a[..3], None)],
    ]);
    assert_eq!(expected.len(), 700 + 40 + 5 + 17 + 295 + 1000 + 3);
    assert_eq!(rnc::unpack(&stream).unwrap(), expected);

    let mut bad = stream.clone();
    let last = bad.len() - 2;
    bad[last] ^= 0x10;
    let err = rnc::unpack(&bad).unwrap_err().to_string();
    assert!(err.contains("CRC of the packed data"), "{err}");
    let mut bad = stream.clone();
    bad[13] ^= 1; // the unpacked data's CRC
    let err = rnc::unpack(&bad).unwrap_err().to_string();
    assert!(err.contains("CRC of the unpacked data"), "{err}");
    let err = rnc::unpack(&stream[..stream.len() - 3])
        .unwrap_err()
        .to_string();
    assert!(err.contains("truncated"), "{err}");
    let err = rnc::unpack(b"RNC\x02 and more bytes")
        .unwrap_err()
        .to_string();
    assert!(err.contains("not an RNC method-1 stream"), "{err}");
}

/// The input of the fuzz target `rnc-packed` (`tests/fuzz.rs`, seed 0) that asked for an
/// allocation of 2,257,425,563 bytes: a stream whose header announces that many unpacked
/// bytes, which the unpacker reserved before reading anything. Such a header is refused
/// before any allocation, naming the length and the limit.
#[test]
fn rnc_header_over_the_unpacked_limit_is_refused() {
    let a = square_wave(700, 13);
    let (mut stream, _) = rnc_pack(&[vec![(&a[..], None)]]);
    stream[4..8].copy_from_slice(&0x868D_949Bu32.to_be_bytes());
    let err = rnc::unpack(&stream).unwrap_err();
    assert_eq!(err, rnc::RncError::TooLong(2_257_425_563));
    let message = err.to_string();
    assert!(
        message.contains("2257425563") && message.contains(&rnc::MAX_UNPACKED_LEN.to_string()),
        "{message}"
    );
    // At the limit, the length is checked against the data instead.
    stream[4..8].copy_from_slice(&(rnc::MAX_UNPACKED_LEN as u32).to_be_bytes());
    let err = rnc::unpack(&stream).unwrap_err().to_string();
    assert!(err.contains("unpacked length"), "{err}");
}

/// Each clip's id, transcript and speaker.
fn summary(clips: &[Clip]) -> Vec<(&str, &str, &str)> {
    clips
        .iter()
        .map(|c| (c.id.as_str(), c.transcript.as_str(), c.speaker.as_str()))
        .collect()
}

#[test]
fn sky_fixture_reads_back() {
    let dir = temp_dir("sky");
    let speech = sky_fixture(&dir);
    let (clips, left_out) = sky::read_clips(&dir).unwrap();
    assert!(left_out.is_empty(), "{left_out:?}");
    let got = summary(&clips);
    assert_eq!(
        got,
        [
            ("50000", "Foster", "scene-0.000"),
            ("50001", "Hello there, Joey.", "scene-0.000"),
            ("50600", "Hi.", "scene-1.000"),
        ]
    );
    for clip in &clips {
        let number: u16 = clip.id.parse().unwrap();
        assert_eq!(
            clip.audio,
            ClipAudio::PcmU8 {
                rate_hz: 11_025,
                samples: speech[&number].clone()
            },
            "{}",
            clip.id
        );
    }

    // A damaged packed stream leaves its line out, naming the place; another version's
    // index is refused.
    let mut dsk = std::fs::read(dir.join("sky.dsk")).unwrap();
    let at = dsk.windows(4).position(|w| w == b"RNC\x01").unwrap();
    dsk[at + 40] ^= 0xFF;
    std::fs::write(dir.join("sky.dsk"), &dsk).unwrap();
    let (clips, left_out) = sky::read_clips(&dir).unwrap();
    assert_eq!(clips.len(), 2);
    assert_eq!(left_out.len(), 1, "{left_out:?}");
    assert!(
        left_out[0].contains(&format!("sky.dsk offset {at}")) && left_out[0].contains("CRC"),
        "{left_out:?}"
    );
    let mut dnr = std::fs::read(dir.join("sky.dnr")).unwrap();
    dnr[..4].copy_from_slice(&5099u32.to_le_bytes());
    std::fs::write(dir.join("sky.dnr"), &dnr).unwrap();
    let err = sky::read_clips(&dir).unwrap_err().to_string();
    assert!(
        err.contains("5099 files") && err.contains("0.0372"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn queen_fixture_reads_back() {
    let dir = temp_dir("queen");
    queen_fixture(&dir);
    let (clips, left_out) = queen::read_clips(&dir).unwrap();
    let got = summary(&clips);
    assert_eq!(
        got,
        [
            ("01SSSSJ1", "Hi.", "JOE"),
            ("01SSSSJ2", "Bye.", "JOE"),
            ("TEST_011", "Hello there.", "JOE"),
            ("TEST_012", "How are you?", "JOE"),
        ]
    );
    for (clip, frames) in clips.iter().zip([3, 4, 10, 20]) {
        assert_eq!(
            clip.audio,
            ClipAudio::Mp3(silent_mp3(frames)),
            "{}",
            clip.id
        );
    }
    assert!(
        left_out.len() == 1 && left_out[0].contains("no QUEEN.JAS"),
        "{left_out:?}"
    );
    let mut bundle = std::fs::read(dir.join("queen.1c")).unwrap();
    bundle[3] = b'X';
    std::fs::write(dir.join("queen.1c"), &bundle).unwrap();
    let err = queen::read_clips(&dir).unwrap_err().to_string();
    assert!(err.contains("offset 0: not a rebuilt bundle"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn queen_segments_and_voice_files() {
    assert_eq!(
        queen::segments("*FRHey guys, hop on board...*04I'm going to row...*07"),
        [
            (1, String::new(), true),
            (2, "Hey guys, hop on board...".to_string(), true),
            (3, "I'm going to row...".to_string(), true),
        ]
    );
    assert_eq!(
        queen::segments("Over there.*XY00(237,112)Now*GDthis"),
        [
            (1, "Over there.".to_string(), true),
            (2, "Now".to_string(), false),
            (3, "this".to_string(), true),
        ]
    );
    assert_eq!(queen::voice_file(" 6 346P", 1), "060346P1.SB");
    assert_eq!(queen::voice_file("C2A__01", 10), "C2A__01A.SB");
    assert_eq!(queen::canonical("X3_ANDSON-H"), "ANDERSON");
    assert_eq!(
        queen::clean_text("Super  Soldier Treatment^_ @@"),
        "Super Soldier Treatment"
    );
}

/// Both fixtures imported as corpora: every clip in one split, the manifests valid (audio
/// decoded, phones in the inventory), the durations those of the stored audio.
#[test]
fn fixtures_import_as_corpora() {
    for (game, frames_or_samples) in [
        (Game::Sky, vec![4000.0, 40_000.0, 5512.0]),
        (
            Game::Queen,
            vec![3.0 * 576.0, 4.0 * 576.0, 10.0 * 576.0, 20.0 * 576.0],
        ),
    ] {
        let dir = temp_dir(&format!("{game}-data"));
        match game {
            Game::Sky => {
                sky_fixture(&dir);
            }
            Game::Queen => queen_fixture(&dir),
        }
        let out = temp_dir(&format!("{game}-corpus"));
        let report = import_game(&GameImportOptions {
            game,
            dir: dir.clone(),
            out: out.clone(),
            accent: "en-us".into(),
            held_out: 0.0,
        })
        .unwrap();
        let inventory = PhoneInventory::load(&out.join("phones.txt")).unwrap();
        let mut entries = Vec::new();
        for split in ["train", "dev", "test"] {
            let manifest = out.join(format!("{split}.jsonl"));
            // No speaker is held out here: dev and test are empty.
            if std::fs::read_to_string(&manifest).unwrap().is_empty() {
                continue;
            }
            for u in read_manifest(&manifest, &inventory, true).unwrap() {
                entries.push(u.entry);
            }
        }
        entries.sort_by(|a, b| a.id.cmp(&b.id));
        assert_eq!(entries.len(), frames_or_samples.len(), "{game}: {report:?}");
        for (entry, samples) in entries.iter().zip(&frames_or_samples) {
            let expected = samples / 11_025.0;
            assert!(
                (entry.duration_s - expected).abs() < 0.005,
                "{game} {}: {} s, stored {expected} s",
                entry.id,
                entry.duration_s
            );
            assert!(!entry.phones.is_empty());
        }
        let texts: Vec<&str> = entries.iter().map(|e| e.text.as_str()).collect();
        assert_eq!(
            texts,
            match game {
                Game::Sky => vec!["foster", "hello there joey", "hi"],
                Game::Queen => vec!["hi", "bye", "hello there", "how are you"],
            }
        );
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&out).unwrap();
    }
}

#[test]
fn speakers_are_split_whole() {
    let counts: BTreeMap<String, usize> = (0..40)
        .map(|i| (format!("speaker {i}"), 10 + (i * 37) % 50))
        .chain([("lead".to_string(), 900), ("UNKNOWN".to_string(), 30)])
        .collect();
    let total: usize = counts.values().sum();
    let splits = split_by_speaker(&counts, 0.06);
    assert_eq!(splits.len(), counts.len());
    assert_eq!(splits["lead"], "train");
    assert_eq!(splits["UNKNOWN"], "train");
    for split in ["dev", "test"] {
        let held: usize = counts
            .iter()
            .filter(|(name, _)| splits[*name] == split)
            .map(|(_, n)| n)
            .sum();
        let fraction = held as f64 / total as f64;
        assert!(
            (0.06..0.125).contains(&fraction),
            "{split} holds {fraction} of the clips"
        );
    }
    assert!(
        split_by_speaker(&counts, 0.0)
            .values()
            .all(|s| *s == "train")
    );
}

fn example(id: &str) -> Example {
    Example {
        id: id.to_string(),
        features: Arc::new(Features {
            frames: 1,
            n_mels: 1,
            data: vec![0.0],
        }),
        targets: vec![1],
        audio: None,
    }
}

#[test]
fn mix_takes_each_corpus_by_its_weight() {
    let corpus = |name: &str, n: usize| -> Vec<Example> {
        (0..n).map(|i| example(&format!("{name}{i}"))).collect()
    };
    let mixed = mix(
        vec![
            (corpus("a", 10), 2.0),
            (corpus("b", 40), 0.25),
            (corpus("c", 7), 0.0),
        ],
        3,
    );
    let count = |prefix: &str| mixed.iter().filter(|e| e.id.starts_with(prefix)).count();
    assert_eq!((count("a"), count("b"), count("c")), (20, 10, 0));
    for i in 0..10 {
        assert_eq!(mixed.iter().filter(|e| e.id == format!("a{i}")).count(), 2);
    }
    let b: std::collections::BTreeSet<&str> = mixed
        .iter()
        .filter(|e| e.id.starts_with('b'))
        .map(|e| e.id.as_str())
        .collect();
    assert_eq!(b.len(), 10, "a fractional weight draws distinct utterances");
    let again = mix(vec![(corpus("a", 10), 2.0), (corpus("b", 40), 0.25)], 3);
    let ids = |v: &[Example]| v.iter().map(|e| e.id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&again), ids(&mixed[..30]));
}

fn pearson(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len() as f64;
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let sxy: f64 = x.iter().zip(y).map(|(a, b)| (a - mx) * (b - my)).sum();
    let sxx: f64 = x.iter().map(|a| (a - mx).powi(2)).sum();
    let syy: f64 = y.iter().map(|b| (b - my).powi(2)).sum();
    sxy / (sxx * syy).sqrt()
}

/// The installed games: clip counts, and transcript length against clip duration, in the
/// data's order and with the transcripts shifted by one line (a wrong link gives no
/// correlation).
#[test]
fn real_games_import_with_linked_transcripts() {
    for (game, at_least) in [(Game::Sky, 3300), (Game::Queen, 6400)] {
        // Unpacked by scripts/get-real-speech.sh, else installed.
        let unpacked = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../data/games/debian/usr/share/scummvm")
            .join(game.package());
        let dir = if unpacked.exists() {
            unpacked
        } else {
            game.default_dir()
        };
        let file = dir.join(match game {
            Game::Sky => "sky.dsk",
            Game::Queen => "queen.1c",
        });
        if !file.exists() {
            let message = format!(
                "{} is missing (bash scripts/get-real-speech.sh --packages-only fetches it)",
                file.display()
            );
            assert!(
                std::env::var("ASR_REQUIRE_GAMES").as_deref() != Ok("1"),
                "{message}"
            );
            let test = std::thread::current().name().unwrap_or("?").to_string();
            let _ = writeln!(std::io::stderr(), "skipped: {test}: {message}");
            continue;
        }
        let out = temp_dir(&format!("{game}-real"));
        let report = import_game(&GameImportOptions {
            game,
            dir,
            out: out.clone(),
            accent: "en-us".into(),
            held_out: 0.06,
        })
        .unwrap();
        let inventory = PhoneInventory::load(&out.join("phones.txt")).unwrap();
        let mut entries = Vec::new();
        for split in ["train", "dev", "test"] {
            let manifest = out.join(format!("{split}.jsonl"));
            entries.extend(read_manifest(&manifest, &inventory, false).unwrap());
        }
        let clips = entries.len();
        assert!(clips >= at_least, "{game}: {clips} clips; {report:?}");
        entries.sort_by(|a, b| a.entry.id.cmp(&b.entry.id));
        let chars: Vec<f64> = entries.iter().map(|u| u.entry.text.len() as f64).collect();
        let seconds: Vec<f64> = entries.iter().map(|u| u.entry.duration_s).collect();
        let linked = pearson(&chars, &seconds);
        let shifted = pearson(&chars[1..], &seconds[..clips - 1]);
        eprintln!(
            "{game}: {clips} clips, {:.2} h; r(characters, seconds) = {linked:.3}, shifted by one line {shifted:.3}",
            seconds.iter().sum::<f64>() / 3600.0
        );
        assert!(
            linked >= 0.6 && shifted <= 0.2,
            "{game}: r = {linked}, shifted {shifted}"
        );
        std::fs::remove_dir_all(&out).unwrap();
    }
}
