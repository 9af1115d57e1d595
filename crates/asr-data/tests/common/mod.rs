//! The fixtures of the games' readers, built from the formats' descriptions: an RNC method-1
//! packer, a `sky.dnr`/`sky.dsk` pair and a `queen.1c` bundle (used by `games.rs` and
//! `fuzz.rs`).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use asr_data::games::sky;

/// CRC-16/ARC, bit by bit.
pub fn crc16(bytes: &[u8]) -> u16 {
    let mut crc = 0u16;
    for &b in bytes {
        for i in 0..8 {
            let bit = ((b >> i) & 1) as u16 ^ (crc & 1);
            crc >>= 1;
            if bit != 0 {
                crc ^= 0xA001;
            }
        }
    }
    crc
}

/// Writes an RNC method-1 stream as its reader consumes it: bits least significant first in
/// 16-bit little-endian words, each word placed where the reader fetches it (when it needs
/// more bits), literal bytes at the current byte position.
pub struct RncWriter {
    out: Vec<u8>,
    words: Vec<usize>,
    bits: usize,
}

impl RncWriter {
    fn bits(&mut self, value: u32, n: u32) {
        for i in 0..n {
            if self.bits == 16 * self.words.len() {
                self.words.push(self.out.len());
                self.out.extend([0, 0]);
            }
            let word = self.words[self.bits / 16];
            let bit = self.bits % 16;
            if (value >> i) & 1 != 0 {
                self.out[word + bit / 8] |= 1 << (bit % 8);
            }
            self.bits += 1;
        }
    }

    /// A table of 16 symbols with 4-bit codes: symbol `s`'s code is `s`, read most
    /// significant bit first.
    fn table(&mut self) {
        self.bits(16, 5);
        for _ in 0..16 {
            self.bits(4, 4);
        }
    }

    /// A value: symbol 0, 1, or `s = bit length` with `s − 1` further bits.
    fn value(&mut self, v: u32) {
        let s = if v < 2 { v } else { 32 - v.leading_zeros() };
        for i in (0..4).rev() {
            self.bits((s >> i) & 1, 1);
        }
        if s >= 2 {
            self.bits(v - (1 << (s - 1)), s - 1);
        }
    }
}

/// A chunk's steps: literal bytes, then (distance, length) to the next step's, if any.
pub type Steps<'a> = Vec<(&'a [u8], Option<(u32, u32)>)>;

/// Packs `chunks` into an RNC method-1 stream; returns it and the data it unpacks to.
pub fn rnc_pack(chunks: &[Steps]) -> (Vec<u8>, Vec<u8>) {
    let mut w = RncWriter {
        out: Vec::new(),
        words: Vec::new(),
        bits: 0,
    };
    let mut unpacked: Vec<u8> = Vec::new();
    w.bits(0, 2);
    for steps in chunks {
        w.table();
        w.table();
        w.table();
        w.bits(steps.len() as u32, 16);
        for (i, (literal, matched)) in steps.iter().enumerate() {
            w.value(literal.len() as u32);
            w.out.extend_from_slice(literal);
            unpacked.extend_from_slice(literal);
            if i + 1 < steps.len() {
                let (distance, length) = matched.expect("a match between steps");
                w.value(distance - 1);
                w.value(length - 2);
                for _ in 0..length {
                    unpacked.push(unpacked[unpacked.len() - distance as usize]);
                }
            }
        }
    }
    let packed = w.out;
    let mut stream = b"RNC\x01".to_vec();
    stream.extend((unpacked.len() as u32).to_be_bytes());
    stream.extend((packed.len() as u32).to_be_bytes());
    stream.extend(crc16(&unpacked).to_be_bytes());
    stream.extend(crc16(&packed).to_be_bytes());
    stream.extend([0, chunks.len() as u8]);
    stream.extend(packed);
    (stream, unpacked)
}

pub fn square_wave(n: usize, period: usize) -> Vec<u8> {
    (0..n)
        .map(|i| {
            if (i / period).is_multiple_of(2) {
                168
            } else {
                88
            }
        })
        .collect()
}

/// Text section 0 of the fixture, coded by hand from the game's text code: "Foster",
/// "Hello there, Joey.", "Not voiced.".
pub const SECTION_0: [u8; 33] = [
    0x04, 0x00, 0x07, 0x00, 0x13, 0x32, 0x20, 0xf1, 0x42, 0x54, 0x4f, 0x03, 0x89, 0x51, 0x42, 0x02,
    0xb0, 0x93, 0x97, 0x51, 0xec, 0x82, 0xda, 0xc8, 0x2c, 0x42, 0x87, 0x0a, 0x1b, 0x89, 0x54, 0xc8,
    0x00,
];
/// Text section 1: "Hi.", "Hey!".
pub const SECTION_1: [u8; 13] = [
    0x04, 0x00, 0x06, 0x00, 0x0C, 0x10, 0xE2, 0xD6, 0x40, 0xE2, 0x5B, 0x76, 0x40,
];

/// The 22-byte header of a data file of `total` bytes (header included).
pub fn sky_header(total: usize, packed: bool) -> Vec<u8> {
    let mut h = vec![0u8; 22];
    h[0] = if packed { 0x81 } else { 0 };
    h[1] = (total >> 16) as u8;
    h[12..14].copy_from_slice(&((total & 0xFFFF) as u16).to_le_bytes());
    h
}

/// The fixture's speech: text 0 (file 50000, stored, 16-byte position units), text 1 (50001,
/// RNC-packed), section 1's text 0 (50600, header without the packed bit, byte position).
pub fn sky_fixture(dir: &Path) -> BTreeMap<u16, Vec<u8>> {
    let speech: BTreeMap<u16, Vec<u8>> = [
        (50000, square_wave(4000, 20)),
        (50001, square_wave(40_000, 31)),
        (50600, square_wave(5512, 9)),
    ]
    .into();
    // (number, bytes, byte position units, flags bits 22/23)
    let mut files: Vec<(u16, Vec<u8>, bool, u32)> = vec![
        (60600, SECTION_0.to_vec(), false, 0x80_0000),
        (60601, SECTION_1.to_vec(), false, 0x80_0000),
        (
            50000,
            [sky_header(22 + 4000, false), speech[&50000].clone()].concat(),
            false,
            0x80_0000,
        ),
    ];
    let pcm = &speech[&50001];
    let (stream, unpacked) = rnc_pack(&[
        vec![
            (&pcm[..20_000], Some((62, 300))),
            (&pcm[20_300..30_000], None),
        ],
        vec![(&pcm[30_000..], None)],
    ]);
    assert_eq!(&unpacked, pcm);
    files.push((
        50001,
        [sky_header(22 + pcm.len(), true), stream].concat(),
        false,
        0,
    ));
    files.push((
        50600,
        [sky_header(22 + 5512, false), speech[&50600].clone()].concat(),
        true,
        0,
    ));
    let mut dsk = Vec::new();
    let mut dnr = Vec::new();
    for (number, bytes, byte_units, flags) in &files {
        while dsk.len() % 16 != 0 {
            dsk.push(0);
        }
        let offset = if *byte_units {
            dsk.len() as u32
        } else {
            (dsk.len() as u32 >> 4) | 0x80_0000
        };
        dnr.extend(number.to_le_bytes());
        dnr.extend(&offset.to_le_bytes()[..3]);
        dnr.extend(&(bytes.len() as u32 | flags).to_le_bytes()[..3]);
        dsk.extend(bytes);
    }
    // The index of version 0.0372 lists 5,097 files: empty ones fill it up.
    for number in 1..=(sky::FILES_0372 - files.len()) as u16 {
        dnr.extend(number.to_le_bytes());
        dnr.extend([0; 6]);
    }
    let mut index = (sky::FILES_0372 as u32).to_le_bytes().to_vec();
    index.extend(dnr);
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("sky.dnr"), index).unwrap();
    std::fs::write(dir.join("sky.dsk"), dsk).unwrap();
    speech
}

pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("asr-games-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn pstring(text: &str) -> Vec<u8> {
    let mut out = vec![text.len() as u8];
    out.extend(text.as_bytes());
    out
}

/// An MP3 stream of `frames` silent frames (MPEG 2.5 layer III, 16 kbit/s, 11,025 Hz, mono:
/// 104 bytes, 576 samples each).
pub fn silent_mp3(frames: usize) -> Vec<u8> {
    let mut frame = vec![0xFF, 0xE3, 0x20, 0xC4];
    frame.extend([0u8; 100]);
    frame.repeat(frames)
}

/// A bundle in `queen.1c`'s layout: a cutscene with one line of Joe's in two segments, a
/// dialogue whose greeting has two segments, and their four voice files.
pub fn queen_fixture(dir: &Path) {
    let mut cut = Vec::new();
    for w in [0i16, 1, 0, 50, 58, 90] {
        cut.extend(w.to_be_bytes()); // panel, records, flags, game states, sentences, banks
    }
    cut.extend([0u8; 34]); // record 1: object 0 (Joe), no animation
    cut.extend([0u8; 4]); // no persons; the word before the game states
    cut.extend([0u8; 8]); // game states
    cut.extend(pstring("*FL")); // the entry string, not spoken
    cut.extend(pstring("Hello there.*00How are you?"));
    cut.extend([0, 0, 0, 0, 0, 0]); // no banks, no dialogue, talk to 0, pad
    assert_eq!(cut.len(), 96);
    let mut dog = Vec::new();
    for w in [0i16, 1, 1, 1, 0] {
        dog.extend(w.to_be_bytes()); // levels, unique key, talk key 1, 1 Joe entry, 0 persons
    }
    dog.extend([0u8; 12]);
    for w in [48i16, 48, 48] {
        dog.extend(w.to_be_bytes()); // person list, cutaway, return strings
    }
    dog.extend([0u8; 4]);
    dog.extend([0, 0, 0, 0]); // Joe entry: id 0, the first greeting
    dog.extend(pstring("Hi.*00Bye."));
    dog.push(0); // pad to 4
    dog.extend([0, 0]); // two empty return strings
    assert_eq!(dog.len(), 50);
    let header = |body: Vec<u8>| [b"AmBk".to_vec(), vec![0; 16], body].concat();
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("01SSSSJ1.SB", silent_mp3(3)),
        ("01SSSSJ2.SB", silent_mp3(4)),
        ("TEST.CUT", header(cut)),
        ("TEST.DOG", header(dog)),
        ("TEST_011.SB", silent_mp3(10)),
        ("TEST_012.SB", silent_mp3(20)),
        ("UNUSED01.SB", silent_mp3(2)),
    ];
    let mut bundle = b"QTBLCEM10\0\0\0\x01".to_vec();
    bundle.extend((files.len() as u16).to_be_bytes());
    let mut offset = bundle.len() + 21 * files.len();
    let mut data: Vec<u8> = Vec::new();
    for (name, bytes) in &files {
        let mut entry = name.as_bytes().to_vec();
        entry.resize(12, 0);
        entry.push(1);
        entry.extend((offset as u32).to_be_bytes());
        entry.extend((bytes.len() as u32).to_be_bytes());
        bundle.extend(entry);
        offset += bytes.len();
        data.extend(bytes);
    }
    bundle.extend(data);
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("queen.1c"), bundle).unwrap();
}
