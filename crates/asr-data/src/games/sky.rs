//! *Beneath a Steel Sky*, CD version 0.0372: every voiced line of the English texts.
//!
//! - `sky.dnr` indexes the files of `sky.dsk`: a little-endian u32 count, then 8 bytes per
//!   file: its number (u16), its position (u24; bit 23: in 16-byte units) and its size
//!   (u24, bits 0–21; bit 22: the packed data holds its own 22-byte header; bit 23: stored as
//!   it is). Only the 5,097-file index of version 0.0372 is accepted: the text code differs
//!   between versions.
//! - A file that is not stored as it is starts with a 22-byte header whose first word's bit 7
//!   says that an RNC method-1 stream ([`super::rnc`]) follows.
//! - Texts: section `s` (0–7) of English is file `60600 + s`: two u16 offsets (of a skip table
//!   and of the bit stream), the length of each full block of 32 texts, one skip byte per text
//!   (its length in 2-bit units, `0x80 | n` meaning `8·n` units), then the texts, Huffman-coded
//!   most significant bit first ([`TEXT_CODE`]), each ended by a 0 byte. Text number
//!   `t = s·4096 + i`.
//! - Speech: text `t`'s recording, when there is one, is file
//!   `50000 + [0, 600, 1100, 2430, 3380, 4530, 5080, 5230][s] + i`: a 22-byte header, then
//!   8-bit unsigned mono PCM at 11,025 Hz. A text without that file is shown, not spoken.
//!
//! The data does not say who speaks a line (only the game scripts do); lines are grouped by
//! *scene*, 32 consecutive text numbers (one conversation, mostly), as `s.block`.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, bail};

use super::{Clip, ClipAudio, rnc};

/// Files in the index of version 0.0372 (the CD version).
pub const FILES_0372: usize = 5097;

/// First speech file of each text section.
pub const SPEECH_BASE: [u32; 8] = [0, 600, 1100, 2430, 3380, 4530, 5080, 5230];

/// Sample rate of the speech files, in Hz.
pub const SPEECH_RATE_HZ: u32 = 11_025;

/// Length of a data file's header.
pub const HEADER_LEN: usize = 22;

/// The text code of version 0.0372: `(code, byte)`, code bits in reading order. Byte 0 ends
/// a text. (The 16-bit code of all ones duplicates `!`, as the game's tree has it.)
#[rustfmt::skip]
pub const TEXT_CODE: [(&str, u8); 123] = [
    ("000", 0x20), ("0010", 0x65), ("0011", 0x61), ("0111", 0x72), ("01000", 0x6F),
    ("01001", 0x73), ("01010", 0x74), ("01011", 0x6E), ("01100", 0x2E), ("01101", 0x69),
    ("10001", 0x75), ("10010", 0x6D), ("10011", 0x41), ("10111", 0x54), ("100000", 0x00),
    ("100001", 0x45), ("101000", 0x6C), ("101001", 0x49), ("101010", 0x64), ("101011", 0x52),
    ("101100", 0x4E), ("101101", 0x53), ("110001", 0x63), ("110010", 0x44), ("110011", 0x67),
    ("110111", 0x4D), ("1100000", 0x4F), ("1100001", 0x68), ("1101000", 0x4C), ("1101001", 0x43),
    ("1101010", 0x70), ("1101011", 0x55), ("1101100", 0x21), ("1101101", 0x79), ("1110001", 0x48),
    ("1110010", 0x3F), ("1110011", 0x62), ("1110101", 0x2C), ("1110110", 0x47), ("1110111", 0x42),
    ("11100000", 0x50), ("11100001", 0x76), ("11101000", 0x27), ("11101001", 0x66),
    ("11110001", 0x46), ("11110010", 0x71), ("11110011", 0x77), ("11110101", 0x57),
    ("11110110", 0x4A), ("11110111", 0x2A), ("111100000", 0x56), ("111100001", 0x6B),
    ("111101000", 0x4B), ("111101001", 0x2D), ("111110000", 0x7A), ("111110001", 0x59),
    ("111110010", 0x6A), ("111110011", 0x2B), ("111110101", 0x29), ("111110111", 0x3C),
    ("1111101000", 0x51), ("1111101001", 0x85), ("1111101100", 0x5A), ("1111101101", 0x8B),
    ("1111110001", 0x8A), ("1111110010", 0x87), ("1111110011", 0x3A), ("1111110101", 0x23),
    ("1111110111", 0x91), ("11111100000", 0x95), ("11111100001", 0x7E), ("11111101000", 0x7F),
    ("11111101001", 0x5D), ("11111101100", 0x78), ("11111101101", 0x58), ("11111110001", 0x32),
    ("11111110011", 0x31), ("11111110101", 0x3D), ("11111110110", 0x86), ("11111110111", 0x5E),
    ("111111100000", 0x88), ("111111100001", 0x60), ("111111100100", 0x30),
    ("111111100101", 0x83), ("111111101000", 0x2F), ("111111101001", 0x28),
    ("111111110000", 0x33), ("111111110001", 0x39), ("111111110010", 0x98),
    ("111111110011", 0x34), ("111111110101", 0x5C), ("111111110110", 0x22),
    ("111111110111", 0x90), ("1111111101000", 0x7D), ("1111111101001", 0x38),
    ("1111111110000", 0x26), ("1111111110001", 0x8D), ("1111111110010", 0x35),
    ("1111111110011", 0x36), ("1111111110100", 0x92), ("1111111110101", 0x8F),
    ("1111111110110", 0x8E), ("1111111110111", 0x93), ("1111111111001", 0x80),
    ("11111111110000", 0x8C), ("11111111110001", 0x37), ("11111111110100", 0x81),
    ("11111111110101", 0x99), ("11111111110110", 0x24), ("11111111110111", 0x40),
    ("11111111111001", 0x5F), ("11111111111010", 0x3E), ("11111111111011", 0x96),
    ("11111111111101", 0x09), ("111111111110000", 0x5B), ("111111111110001", 0x9A),
    ("111111111111000", 0x82), ("111111111111001", 0x25), ("111111111111100", 0x9C),
    ("111111111111101", 0x97), ("111111111111110", 0x7B), ("1111111111111110", 0x94),
    ("1111111111111111", 0x21),
];

/// The files of `sky.dsk` by number, as `sky.dnr` lists them.
#[derive(Debug)]
pub struct Disk {
    dsk: Vec<u8>,
    /// File number → (position, size, flags).
    files: HashMap<u16, (usize, usize, u32)>,
}

impl Disk {
    /// Reads `dir/sky.dnr` and `dir/sky.dsk`.
    ///
    /// # Errors
    /// When a file is missing, the index is not that of version 0.0372, or an entry points
    /// past the end of `sky.dsk` (the error names the entry's offset in `sky.dnr`).
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        let dnr_path = dir.join("sky.dnr");
        let dnr = std::fs::read(&dnr_path)
            .with_context(|| format!("{}: cannot read", dnr_path.display()))?;
        let dsk_path = dir.join("sky.dsk");
        let dsk = std::fs::read(&dsk_path)
            .with_context(|| format!("{}: cannot read", dsk_path.display()))?;
        if dnr.len() < 4 {
            bail!(
                "{}: {} bytes, too short for an index",
                dnr_path.display(),
                dnr.len()
            );
        }
        let count = u32::from_le_bytes([dnr[0], dnr[1], dnr[2], dnr[3]]) as usize;
        if count != FILES_0372 {
            bail!(
                "{}: {count} files; only the CD version 0.0372 ({FILES_0372} files) is supported (its text code differs from other versions')",
                dnr_path.display()
            );
        }
        if dnr.len() < 4 + 8 * count {
            bail!(
                "{}: {} bytes, too short for {count} entries of 8 bytes",
                dnr_path.display(),
                dnr.len()
            );
        }
        let mut files = HashMap::with_capacity(count);
        for k in 0..count {
            let at = 4 + 8 * k;
            let e = &dnr[at..at + 8];
            let number = u16::from_le_bytes([e[0], e[1]]);
            let offset = u32::from_le_bytes([e[2], e[3], e[4], 0]);
            let flags = u32::from_le_bytes([e[5], e[6], e[7], 0]);
            let position = if offset & 0x80_0000 != 0 {
                ((offset & 0x7F_FFFF) as usize) << 4
            } else {
                offset as usize
            };
            let size = (flags & 0x3F_FFFF) as usize;
            if position + size > dsk.len() {
                bail!(
                    "{} offset {at}: file {number} at {position} + {size} bytes lies past the end of sky.dsk ({} bytes)",
                    dnr_path.display(),
                    dsk.len()
                );
            }
            if files.insert(number, (position, size, flags)).is_some() {
                bail!(
                    "{} offset {at}: file {number} listed twice",
                    dnr_path.display()
                );
            }
        }
        Ok(Self { dsk, files })
    }

    /// Whether file `number` exists.
    pub fn has(&self, number: u16) -> bool {
        self.files.contains_key(&number)
    }

    /// File `number`'s contents: as stored, or header + unpacked RNC data.
    ///
    /// # Errors
    /// When the file does not exist or its RNC stream is corrupt (naming the file and its
    /// position in `sky.dsk`).
    pub fn load(&self, number: u16) -> anyhow::Result<Vec<u8>> {
        let &(position, size, flags) = self
            .files
            .get(&number)
            .with_context(|| format!("sky.dnr: no file {number}"))?;
        let stored = &self.dsk[position..position + size];
        let packed = flags & 0x80_0000 == 0
            && stored.len() >= HEADER_LEN + 4
            && stored[0] & 0x80 != 0
            && &stored[HEADER_LEN..HEADER_LEN + 4] == b"RNC\x01";
        if !packed {
            return Ok(stored.to_vec());
        }
        let unpacked = rnc::unpack(&stored[HEADER_LEN..]).with_context(|| {
            format!(
                "sky.dsk offset {}: file {number}'s RNC stream",
                position + HEADER_LEN
            )
        })?;
        Ok(if flags & 0x40_0000 != 0 {
            unpacked
        } else {
            [&stored[..HEADER_LEN], &unpacked[..]].concat()
        })
    }
}

/// Decodes the texts of one section file (see the module's documentation).
///
/// # Errors
/// When the offsets or a text run past the file, or a code is not in [`TEXT_CODE`]; the
/// message names `file` and the offset.
pub fn decode_section(data: &[u8], file: &str) -> anyhow::Result<Vec<String>> {
    let u16_at = |o: usize| -> anyhow::Result<usize> {
        data.get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
            .with_context(|| format!("{file}: offset {o} past the end ({} bytes)", data.len()))
    };
    let skip_ofs = u16_at(0)?;
    let bits_ofs = u16_at(2)?;
    if skip_ofs < 4 || bits_ofs < skip_ofs || bits_ofs > data.len() || skip_ofs % 2 != 0 {
        bail!(
            "{file}: offset 0: skip table at {skip_ofs}, bits at {bits_ofs} in {} bytes",
            data.len()
        );
    }
    let blocks: Vec<usize> = (0..(skip_ofs - 4) / 2)
        .map(|b| u16_at(4 + 2 * b))
        .collect::<anyhow::Result<_>>()?;
    let count = bits_ofs - skip_ofs;
    let mut codes: HashMap<(usize, u32), u8> = HashMap::new();
    for (code, byte) in TEXT_CODE {
        let value = code.bytes().fold(0u32, |v, b| (v << 1) | (b - b'0') as u32);
        codes.insert((code.len(), value), byte);
    }
    let bit = |position: usize| -> Option<u32> {
        data.get(position / 8)
            .map(|b| ((b >> (7 - position % 8)) & 1) as u32)
    };
    let mut texts = Vec::with_capacity(count);
    let mut units = 0usize;
    for i in 0..count {
        if i % 32 == 0 && i > 0 {
            units = blocks[..(i / 32).min(blocks.len())].iter().sum();
        }
        let start = bits_ofs * 8 + 2 * units;
        let mut position = start;
        let mut text = Vec::new();
        loop {
            let (mut value, mut length) = (0u32, 0usize);
            let byte = loop {
                let Some(b) = bit(position) else {
                    bail!(
                        "{file}: text {i} (bit {start}) runs past the end of the file at byte {}",
                        position / 8
                    );
                };
                value = (value << 1) | b;
                length += 1;
                position += 1;
                if let Some(&byte) = codes.get(&(length, value)) {
                    break byte;
                }
                if length > 16 {
                    bail!("{file}: text {i}: no code matches at byte {}", position / 8);
                }
            };
            if byte == 0 {
                break;
            }
            text.push(byte);
        }
        texts.push(text.iter().map(|&b| b as char).collect());
        let skip = data[skip_ofs + i] as usize;
        units += if skip >= 0x80 {
            (skip & 0x7F) * 8
        } else {
            skip
        };
    }
    Ok(texts)
}

/// A transcript as the game shows it, tidied: the backtick used as an opening quote becomes
/// `'`, runs of white space one space.
pub fn clean_text(text: &str) -> String {
    text.replace('`', "'")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// Every voiced line of the English texts in `dir` (`sky.dnr`, `sky.dsk`), and the texts
/// left out (those with a recording that cannot be used).
///
/// # Errors
/// When the index or a text section cannot be read or decoded.
pub fn read_clips(dir: &Path) -> anyhow::Result<(Vec<Clip>, Vec<String>)> {
    let disk = Disk::open(dir)?;
    let mut clips = Vec::new();
    let mut left_out = Vec::new();
    for (section, base) in SPEECH_BASE.iter().enumerate() {
        let number = 60600 + section as u16;
        if !disk.has(number) {
            continue;
        }
        let file = format!("sky.dsk file {number}");
        let texts = decode_section(&disk.load(number)?, &file)?;
        for (i, text) in texts.iter().enumerate() {
            let speech = 50000 + base + i as u32;
            let Ok(speech) = u16::try_from(speech) else {
                continue;
            };
            if !disk.has(speech) {
                continue;
            }
            let at = format!("{file} text {i}");
            let data = match disk.load(speech) {
                Ok(data) if data.len() > HEADER_LEN => data,
                Ok(data) => {
                    left_out.push(format!(
                        "{at}: speech file {speech} holds {} bytes, no samples",
                        data.len()
                    ));
                    continue;
                }
                Err(e) => {
                    left_out.push(format!("{at}: {e:#}"));
                    continue;
                }
            };
            let transcript = clean_text(text);
            if transcript.is_empty() {
                left_out.push(format!("{at}: speech file {speech} has an empty text"));
                continue;
            }
            clips.push(Clip {
                id: speech.to_string(),
                audio: ClipAudio::PcmU8 {
                    rate_hz: SPEECH_RATE_HZ,
                    samples: data[HEADER_LEN..].to_vec(),
                },
                transcript,
                speaker: format!("scene-{section}.{:03}", i / 32),
                at,
            });
        }
    }
    Ok((clips, left_out))
}
