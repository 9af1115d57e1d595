//! *Flight of the Amazon Queen*, the rebuilt CD data CEM10 (`queen.1c`): every voiced
//! segment of the English texts, with its speaker.
//!
//! - `queen.1c` starts with `QTBL`, the version (`CEM10`), a compression byte (1: MP3) and a
//!   table of files (big-endian count, then per file a 12-byte name, a bundle byte, offset and
//!   size as u32).
//! - Texts are split into *segments* at `*` commands (two characters, `*XY` eleven more); the
//!   segment before the `n`-th command, and the rest after the last, is spoken from the file
//!   `prefix + hex(n)` + `.SB` (spaces in the first 8 characters written as `0`); `.SB` files
//!   are bare MP3 (MPEG 2.5 layer III, 11,025 Hz, mono).
//! - Joe's responses and the object descriptions are lines of `QUEEN2.JAS` (prefix
//!   `JOE%04d`, descriptions numbered after the 40 responses; description lines naming a
//!   `.DOG` or `.CUT` file are commands, not speech).
//! - Dialogues (`.DOG`, after a 20-byte header): the Joe and person lists, each entry a u16,
//!   an id and a length-prefixed string aligned to 4 bytes; prefixes `KKhhhhJ`/`KKhhhhP`
//!   (talk key in decimal, id in hex), the first greeting `KKSSSSJ`, the return greetings
//!   `KKXXXXP` and `KKXXXXJ`.
//! - Cutscenes (`.CUT`, after a 20-byte header): records of 17 words, a person list and, for
//!   animations, frames; the sentences (after an unspoken entry string) in record order;
//!   prefix = the name padded with `_` to 5 characters + the record number (`%02d`). Text
//!   records are spoken whole from `prefix + "1"`.
//! - Speakers: Joe, or the actor of the person object that speaks, found through
//!   `QUEEN.JAS`'s object, room and actor tables (its layout is parsed up to the version
//!   string, which checks the parse); a few objects change actor with the game's state and
//!   are named by [`SPEAKER_OVERRIDES`].
//! - Left out: [`NON_SPEECH`], the segments that are not English (ape talk, a chant, gagged
//!   mumbling, animal cries, sound effects, a cipher), found by a word-list rule (more than
//!   half of a segment's words are in no English word list, nor are names of the game or
//!   common interjections) and carried here since the data is fixed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use anyhow::{Context, bail};

use super::{Clip, ClipAudio};

/// `.SB` files whose segment is not English speech: made-up languages, mumbling, animal
/// cries, sound effects and lines that are only a sound tag such as `(sigh)`.
#[rustfmt::skip]
pub const NON_SPEECH: [&str; 140] = [
    "JOE01024", "JOE01071", "JOE01162", "JOE02201", "030001P3", "030006P3", "030009P1",
    "030008P3", "030007P1", "030028P1", "03002AP1", "03002BP1", "03001EP1", "03001EP3",
    "030025P2", "030026P1", "030026P2", "0300BDP1", "0300BEP2", "0300BFP1", "0300C0P1",
    "0300C0P4", "0303B9P2", "0303BAP1", "0303BBP2", "0303BCP1", "0312B4P3", "0300B8P2",
    "0300BAP3", "0300BBP1", "0300B9P1", "035D99P1", "03XXXXP2", "190001P2", "190006P1",
    "190007P1", "190008P1", "190009P1", "19XXXXP2", "1200B5J1", "1800A5P3", "660006P1",
    "6600A9P1", "66XXXXP1", "330025P4", "330025P7", "330025P8", "39001EP1", "48040BP4",
    "500028J1", "500023P1", "790001P1", "790001P2", "790006P1", "790007P1", "790008P1",
    "790008P2", "790008P3", "79001EP1", "790028P1", "790028P2", "7900CCP1", "7900CCP2",
    "790023P1", "790023P2", "79XXXXP1", "57001EP4", "57001EP5", "57001EP6", "580009P1",
    "580006P1", "580006P3", "580007P1", "580008P1", "580008P3", "780001P2", "780006P1",
    "780007P1", "780008P1", "780009P1", "78XXXXP2", "610025P4", "C103F151", "C13E_041",
    "C13G_011", "C18E_222", "C20A_042", "C20A_046", "C20A_048", "C20A_063", "C20A_064",
    "C20F_054", "C20F_058", "C20F_05A", "C20F_073", "C20F_074", "C21E_182", "C21L_021",
    "C21N_021", "C30C_131", "C41C_011", "C41C_032", "C50B_011", "C51B_011", "C51C_011",
    "C51D_011", "C5C__021", "C5C__051", "C5C__053", "C5C__071", "C5C__074", "C5C__091",
    "C5C__094", "C5C__111", "C5C__114", "C67A_111", "C69B_021", "C69B_121", "C69I_111",
    "C69I_131", "C6B__023", "C6C__011", "C6C__013", "C70D_243", "C73B_092", "C97B_021",
    "C97B_041", "COMIC111", "COMIC131", "COMIC231", "COMIC241", "COMIC251", "COMIC261",
    "COMIC311", "COMIC321", "COMIC331", "COMIC351", "COMIC361", "COMIC371", "GM___011",
];

/// Speakers of person objects whose actor depends on the game's state:
/// `(cutscene, object, first record, speaker)`; in cutscenes `C69A`…`C69O` objects 517 and
/// 518 are Sparky and Azura too (after `C69Z` turns Frank into Sparky and starts the fight).
pub const SPEAKER_OVERRIDES: [(&str, i16, usize, &str); 10] = [
    ("C18B.CUT", 122, 1, "AZURA"),
    ("C18C.CUT", 122, 1, "AZURA"),
    ("C41B.CUT", 292, 1, "ANDERSON"),
    ("C42A.CUT", 306, 1, "DEATH"),
    ("C42C.CUT", 306, 1, "DEATH"),
    ("C42D.CUT", 306, 1, "DEATH"),
    ("C42E.CUT", 306, 1, "DEATH"),
    ("C42F.CUT", 306, 1, "DEATH"),
    ("C69Z.CUT", 517, 45, "SPARKY"),
    ("C69Z.CUT", 518, 58, "AZURA"),
];

fn override_speaker(file: &str, object: i16, record: usize) -> Option<&'static str> {
    let in_c69 = file.len() == 8
        && file.starts_with("C69")
        && (b'A'..=b'O').contains(&file.as_bytes()[3])
        && file.ends_with(".CUT");
    if in_c69 && object == 517 {
        return Some("SPARKY");
    }
    if in_c69 && object == 518 {
        return Some("AZURA");
    }
    SPEAKER_OVERRIDES
        .iter()
        .filter(|(f, o, from, _)| *f == file && *o == object && record >= *from)
        .map(|(_, _, _, s)| *s)
        .next_back()
}

/// The bundle: the table of files and the data.
pub struct Bundle {
    data: Vec<u8>,
    /// Name (upper case) → (offset, size).
    files: BTreeMap<String, (usize, usize)>,
    /// Version string, e.g. `CEM10`.
    pub version: String,
}

impl Bundle {
    /// Reads `path` (`queen.1c`).
    ///
    /// # Errors
    /// When it is not a rebuilt bundle of the English CD version with MP3 speech, or an entry
    /// lies past its end (named with its table offset).
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let data =
            std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
        let name = path.display();
        if data.len() < 15 || &data[..4] != b"QTBL" {
            bail!("{name}: offset 0: not a rebuilt bundle (no QTBL signature)");
        }
        let version: String = data[4..10]
            .iter()
            .take_while(|&&b| b != 0)
            .map(|&b| b as char)
            .collect();
        if !(version.starts_with("CE") && version.ends_with("M10")) {
            bail!(
                "{name}: offset 4: version {version:?}; only the English CD data CEM10 is supported"
            );
        }
        if data[12] != 1 {
            bail!(
                "{name}: offset 12: speech compression {}; only MP3 (1) is supported",
                data[12]
            );
        }
        let count = u16::from_be_bytes([data[13], data[14]]) as usize;
        if data.len() < 15 + 21 * count {
            bail!(
                "{name}: {} bytes, too short for a table of {count} files",
                data.len()
            );
        }
        let mut files = BTreeMap::new();
        for k in 0..count {
            let at = 15 + 21 * k;
            let entry = &data[at..at + 21];
            let file: String = entry[..12]
                .iter()
                .take_while(|&&b| b != 0)
                .map(|&b| b.to_ascii_uppercase() as char)
                .collect();
            let offset = u32::from_be_bytes([entry[13], entry[14], entry[15], entry[16]]) as usize;
            let size = u32::from_be_bytes([entry[17], entry[18], entry[19], entry[20]]) as usize;
            if offset + size > data.len() {
                bail!(
                    "{name}: offset {at}: {file} at {offset} + {size} bytes lies past the end ({} bytes)",
                    data.len()
                );
            }
            files.insert(file, (offset, size));
        }
        Ok(Self {
            data,
            files,
            version,
        })
    }

    /// Whether the bundle holds `name` (any case).
    pub fn has(&self, name: &str) -> bool {
        self.files.contains_key(&name.to_ascii_uppercase())
    }

    /// A file's bytes.
    ///
    /// # Errors
    /// When the bundle does not hold it.
    pub fn get(&self, name: &str) -> anyhow::Result<File<'_>> {
        let &(offset, size) = self
            .files
            .get(&name.to_ascii_uppercase())
            .with_context(|| format!("queen.1c: no file {name}"))?;
        Ok(File {
            name: name.to_ascii_uppercase(),
            offset,
            data: &self.data[offset..offset + size],
        })
    }

    /// Names of the files with extension `ext` (e.g. `.DOG`), sorted.
    pub fn names_with(&self, ext: &str) -> Vec<String> {
        self.files
            .keys()
            .filter(|n| n.ends_with(ext))
            .cloned()
            .collect()
    }
}

/// One file of the bundle, read with bounds checks; errors name the file and the offset.
pub struct File<'a> {
    name: String,
    offset: usize,
    data: &'a [u8],
}

impl File<'_> {
    fn error(&self, at: usize, what: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "queen.1c: {} offset {at} (byte {} of queen.1c): {what}",
            self.name,
            self.offset + at
        )
    }

    fn i16(&self, at: usize) -> anyhow::Result<i16> {
        self.data
            .get(at..at + 2)
            .map(|b| i16::from_be_bytes([b[0], b[1]]))
            .ok_or_else(|| self.error(at, "past the end of the file"))
    }

    fn u16(&self, at: usize) -> anyhow::Result<usize> {
        Ok(self.i16(at)? as u16 as usize)
    }

    /// A length-prefixed string; the next offset is rounded up to `align` unless the string
    /// is empty.
    fn pstring(&self, at: usize, align: usize) -> anyhow::Result<(String, usize)> {
        let len = *self
            .data
            .get(at)
            .ok_or_else(|| self.error(at, "string past the end of the file"))?
            as usize;
        let bytes = self
            .data
            .get(at + 1..at + 1 + len)
            .ok_or_else(|| self.error(at, "string past the end of the file"))?;
        let text = bytes.iter().map(|&b| b as char).collect();
        let next = if len > 0 {
            (at + 1 + len).div_ceil(align) * align
        } else {
            at + 1
        };
        Ok((text, next))
    }

    /// The file after its 20-byte bank header (offsets in the file are relative to it).
    fn body(&self) -> anyhow::Result<File<'_>> {
        if self.data.len() < 20 {
            return Err(self.error(0, "shorter than its 20-byte header"));
        }
        Ok(File {
            name: self.name.clone(),
            offset: self.offset + 20,
            data: &self.data[20..],
        })
    }
}

/// The parts of `QUEEN.JAS` and `QUEEN2.JAS` that name speakers and Joe's lines.
#[derive(Default)]
struct Jas {
    /// Objects (1-based; index 0 unused): name, x, y, description, entry, room, state, image.
    objects: Vec<[i16; 8]>,
    /// `rooms[r]`: the last object before room `r` (1-based).
    rooms: Vec<usize>,
    /// Commands (1-based): verb, noun 1, noun 2, ….
    commands: Vec<[i16; 10]>,
    /// Command game states (1-based): command, slot, value, speak value.
    game_states: Vec<[i16; 4]>,
    /// Actors (1-based): room, bob, name, …, colour (5), ….
    actors: Vec<[i16; 12]>,
    descriptions: Vec<String>,
    joe: Vec<String>,
    actor_names: Vec<String>,
}

fn read_jas(bundle: &Bundle) -> anyhow::Result<Jas> {
    let file = bundle.get("QUEEN.JAS")?;
    let q = file.body()?;
    let mut p = 0usize;
    let word = |p: &mut usize| -> anyhow::Result<i16> {
        let v = q.i16(*p)?;
        *p += 2;
        Ok(v)
    };
    let words =
        |p: &mut usize, n: usize| -> anyhow::Result<Vec<i16>> { (0..n).map(|_| word(p)).collect() };
    let counts = words(&mut p, 4)?;
    let [rooms, names, objects, descriptions] =
        [counts[0], counts[1], counts[2], counts[3]].map(|c| c.max(0) as usize);
    let mut jas = Jas::default();
    jas.objects.push([0; 8]);
    for _ in 0..objects {
        jas.objects
            .push(words(&mut p, 8)?.try_into().expect("8 words"));
    }
    jas.rooms.push(0);
    for w in words(&mut p, rooms + 1)? {
        jas.rooms.push(w as u16 as usize);
    }
    p += 2 * rooms; // room sound effects
    let n = words(&mut p, 1)?[0].max(0) as usize; // items
    p += 10 * n;
    let n = words(&mut p, 1)?[0].max(0) as usize; // graphics
    p += 10 * n;
    for _ in 0..rooms {
        let areas = words(&mut p, 2)?[1].max(0) as usize; // object max, area max
        p += 16 * areas;
    }
    p += 8 * objects; // object boxes
    let n = words(&mut p, 1)?[0].max(0) as usize; // walk-offs
    p += 6 * n;
    let n = words(&mut p, 1)?[0].max(0) as usize; // object description control
    p += 8 * n;
    let n = words(&mut p, 1)?[0].max(0) as usize;
    jas.commands.push([0; 10]);
    for _ in 0..n.max(1) {
        jas.commands
            .push(words(&mut p, 10)?.try_into().expect("10 words"));
    }
    for _ in 0..3 {
        let n = words(&mut p, 1)?[0].max(0) as usize; // command areas, objects, inventory
        p += 6 * n.max(1);
    }
    let n = words(&mut p, 1)?[0].max(0) as usize;
    jas.game_states.push([0; 4]);
    for _ in 0..n.max(1) {
        jas.game_states
            .push(words(&mut p, 4)?.try_into().expect("4 words"));
    }
    p += 2; // entry object
    let n = words(&mut p, 1)?[0].max(0) as usize; // furniture
    p += 4 * n;
    let counts = words(&mut p, 4)?;
    let [actors, actor_anims, actor_names, actor_files] =
        [counts[0], counts[1], counts[2], counts[3]].map(|c| c.max(0) as usize);
    jas.actors.push([0; 12]);
    for _ in 0..actors {
        jas.actors
            .push(words(&mut p, 12)?.try_into().expect("12 words"));
    }
    let n = words(&mut p, 1)?[0].max(0) as usize; // graphic animations
    p += 6 * n.max(1);
    let version = bundle.version.as_bytes();
    if q.data.get(p..p + version.len()) != Some(version) {
        return Err(q.error(
            p,
            &format!(
                "the tables should end with the version string {:?}",
                bundle.version
            ),
        ));
    }
    let text = bundle.get("QUEEN2.JAS")?;
    let text: String = text.data.iter().map(|&b| b as char).collect();
    let mut lines: Vec<String> = text.split("\r\n").map(String::from).collect();
    if lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    let sizes = [
        descriptions,
        names,
        rooms,
        12,
        40,
        actor_anims,
        actor_names,
        actor_files,
    ];
    if sizes.iter().sum::<usize>() != lines.len() {
        bail!(
            "queen.1c: QUEEN2.JAS has {} lines, QUEEN.JAS's counts make {}",
            lines.len(),
            sizes.iter().sum::<usize>()
        );
    }
    let mut rest = lines.into_iter();
    let mut take = |n: usize| rest.by_ref().take(n).collect::<Vec<_>>();
    jas.descriptions = take(descriptions);
    take(names + rooms + 12);
    jas.joe = take(40);
    take(actor_anims);
    jas.actor_names = take(actor_names);
    Ok(jas)
}

impl Jas {
    /// The actors that can stand for person object `object`: those of its room whose bob
    /// number is the object's rank among the room's person objects, in table order.
    fn candidates(&self, object: i16) -> Vec<String> {
        let Some(o) = usize::try_from(object)
            .ok()
            .filter(|&o| o > 0 && o < self.objects.len())
        else {
            return Vec::new();
        };
        let room = self.objects[o][5];
        let Some(&first) = usize::try_from(room).ok().and_then(|r| self.rooms.get(r)) else {
            return Vec::new();
        };
        let bob = (first + 1..=o)
            .filter(|&i| matches!(self.objects.get(i).map(|x| x[7]), Some(-3 | -4)))
            .count() as i16;
        self.actors[1..]
            .iter()
            .filter(|a| a[0] == room && a[1] == bob)
            .filter_map(|a| {
                self.actor_names
                    .get((a[2] as usize).wrapping_sub(1))
                    .cloned()
            })
            .collect()
    }

    /// The speaker of person object `object`: the candidate named like `hint` (a dialogue
    /// file), else the first.
    fn speaker(&self, object: i16, hint: &str) -> String {
        let candidates = self.candidates(object);
        let hint: String = hint
            .chars()
            .take(3)
            .collect::<String>()
            .to_ascii_uppercase();
        let chosen = candidates
            .iter()
            .find(|c| hint.len() == 3 && c.starts_with(&hint))
            .or(candidates.first());
        chosen.map_or_else(|| super::UNKNOWN_SPEAKER.to_string(), |c| canonical(c))
    }
}

/// One character's speaker label from an actor name: `X<digits>_` prefixes and `-H`, `-E`,
/// `-F`, `_STAND`, `_SHOWER` suffixes dropped, variants merged.
pub fn canonical(actor: &str) -> String {
    let mut a = actor;
    if let Some((digits, tail)) = a.strip_prefix('X').and_then(|rest| rest.split_once('_'))
        && !digits.is_empty()
        && digits.chars().all(|c| c.is_ascii_digit())
    {
        a = tail;
    }
    for suffix in ["-H", "-E", "-F", "_STAND", "_SHOWER"] {
        if let Some(stripped) = a.strip_suffix(suffix) {
            a = stripped;
            break;
        }
    }
    match a {
        "ANDSON" => "ANDERSON",
        "APE1" | "APE2" => "APE",
        "ZOMBIE2" | "ZOMBIE3" => "ZOMBIE",
        "PRINCESS1" | "PRINCESS2" => "AZURA",
        other => other,
    }
    .to_string()
}

/// The segments of a sentence: `(number, text, spoken)`, numbered from 1; a segment ends at
/// each `*` command, whose number it takes; the grab commands `GD`/`GM` are not spoken.
pub fn segments(sentence: &str) -> Vec<(usize, String, bool)> {
    let chars: Vec<char> = sentence.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut start) = (0, 0);
    while i < chars.len() {
        if chars[i] == '*' {
            let text: String = chars[start..i].iter().collect();
            let command: String = chars[(i + 1).min(chars.len())..(i + 3).min(chars.len())]
                .iter()
                .collect();
            i += 3 + if command == "XY" { 11 } else { 0 };
            out.push((out.len() + 1, text, command != "GD" && command != "GM"));
            start = i.min(chars.len());
        } else {
            i += 1;
        }
    }
    if start < chars.len() {
        out.push((out.len() + 1, chars[start..].iter().collect(), true));
    }
    out
}

/// The voice file of segment `number` of a sentence with prefix `prefix`.
pub fn voice_file(prefix: &str, number: usize) -> String {
    let name: String = format!("{prefix}{number:x}")
        .chars()
        .enumerate()
        .map(|(i, c)| if i < 8 && c == ' ' { '0' } else { c })
        .collect();
    format!("{name}.SB").to_ascii_uppercase()
}

/// A segment as a transcript: the trademark glyph `^_` and the singing mark `@` dropped,
/// white space collapsed.
pub fn clean_text(text: &str) -> String {
    text.replace("^_", "")
        .replace('@', "")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// A sentence to be spoken: where it is, its voice-file prefix, its text and speaker.
struct Sentence {
    at: String,
    prefix: String,
    text: String,
    speaker: String,
    /// Spoken whole from `prefix + "1"` (cutscene text records).
    whole: bool,
}

/// The entries of a `.DOG` list: `(id, text)`.
fn dog_list(d: &File, mut at: usize, n: usize) -> anyhow::Result<Vec<(i16, String)>> {
    let mut out = Vec::new();
    for _ in 0..n {
        let id = d.i16(at + 2)?;
        let (text, next) = d.pstring(at + 4, 4)?;
        out.push((id, text));
        at = next;
    }
    Ok(out)
}

fn read_dog(
    bundle: &Bundle,
    name: &str,
    person: &str,
) -> anyhow::Result<(Vec<Sentence>, Vec<String>)> {
    let file = bundle.get(name)?;
    let d = file.body()?;
    let levels = d.i16(0)?.unsigned_abs() as usize;
    let key = d.i16(4)?;
    let (joe_count, person_count) = (d.i16(6)?.max(0) as usize, d.i16(8)?.max(0) as usize);
    let (person_at, return_at) = (d.u16(22)?, d.u16(26)?);
    let joe_at = 32 + 96 * levels;
    let key = format!("{key:2}");
    let mut sentences = Vec::new();
    let mut left_out = Vec::new();
    let mut push = |prefix: String, text: String, speaker: &str| {
        sentences.push(Sentence {
            at: format!("queen.1c: {name} {}", prefix.trim()),
            prefix,
            text,
            speaker: speaker.to_string(),
            whole: false,
        })
    };
    let has_no_greeting = d.u16(joe_at + 2)? != 0;
    let (greeting, _) = d.pstring(joe_at + 4, 2)?;
    if !has_no_greeting && !greeting.starts_with('0') {
        push(format!("{key}SSSSJ"), greeting, "JOE");
    }
    for (list, who, count, at) in [
        ("J", "JOE", joe_count, joe_at),
        ("P", person, person_count, person_at),
    ] {
        let mut seen = BTreeSet::new();
        for (id, text) in dog_list(&d, at, count)? {
            if id <= 0 {
                continue;
            }
            if !seen.insert(id) {
                left_out.push(format!(
                    "queen.1c: {name} {list} id {id:#x}: a second entry with this id, never reached"
                ));
                continue;
            }
            push(format!("{key}{id:4x}{list}"), text, who);
        }
    }
    let (first, next) = d.pstring(return_at, 2)?;
    let (second, _) = d.pstring(next, 2)?;
    if !first.is_empty() && !first.starts_with('0') {
        push(format!("{key}XXXXP"), first, person);
    }
    if !second.is_empty() && !second.starts_with('0') {
        push(format!("{key}XXXXJ"), second, "JOE");
    }
    Ok((sentences, left_out))
}

/// A cutscene record: number, object, kind, sentence, room, text colour.
struct Record {
    number: usize,
    object: i16,
    kind: RecordKind,
    sentence: String,
    room: i16,
    colour: i16,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum RecordKind {
    Person,
    Animation,
    None,
    Text,
    SilentText,
}

/// A cutscene's records, its dialogue file and the object it talks to.
fn read_cut(bundle: &Bundle, jas: &Jas, name: &str) -> anyhow::Result<(Vec<Record>, String, i16)> {
    let file = bundle.get(name)?;
    let d = file.body()?;
    let count = d.i16(2)?.unsigned_abs() as usize;
    let (states_at, mut sentence_at, bank_at) = (d.u16(6)?, d.u16(8)?, d.u16(10)?);
    (_, sentence_at) = d.pstring(sentence_at, 2)?; // the entry string, not spoken
    let mut p = 12;
    let mut room = 0;
    let mut records = Vec::with_capacity(count);
    for number in 1..=count {
        let f: Vec<i16> = (0..17)
            .map(|k| d.i16(p + 2 * k))
            .collect::<anyhow::Result<_>>()?;
        p += 34;
        let persons = d.i16(p)?.max(0) as usize;
        p += 2 + 2 * persons;
        let (sentence, next) = d.pstring(sentence_at, 2)?;
        sentence_at = next;
        let (mut object, animations, execute, from_object) = (f[0], f[4], f[5], f[12]);
        if f[15] != 0 {
            room = f[15];
        }
        if object == -1 {
            object = 0;
        }
        let is_person = |o: i16| {
            usize::try_from(o)
                .ok()
                .and_then(|o| jas.objects.get(o))
                .is_none_or(|x| matches!(x[7], -3 | -4))
        };
        let mut kind = RecordKind::Animation;
        if (object > 0 && animations == 0 && is_person(object)) || (object == 0 && animations == 0)
        {
            kind = RecordKind::Person;
        }
        if from_object > 0 {
            kind = RecordKind::None;
        }
        match object {
            -2 | -3 => kind = RecordKind::Text,
            -4 => kind = RecordKind::SilentText,
            _ => {}
        }
        if kind == RecordKind::Animation && execute == 0 {
            kind = RecordKind::None;
        }
        if kind == RecordKind::Animation {
            loop {
                let header = d.i16(p)?;
                p += 2;
                if header == -2 {
                    break;
                }
                p += 18;
            }
        }
        records.push(Record {
            number,
            object,
            kind,
            sentence,
            room,
            colour: f[10],
        });
    }
    if p + 4 == states_at && d.i16(p)? == -2 {
        p += 2; // a stray empty animation list after the last record
    }
    if p + 2 != states_at {
        return Err(d.error(
            p,
            &format!("the records end here, but the game-state block starts at {states_at}"),
        ));
    }
    let banks = d.u16(bank_at)?;
    let mut at = bank_at + 2;
    for _ in 0..banks {
        (_, at) = d.pstring(at, 2)?;
    }
    let (talk_file, at) = d.pstring(at, 2)?;
    let talk_to = d.i16(at)?;
    Ok((records, talk_file.to_ascii_uppercase(), talk_to))
}

fn cut_prefix(name: &str, record: usize) -> String {
    let base: String = name
        .trim_end_matches(".CUT")
        .chars()
        .chain("_____".chars())
        .take(5)
        .collect();
    let number: String = format!("{record:02}").chars().take(2).collect();
    format!("{base}{number}")
}

/// Every voiced segment of the English texts in `dir/queen.1c`, and the lines left out with
/// the reason.
///
/// # Errors
/// When the bundle or one of its text files is malformed (the message names the file and
/// the offset).
pub fn read_clips(dir: &Path) -> anyhow::Result<(Vec<Clip>, Vec<String>)> {
    let bundle = Bundle::open(&dir.join("queen.1c"))?;
    let mut left_out = Vec::new();
    let jas = if bundle.has("QUEEN.JAS") || bundle.has("QUEEN2.JAS") {
        read_jas(&bundle)?
    } else {
        left_out.push(
            "queen.1c: no QUEEN.JAS: no descriptions read, speakers other than Joe unknown"
                .to_string(),
        );
        Jas::default()
    };
    // Joe's responses (voice files JOE0001…) and the object descriptions (after them), less
    // the description lines that name a dialogue or cutscene to start.
    let responses = jas
        .joe
        .iter()
        .enumerate()
        .map(|(i, l)| ("response", i + 1, i + 1, l));
    let descriptions = jas
        .descriptions
        .iter()
        .enumerate()
        .map(|(i, l)| ("description", i + 1, i + 41, l))
        .filter(|(_, _, _, l)| {
            let upper = l.to_ascii_uppercase();
            !(upper.ends_with(".DOG") || upper.ends_with(".CUT"))
        });
    let mut sentences: Vec<Sentence> = responses
        .chain(descriptions)
        .map(|(kind, line, number, text)| Sentence {
            at: format!("queen.1c: QUEEN2.JAS {kind} {line}"),
            prefix: format!("JOE{number:04}"),
            text: text.clone(),
            speaker: "JOE".to_string(),
            whole: false,
        })
        .collect();
    // Who each dialogue is with: the objects whose "talk to" command or cutscene opens it.
    let mut dog_objects: HashMap<String, Vec<i16>> = HashMap::new();
    for state in jas.game_states.iter().skip(1) {
        let speak = state[3] as u16 as usize;
        if let Some(file) = speak.checked_sub(1).and_then(|s| jas.descriptions.get(s)) {
            let file = file.to_ascii_uppercase();
            if file.ends_with(".DOG")
                && let Some(command) = usize::try_from(state[0])
                    .ok()
                    .and_then(|c| jas.commands.get(c))
            {
                dog_objects.entry(file).or_default().push(command[1]);
            }
        }
    }
    let mut cuts = Vec::new();
    for name in bundle.names_with(".CUT") {
        let (records, talk_file, talk_to) = read_cut(&bundle, &jas, &name)?;
        if talk_file.ends_with(".DOG") && talk_to > 0 {
            dog_objects.entry(talk_file).or_default().push(talk_to);
        }
        cuts.push((name, records));
    }
    for name in bundle.names_with(".DOG") {
        let mut candidates: Vec<String> = Vec::new();
        for &object in dog_objects.get(&name).into_iter().flatten() {
            for c in jas.candidates(object) {
                if !candidates.contains(&c) {
                    candidates.push(c);
                }
            }
        }
        let hint = name.chars().take(3).collect::<String>();
        let person = candidates
            .iter()
            .find(|c| c.starts_with(&hint))
            .or(candidates.first())
            .map_or_else(|| super::UNKNOWN_SPEAKER.to_string(), |c| canonical(c));
        let (dog, unreachable) = read_dog(&bundle, &name, &person)?;
        sentences.extend(dog);
        left_out.extend(unreachable);
    }
    for (name, records) in &cuts {
        let speaker_of = |r: &Record| {
            override_speaker(name, r.object, r.number)
                .map(String::from)
                .unwrap_or_else(|| jas.speaker(r.object, ""))
        };
        // The speakers of the cutscene's person records by their text colour.
        let mut by_colour: HashMap<i16, BTreeSet<String>> = HashMap::new();
        for r in records
            .iter()
            .filter(|r| r.kind == RecordKind::Person && r.object > 0)
        {
            let label = speaker_of(r);
            for a in jas.actors.iter().skip(1) {
                let actor = jas.actor_names.get((a[2] as usize).wrapping_sub(1));
                if actor.is_some_and(|n| canonical(n) == label) {
                    by_colour.entry(a[5]).or_default().insert(label.clone());
                }
            }
        }
        for r in records {
            let s = &r.sentence;
            if !matches!(r.kind, RecordKind::Person | RecordKind::Text)
                || s.is_empty()
                || s == "*"
                || s.starts_with('#')
            {
                continue;
            }
            let speaker = if r.kind == RecordKind::Text {
                text_speaker(&jas, r, &by_colour)
            } else if r.object == 0 {
                "JOE".to_string()
            } else {
                speaker_of(r)
            };
            sentences.push(Sentence {
                at: format!("queen.1c: {name} record {}", r.number),
                prefix: cut_prefix(name, r.number),
                text: s.clone(),
                speaker,
                whole: r.kind == RecordKind::Text,
            });
        }
    }
    let non_speech: BTreeSet<&str> = NON_SPEECH.iter().copied().collect();
    let mut clips = Vec::new();
    let mut taken = BTreeSet::new();
    for sentence in sentences {
        let parts = if sentence.whole {
            vec![(1, sentence.text.clone(), true)]
        } else {
            segments(&sentence.text)
        };
        for (number, text, spoken) in parts {
            let transcript = clean_text(&text);
            if !spoken || !transcript.chars().any(|c| c.is_ascii_alphanumeric()) {
                continue;
            }
            let file = voice_file(&sentence.prefix, number);
            let id = file.trim_end_matches(".SB").to_string();
            let at = format!("{} segment {number} ({file})", sentence.at);
            if !bundle.has(&file) {
                left_out.push(format!("{at}: no voice file for {transcript:?}"));
                continue;
            }
            if !taken.insert(file.clone()) {
                left_out.push(format!("{at}: the voice file is already another line's"));
                continue;
            }
            if non_speech.contains(id.as_str()) {
                left_out.push(format!("{at}: not English speech: {transcript:?}"));
                continue;
            }
            // Decoded by `import_game`, which leaves out a stream it cannot decode.
            clips.push(Clip {
                id,
                audio: ClipAudio::Mp3(bundle.get(&file)?.data.to_vec()),
                transcript,
                speaker: sentence.speaker.clone(),
                at,
            });
        }
    }
    Ok((clips, left_out))
}

/// The speaker of a cutscene text record, from its colour: Joe's (14), else the one person
/// of the cutscene, or failing that of the room, with that colour.
fn text_speaker(jas: &Jas, record: &Record, by_colour: &HashMap<i16, BTreeSet<String>>) -> String {
    if record.colour == 14 {
        return "JOE".to_string();
    }
    if let Some(names) = by_colour.get(&record.colour).filter(|n| n.len() == 1) {
        return names.iter().next().expect("one name").clone();
    }
    let names: BTreeSet<String> = jas
        .actors
        .iter()
        .skip(1)
        .filter(|a| a[0] == record.room && a[5] == record.colour)
        .filter_map(|a| jas.actor_names.get((a[2] as usize).wrapping_sub(1)))
        .map(|n| canonical(n))
        .collect();
    if names.len() == 1 {
        names.into_iter().next().expect("one name")
    } else {
        super::UNKNOWN_SPEAKER.to_string()
    }
}
