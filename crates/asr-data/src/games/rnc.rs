//! Rob Northen Computing's ProPack compression, method 1 (`RNC\x01`), as *Beneath a Steel
//! Sky* packs its data files: an LZ77 stream whose literal-run lengths, match distances and
//! match lengths are Huffman-coded, per chunk, with CRC-16 checks of the packed and the
//! unpacked bytes.
//!
//! Layout (big-endian header of 18 bytes): `RNC\x01`, unpacked length (u32), packed length
//! (u32), CRC of the unpacked data (u16), CRC of the packed data (u16), leeway (u8), chunk
//! count (u8). The packed area interleaves a bit stream, read least-significant bit first in
//! little-endian 16-bit words fetched only when more bits are needed, with raw literal bytes
//! taken from the current byte position. The stream is two ignored bits, then per chunk:
//! three Huffman tables (literal-run length, match distance, match length; each a 5-bit
//! symbol count and 4-bit code lengths, canonical codes read most significant bit first), a
//! 16-bit step count, and that many literal runs separated by matches (distance + 1,
//! length + 2). A symbol `s ≥ 2` stands for `2^(s−1)` plus `s − 1` further bits.

/// Why an RNC stream cannot be unpacked; offsets are from the start of the stream.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RncError {
    /// The stream does not start with `RNC\x01`.
    #[error("not an RNC method-1 stream (signature {0:02x?})")]
    Signature(Vec<u8>),
    /// The stream ends before its header says.
    #[error("truncated at byte {0}: the header announces {1} packed bytes")]
    Truncated(usize, usize),
    /// A Huffman code matches no symbol.
    #[error("invalid Huffman code near byte {0}")]
    BadCode(usize),
    /// A table has more than 16 symbols or a chunk no steps.
    #[error("malformed chunk near byte {0}: {1}")]
    Malformed(usize, &'static str),
    /// A match reaches before the start of the output.
    #[error("match distance {distance} before the start of the output at {at} (byte {offset})")]
    Distance {
        /// The distance.
        distance: usize,
        /// Output bytes so far.
        at: usize,
        /// Stream byte.
        offset: usize,
    },
    /// The header announces more unpacked bytes than a Sky file holds.
    #[error(
        "the header announces {0} unpacked bytes, over the limit of {max} (a Sky file's size is 24-bit)",
        max = MAX_UNPACKED_LEN
    )]
    TooLong(usize),
    /// The output length or a CRC differs from the header's.
    #[error("{what}: header says {expected:#x}, the data gives {found:#x}")]
    Check {
        /// Which check.
        what: &'static str,
        /// The header's value.
        expected: u32,
        /// The computed value.
        found: u32,
    },
}

/// Length of the header.
pub const HEADER_LEN: usize = 18;

/// The most unpacked bytes a stream may announce: 16 MiB, the most a *Beneath a Steel Sky*
/// data file holds (`sky.dnr` and the files' headers give sizes in 24 bits). A header that
/// announces more is refused before anything is allocated.
pub const MAX_UNPACKED_LEN: usize = 1 << 24;

/// CRC-16/ARC (reflected polynomial 0xA001, initial value 0), as the RNC header stores.
pub fn crc16(bytes: &[u8]) -> u16 {
    let mut crc = 0u16;
    for &b in bytes {
        crc ^= b as u16;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xA001
            } else {
                crc >> 1
            };
        }
    }
    crc
}

struct Bits<'a> {
    packed: &'a [u8],
    pos: usize,
    buf: u32,
    count: u32,
}

impl Bits<'_> {
    fn read(&mut self, n: u32) -> Result<u32, RncError> {
        while self.count < n {
            let word = match self.packed.get(self.pos..self.pos + 2) {
                Some(w) => u16::from_le_bytes([w[0], w[1]]) as u32,
                // The stream may end inside the last words: up to 4 bytes past its end read
                // as zero.
                None if self.pos + 2 <= self.packed.len() + 4 => {
                    self.packed.get(self.pos).copied().unwrap_or(0) as u32
                }
                None => return Err(RncError::Truncated(self.pos, self.packed.len())),
            };
            self.buf |= word << self.count;
            self.pos += 2;
            self.count += 16;
        }
        let value = self.buf & ((1u32 << n) - 1);
        self.buf >>= n;
        self.count -= n;
        Ok(value)
    }
}

/// A canonical Huffman table: per code length, the first code, how many codes and where
/// their symbols start in `symbols` (codes of one length are consecutive).
struct Table {
    lengths: [(u32, u32, usize); 17],
    symbols: Vec<u32>,
}

impl Table {
    fn read(bits: &mut Bits) -> Result<Self, RncError> {
        let count = bits.read(5)?;
        if count > 16 {
            return Err(RncError::Malformed(bits.pos, "more than 16 symbols"));
        }
        let code_lengths: Vec<u32> = (0..count).map(|_| bits.read(4)).collect::<Result<_, _>>()?;
        let mut table = Table {
            lengths: [(0, 0, 0); 17],
            symbols: Vec::new(),
        };
        let mut counter = 0u32;
        for length in 1..=16u32 {
            let first = (counter >> (16 - length)) & 0xFFFF;
            let start = table.symbols.len();
            for (symbol, _) in code_lengths
                .iter()
                .enumerate()
                .filter(|(_, l)| **l == length)
            {
                table.symbols.push(symbol as u32);
                counter = (counter + (1 << (16 - length))) & 0xFFFF;
            }
            let n = (table.symbols.len() - start) as u32;
            table.lengths[length as usize] = (first, n, start);
        }
        Ok(table)
    }

    fn value(&self, bits: &mut Bits) -> Result<usize, RncError> {
        let mut code = 0u32;
        let mut symbol = None;
        for length in 1..=16 {
            code = (code << 1) | bits.read(1)?;
            let (first, n, start) = self.lengths[length];
            if code >= first && code - first < n {
                symbol = Some(self.symbols[start + (code - first) as usize]);
                break;
            }
        }
        let Some(symbol) = symbol else {
            return Err(RncError::BadCode(bits.pos));
        };
        Ok(if symbol < 2 {
            symbol as usize
        } else {
            ((1u32 << (symbol - 1)) | bits.read(symbol - 1)?) as usize
        })
    }
}

/// Unpacks an RNC method-1 stream (header included), checking the output length and both
/// CRCs.
///
/// # Errors
/// [`RncError`] with the byte offset where the stream goes wrong.
pub fn unpack(stream: &[u8]) -> Result<Vec<u8>, RncError> {
    if stream.len() < HEADER_LEN || &stream[..4] != b"RNC\x01" {
        return Err(RncError::Signature(stream[..stream.len().min(4)].to_vec()));
    }
    let be32 =
        |o: usize| u32::from_be_bytes([stream[o], stream[o + 1], stream[o + 2], stream[o + 3]]);
    let unpacked_len = be32(4) as usize;
    if unpacked_len > MAX_UNPACKED_LEN {
        return Err(RncError::TooLong(unpacked_len));
    }
    let packed_len = be32(8) as usize;
    let unpacked_crc = u16::from_be_bytes([stream[12], stream[13]]);
    let packed_crc = u16::from_be_bytes([stream[14], stream[15]]);
    let chunks = stream[17];
    let Some(packed) = stream.get(HEADER_LEN..HEADER_LEN + packed_len) else {
        return Err(RncError::Truncated(stream.len(), packed_len));
    };
    let found = crc16(packed);
    if found != packed_crc {
        return Err(RncError::Check {
            what: "CRC of the packed data",
            expected: packed_crc as u32,
            found: found as u32,
        });
    }
    let mut bits = Bits {
        packed,
        pos: 0,
        buf: 0,
        count: 0,
    };
    let mut out: Vec<u8> = Vec::with_capacity(unpacked_len);
    bits.read(2)?;
    for _ in 0..chunks {
        let runs = Table::read(&mut bits)?;
        let distances = Table::read(&mut bits)?;
        let lengths = Table::read(&mut bits)?;
        let steps = bits.read(16)?;
        if steps == 0 {
            return Err(RncError::Malformed(
                HEADER_LEN + bits.pos,
                "a chunk of no steps",
            ));
        }
        for step in 0..steps {
            let run = runs.value(&mut bits)?;
            if run > 0 {
                let Some(bytes) = packed.get(bits.pos..bits.pos + run) else {
                    return Err(RncError::Truncated(HEADER_LEN + bits.pos, packed_len));
                };
                out.extend_from_slice(bytes);
                bits.pos += run;
            }
            if step + 1 < steps {
                let distance = distances.value(&mut bits)? + 1;
                let length = lengths.value(&mut bits)? + 2;
                if distance > out.len() {
                    return Err(RncError::Distance {
                        distance,
                        at: out.len(),
                        offset: HEADER_LEN + bits.pos,
                    });
                }
                for _ in 0..length {
                    out.push(out[out.len() - distance]);
                }
            }
            if out.len() > unpacked_len {
                break;
            }
        }
    }
    if out.len() != unpacked_len {
        return Err(RncError::Check {
            what: "unpacked length",
            expected: unpacked_len as u32,
            found: out.len() as u32,
        });
    }
    let found = crc16(&out);
    if found != unpacked_crc {
        return Err(RncError::Check {
            what: "CRC of the unpacked data",
            expected: unpacked_crc as u32,
            found: found as u32,
        });
    }
    Ok(out)
}
