//! Files written whole or not at all.
//!
//! [`write_atomic`] writes to a temporary file in the destination's own directory, then
//! renames it over the destination: on POSIX a rename within one file system replaces the
//! name in one step, so a process killed while writing leaves the old file or the new one,
//! never a truncated or half-new one. It does not sync to disk (a corpus is thousands of
//! files): what a power cut leaves is the file system's matter. The temporary file is created
//! by the `tempfile` crate.

use std::io::Write;
use std::path::Path;

/// Suffix of the temporary files of [`write_atomic`]; a process killed while writing leaves
/// one behind (`.<file name>.<random>.partial`), which [`remove_partial_files`] removes.
pub const PARTIAL_SUFFIX: &str = ".partial";

/// Writes `bytes` to `path`, replacing it whole or not at all: through a temporary file in
/// the same directory (`.<file name>.<random>.partial`), renamed over `path`. The new file's
/// permissions are those `std::fs::write` would give it.
///
/// One process at a time should write a given path: two writers each leave a whole file, the
/// last rename wins.
///
/// # Errors
/// When the directory cannot be written, the disk is full or the rename fails; the error
/// names the path.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let named = |error: std::io::Error, path: &Path| {
        std::io::Error::new(error.kind(), format!("{}: {error}", path.display()))
    };
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{}: not a file's path", path.display()),
        )
    })?;
    let dir = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let mut builder = tempfile::Builder::new();
    let prefix = format!(".{}.", name.to_string_lossy());
    builder.prefix(&prefix).suffix(PARTIAL_SUFFIX);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // As `std::fs::write` (0o666 less the umask), not tempfile's private 0o600.
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let mut file = builder.tempfile_in(dir).map_err(|e| named(e, dir))?;
    file.write_all(bytes).map_err(|e| named(e, file.path()))?;
    file.persist(path).map_err(|e| named(e.error, path))?;
    Ok(())
}

/// Removes the temporary files that [`write_atomic`] left in `dir` when a process was killed
/// while writing a file whose name starts with `name_start` (`.<file name>.<random>.partial`).
/// Returns how many it removed. Only for a directory no other process is writing to.
///
/// # Errors
/// When `dir` cannot be listed or a file cannot be removed.
pub fn remove_partial_files(dir: &Path, name_start: &str) -> std::io::Result<usize> {
    let prefix = format!(".{name_start}");
    let mut removed = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let file_name = entry.file_name();
        let file_name = file_name.to_string_lossy();
        if file_name.starts_with(&prefix) && file_name.ends_with(PARTIAL_SUFFIX) {
            std::fs::remove_file(entry.path())?;
            removed += 1;
        }
    }
    Ok(removed)
}
