//! Audio input and output: any of [`FORMATS`] at any sample rate in, 16 kHz mono out.
//!
//! Decoding is `symphonia`'s (all but FLAC) and `claxon`'s (FLAC), resampling `rubato`'s (FFT resampler), FLAC encoding `flacenc`'s.

use std::path::{Path, PathBuf};

use rubato::{FftFixedInOut, Resampler};
use symphonia::core::audio::SampleBuffer;
use symphonia::core::codecs::DecoderOptions;
use symphonia::core::errors::Error as SymphoniaError;
use symphonia::core::formats::FormatOptions;
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::Hint;

/// The model's sample rate, in Hz.
pub const SAMPLE_RATE_HZ: usize = 16_000;

/// The audio formats read (containers and codecs of the `symphonia` features enabled, FLAC
/// through `claxon`), as named in error messages.
pub const FORMATS: &str =
    "WAV (PCM, ADPCM), FLAC, Ogg Vorbis, MP3, AAC or ALAC in MP4/M4A, MKV/WebM";

/// An audio file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AudioError {
    /// The file cannot be opened.
    #[error("{}: cannot open the audio file: {source}", .path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is in none of [`FORMATS`], or its samples cannot be decoded.
    #[error("{}: corrupt or unsupported audio: {reason}", .path.display())]
    Decode {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

/// Reads an audio file in one of [`FORMATS`], mixes it to mono and resamples it to [`SAMPLE_RATE_HZ`].
///
/// Returns the samples in `[-1, 1]`.
///
/// # Errors
/// [`AudioError`] naming the file when it cannot be opened or decoded.
pub fn load_audio(path: &Path) -> Result<Vec<f32>, AudioError> {
    let bytes = std::fs::read(path).map_err(|source| AudioError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    decode_audio(bytes, path)
}

/// Decodes audio bytes in one of [`FORMATS`] (`path` names them in errors and gives the format hint), mixes
/// them to mono and resamples them to [`SAMPLE_RATE_HZ`].
///
/// # Errors
/// [`AudioError::Decode`] naming `path`.
pub fn decode_audio(bytes: Vec<u8>, path: &Path) -> Result<Vec<f32>, AudioError> {
    let decode = |reason: String| AudioError::Decode {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.starts_with(b"fLaC") {
        return decode_flac(&bytes, path);
    }
    let stream = MediaSourceStream::new(Box::new(std::io::Cursor::new(bytes)), Default::default());
    let mut hint = Hint::new();
    if let Some(ext) = path.extension().and_then(|e| e.to_str()) {
        hint.with_extension(ext);
    }
    let probed = symphonia::default::get_probe()
        .format(
            &hint,
            stream,
            &FormatOptions::default(),
            &MetadataOptions::default(),
        )
        .map_err(|e| decode(format!("not a format this reads ({FORMATS}): {e}")))?;
    let mut format = probed.format;
    let track = format
        .default_track()
        .ok_or_else(|| decode("no audio track".into()))?;
    let track_id = track.id;
    let rate = track
        .codec_params
        .sample_rate
        .ok_or_else(|| decode("unknown sample rate".into()))? as usize;
    let mut decoder = symphonia::default::get_codecs()
        .make(&track.codec_params, &DecoderOptions::default())
        .map_err(|e| decode(e.to_string()))?;
    let mut mono = Vec::new();
    loop {
        let packet = match format.next_packet() {
            Ok(packet) => packet,
            Err(SymphoniaError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                break;
            }
            Err(e) => return Err(decode(format!("reading a packet: {e}"))),
        };
        if packet.track_id() != track_id {
            continue;
        }
        let buffer = decoder
            .decode(&packet)
            .map_err(|e| decode(format!("decoding a packet: {e}")))?;
        let channels = buffer.spec().channels.count().max(1);
        let mut samples = SampleBuffer::<f32>::new(buffer.capacity() as u64, *buffer.spec());
        samples.copy_interleaved_ref(buffer);
        mono.extend(
            samples
                .samples()
                .chunks(channels)
                .map(|frame| frame.iter().sum::<f32>() / channels as f32),
        );
    }
    resample(&mono, rate, SAMPLE_RATE_HZ).map_err(decode)
}

/// FLAC through `claxon` (symphonia 0.5 rejects some valid streams, e.g. `flacenc`'s).
fn decode_flac(bytes: &[u8], path: &Path) -> Result<Vec<f32>, AudioError> {
    let decode = |reason: String| AudioError::Decode {
        path: path.to_path_buf(),
        reason,
    };
    let mut reader = claxon::FlacReader::new(std::io::Cursor::new(bytes))
        .map_err(|e| decode(format!("not FLAC ({e})")))?;
    let info = reader.streaminfo();
    let channels = info.channels.max(1) as usize;
    let scale = 1.0 / (1u64 << (info.bits_per_sample - 1)) as f32;
    let samples: Vec<i32> = reader
        .samples()
        .collect::<Result<_, _>>()
        .map_err(|e| decode(format!("decoding: {e}")))?;
    let mono: Vec<f32> = samples
        .chunks(channels)
        .map(|frame| frame.iter().map(|&x| x as f32 * scale).sum::<f32>() / channels as f32)
        .collect();
    resample(&mono, info.sample_rate as usize, SAMPLE_RATE_HZ).map_err(decode)
}

/// The sample rates [`resample`] takes: 1 kHz to 768 kHz. A file's header can give any
/// 32-bit rate, and the FFT resampler's buffers grow with the rates' ratio in lowest terms
/// (a rate of tens of MHz asked for hundreds of MB).
pub const RESAMPLED_RATES_HZ: std::ops::RangeInclusive<usize> = 1_000..=768_000;

/// Resamples mono audio from `from_hz` to `to_hz` (FFT resampler; the output has
/// `round(len · to_hz / from_hz)` samples, aligned with the input).
///
/// # Errors
/// When the rates differ and one is outside [`RESAMPLED_RATES_HZ`].
pub fn resample(samples: &[f32], from_hz: usize, to_hz: usize) -> Result<Vec<f32>, String> {
    if from_hz == to_hz {
        return Ok(samples.to_vec());
    }
    for rate in [from_hz, to_hz] {
        if !RESAMPLED_RATES_HZ.contains(&rate) {
            return Err(format!(
                "sample rate {rate} Hz: only {} to {} Hz is resampled",
                RESAMPLED_RATES_HZ.start(),
                RESAMPLED_RATES_HZ.end()
            ));
        }
    }
    let mut resampler =
        FftFixedInOut::<f32>::new(from_hz, to_hz, 1024, 1).map_err(|e| e.to_string())?;
    let expected = (samples.len() as f64 * to_hz as f64 / from_hz as f64).round() as usize;
    let delay = resampler.output_delay();
    let mut out = Vec::with_capacity(expected + delay + 2048);
    let mut rest = samples;
    while rest.len() >= resampler.input_frames_next() {
        let (chunk, tail) = rest.split_at(resampler.input_frames_next());
        out.extend_from_slice(
            &resampler
                .process(&[chunk], None)
                .map_err(|e| e.to_string())?[0],
        );
        rest = tail;
    }
    if !rest.is_empty() {
        out.extend_from_slice(
            &resampler
                .process_partial(Some(&[rest]), None)
                .map_err(|e| e.to_string())?[0],
        );
    }
    while out.len() < expected + delay {
        out.extend_from_slice(
            &resampler
                .process_partial::<&[f32]>(None, None)
                .map_err(|e| e.to_string())?[0],
        );
    }
    Ok(out[delay..delay + expected].to_vec())
}

/// Writes mono FLAC with `bits_per_sample` bits (8–24) per sample. When the last block
/// would be shorter than 16 samples it is padded with silence (at most 15 samples).
///
/// # Errors
/// When the file cannot be written or the encoder rejects its input.
pub fn write_flac(
    path: &Path,
    samples: &[f32],
    sample_rate_hz: usize,
    bits_per_sample: usize,
) -> anyhow::Result<()> {
    use flacenc::component::BitRepr;
    use flacenc::error::Verify;
    anyhow::ensure!(
        (8..=24).contains(&bits_per_sample),
        "bits_per_sample must be in 8..=24, got {bits_per_sample}"
    );
    let full_scale = ((1i64 << (bits_per_sample - 1)) - 1) as f32;
    let mut pcm: Vec<i32> = samples
        .iter()
        .map(|x| (x.clamp(-1.0, 1.0) * full_scale).round() as i32)
        .collect();
    let config = flacenc::config::Encoder::default()
        .into_verified()
        .map_err(|e| anyhow::anyhow!("FLAC encoder config: {e:?}"))?;
    // FLAC forbids blocks under 16 samples except the last, yet decoders (claxon, symphonia)
    // reject a stream whose recorded minimum block size is under 16: pad the last block with
    // up to 15 samples of silence (< 1 ms at 16 kHz).
    let tail = pcm.len() % config.block_size;
    if tail > 0 && tail < 16 {
        pcm.resize(pcm.len() + 16 - tail, 0);
    }
    let source = flacenc::source::MemSource::from_samples(&pcm, 1, bits_per_sample, sample_rate_hz);
    let stream = flacenc::encode_with_fixed_block_size(&config, source, config.block_size)
        .map_err(|e| anyhow::anyhow!("{}: FLAC encoding failed: {e:?}", path.display()))?;
    let mut sink = flacenc::bitsink::ByteSink::new();
    stream
        .write(&mut sink)
        .map_err(|e| anyhow::anyhow!("{}: FLAC encoding failed: {e:?}", path.display()))?;
    crate::files::write_atomic(path, sink.as_slice())?;
    Ok(())
}
