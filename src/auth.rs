//! The debug bearer token (`debug_token_file`): what `/debug/*` and the admin gRPC API require, when
//! set, in an `authorization: Bearer <token>` header.
//!
//! The file is read once at start-up; surrounding whitespace (the newline editors and `kubectl create
//! secret --from-file` leave) is not part of the token. The comparison takes the same time whatever
//! prefix of the token a guess gets right, so the answer's timing does not reveal the token.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use subtle::ConstantTimeEq;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum AuthError {
    #[error("cannot read debug_token_file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("debug_token_file {} is empty: a token of at least {MIN_TOKEN_BYTES} bytes is required", path.display())]
    Empty { path: PathBuf },
    #[error("debug_token_file {} holds a token of {length} bytes; at least {MIN_TOKEN_BYTES} are required", path.display())]
    TooShort { path: PathBuf, length: usize },
    #[error("debug_token_file {}: a token is printable ASCII without spaces (an HTTP header value)", path.display())]
    NotPrintable { path: PathBuf },
}

/// Shorter tokens are guessable; `openssl rand -hex 32` gives 64.
pub const MIN_TOKEN_BYTES: usize = 16;

/// The largest token file read: a token is a header value, far shorter.
const TOKEN_FILE_LIMIT: u64 = 64 << 10;

/// The scheme prefix of the header value.
const BEARER: &[u8] = b"Bearer ";

/// The expected `authorization` header value, `Bearer <token>`. Never printed.
#[derive(Clone)]
pub struct BearerToken {
    expected: Vec<u8>,
}

impl fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BearerToken(..)")
    }
}

impl BearerToken {
    pub fn from_file(path: &Path) -> Result<BearerToken, AuthError> {
        let bytes =
            cachepick_decode::file::read_regular(path, TOKEN_FILE_LIMIT).map_err(|source| {
                AuthError::Read {
                    path: path.to_owned(),
                    source,
                }
            })?;
        BearerToken::new(bytes.trim_ascii(), path)
    }

    fn new(token: &[u8], path: &Path) -> Result<BearerToken, AuthError> {
        if token.is_empty() {
            return Err(AuthError::Empty {
                path: path.to_owned(),
            });
        }
        if !token.iter().all(|byte| byte.is_ascii_graphic()) {
            return Err(AuthError::NotPrintable {
                path: path.to_owned(),
            });
        }
        if token.len() < MIN_TOKEN_BYTES {
            return Err(AuthError::TooShort {
                path: path.to_owned(),
                length: token.len(),
            });
        }
        Ok(BearerToken {
            expected: [BEARER, token].concat(),
        })
    }

    /// Whether an `authorization` header value (absent: `None`) carries the token.
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        authorization.is_some_and(|given| bool::from(given.ct_eq(&self.expected)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_file_is_trimmed_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "0123456789abcdef0123\n").unwrap();
        let token = BearerToken::from_file(&path).unwrap();
        assert!(token.admits(Some(b"Bearer 0123456789abcdef0123")));
        assert!(!token.admits(Some(b"Bearer 0123456789abcdef012")));
        assert!(!token.admits(Some(b"Bearer 0123456789abcdef01234")));
        assert!(!token.admits(Some(b"bearer 0123456789abcdef0123")));
        assert!(!token.admits(Some(b"0123456789abcdef0123")));
        assert!(!token.admits(None));
        assert_eq!(format!("{token:?}"), "BearerToken(..)");

        for (text, expected) in [
            ("\n", "is empty"),
            ("short", "holds a token of 5 bytes"),
            ("0123456789 abcdef0123", "printable ASCII"),
        ] {
            std::fs::write(&path, text).unwrap();
            let error = BearerToken::from_file(&path).unwrap_err().to_string();
            assert!(error.contains(expected), "{text:?}: {error}");
        }
        let error = BearerToken::from_file(&dir.path().join("absent")).unwrap_err();
        assert!(matches!(error, AuthError::Read { .. }));
    }
}
