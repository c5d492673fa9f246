//! Reading a file that a configuration names, bounded: only a regular file (a FIFO, a device or a
//! socket is refused, however it is reached), opened so that a FIFO swapped in at the last moment
//! cannot block the open, and at most a stated number of bytes.
//!
//! `/dev/zero` would otherwise be read until memory runs out, and a FIFO would block the reading
//! thread until a writer comes, which may be never.

use std::fs::{File, Metadata, OpenOptions};
use std::io::{self, Read};
use std::path::Path;

/// The most bytes a configuration file may hold: a thousand workers take about 100 KiB.
pub const CONFIG_FILE_LIMIT: u64 = 16 << 20;

/// Reads the regular file at `path`, refusing anything else and anything over `limit` bytes. The
/// errors say which, as an [`io::Error`] whose message is the reason.
pub fn read_regular(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    check(&std::fs::metadata(path)?, limit)?;
    let file = open_nonblocking(path)?;
    // The file opened may not be the one looked at (a rename in between): look again.
    let metadata = file.metadata()?;
    check(&metadata, limit)?;
    let mut bytes = Vec::with_capacity(usize::try_from(metadata.len()).unwrap_or(0));
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64, limit));
    }
    Ok(bytes)
}

/// [`read_regular`], as UTF-8 text.
pub fn read_regular_to_string(path: &Path, limit: u64) -> io::Result<String> {
    String::from_utf8(read_regular(path, limit)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not UTF-8 text"))
}

#[cfg(unix)]
fn open_nonblocking(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
}

#[cfg(not(unix))]
fn open_nonblocking(path: &Path) -> io::Result<File> {
    OpenOptions::new().read(true).open(path)
}

fn check(metadata: &Metadata, limit: u64) -> io::Result<()> {
    if !metadata.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("not a regular file ({})", kind(metadata)),
        ));
    }
    if metadata.len() > limit {
        return Err(too_large(metadata.len(), limit));
    }
    Ok(())
}

fn too_large(len: u64, limit: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::FileTooLarge,
        format!("{len} bytes; the limit is {}", size(limit)),
    )
}

/// `limit` in the largest binary unit that divides it.
fn size(limit: u64) -> String {
    match limit {
        0 => "0 bytes".to_owned(),
        _ if limit.is_multiple_of(1 << 20) => format!("{} MiB", limit >> 20),
        _ if limit.is_multiple_of(1 << 10) => format!("{} KiB", limit >> 10),
        _ => format!("{limit} bytes"),
    }
}

fn kind(metadata: &Metadata) -> &'static str {
    let kind = metadata.file_type();
    if kind.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return "a FIFO";
        }
        if kind.is_char_device() {
            return "a character device";
        }
        if kind.is_block_device() {
            return "a block device";
        }
        if kind.is_socket() {
            return "a socket";
        }
    }
    "not a file"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regular_file_within_the_limit_is_read_and_others_are_refused() {
        let dir =
            std::env::temp_dir().join(format!("cachepick-decode-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ok.yaml");
        std::fs::write(&path, "listen: x\n").unwrap();
        assert_eq!(read_regular(&path, 10).unwrap(), b"listen: x\n");
        let error = read_regular(&path, 9).unwrap_err();
        assert_eq!(error.to_string(), "10 bytes; the limit is 9 bytes");
        let error = read_regular(&dir, 1 << 20).unwrap_err();
        assert_eq!(error.to_string(), "not a regular file (a directory)");
        #[cfg(unix)]
        {
            let error = read_regular(Path::new("/dev/zero"), 1 << 20).unwrap_err();
            assert_eq!(error.to_string(), "not a regular file (a character device)");
        }
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        assert_eq!(
            read_regular_to_string(&path, 16).unwrap_err().to_string(),
            "not UTF-8 text"
        );
        assert_eq!(size(16 << 20), "16 MiB");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
