//! A project file that can change what runs (its config, its action files), as it was read: the
//! path and the digest of the very bytes loopd loaded, which the trust check holds against the
//! user's record.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

/// A project file that can change what runs, with the digest of the bytes loopd read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProjectFile {
    pub path: PathBuf,
    pub digest: String,
}

impl ProjectFile {
    pub fn new(path: &Path, text: &str) -> ProjectFile {
        ProjectFile {
            path: path.to_owned(),
            digest: sha256_hex(text.as_bytes()),
        }
    }
}

/// The SHA-256 digest of `bytes`, in lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .fold(String::with_capacity(64), |mut hex, b| {
            let _ = write!(hex, "{b:02x}");
            hex
        })
}
