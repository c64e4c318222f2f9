//! The `.ninfer` artifact: the only code that knows the file layout (docs/format.md).
//!
//! - `codec`: the reference quantizers/dequantizers of every encoding (one implementation).
//! - `header`: the JSON header types.
//! - `reader`: [`Artifact`] opens a file over mmap, validates it and hands out tensor views.
//! - `writer`: [`ArtifactWriter`] streams tensors and resources to a new file.

pub mod codec;
mod header;
mod reader;
mod writer;

pub use header::{Header, PartEntry, ResourceEntry, TensorEntry};
pub use reader::{Artifact, TensorView};
pub use writer::ArtifactWriter;

use std::fmt;
use std::str::FromStr;

/// Magic bytes at offset 0 and the format major version at offset 7.
pub const MAGIC: &[u8; 7] = b"NINFER\0";
pub const FORMAT_VERSION: u8 = 1;
/// Alignment of the data section start and of every part inside it.
pub const DATA_ALIGN: u64 = 4096;
pub const PART_ALIGN: u64 = 256;

#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{0}: not a .ninfer artifact (bad magic)")]
    BadMagic(String),
    #[error("{path}: unsupported format version {found} (this build reads version {FORMAT_VERSION})")]
    Version { path: String, found: u8 },
    #[error("{path}: header length {len} runs past the end of the file ({file_len} bytes)")]
    HeaderPastEnd { path: String, len: u64, file_len: u64 },
    #[error("{path}: header is not valid JSON: {msg}")]
    HeaderJson { path: String, msg: String },
    #[error("{path}: tensor `{tensor}` part `{part}` ({start}..{end}) runs past the end of the file ({file_len} bytes)")]
    RangePastEnd { path: String, tensor: String, part: String, start: u64, end: u64, file_len: u64 },
    #[error("{path}: tensor `{tensor}` has unknown encoding `{encoding}`")]
    UnknownEncoding { path: String, tensor: String, encoding: String },
    #[error("{path}: checksum mismatch in `{what}` (stored {stored}, computed {computed})")]
    Checksum { path: String, what: String, stored: String, computed: String },
    #[error("{path}: {msg}")]
    Invalid { path: String, msg: String },
    #[error("no tensor named `{0}` in the artifact")]
    MissingTensor(String),
    #[error("{0}")]
    Shape(String),
}

/// How a tensor's values are stored (docs/format.md §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    F32,
    Bf16,
    F16,
    Fp8E4m3,
    Nvfp4,
    Q8G32,
    Q6G64,
    Q4G32,
}

impl Encoding {
    pub const ALL: [Encoding; 8] = [
        Encoding::F32,
        Encoding::Bf16,
        Encoding::F16,
        Encoding::Fp8E4m3,
        Encoding::Nvfp4,
        Encoding::Q8G32,
        Encoding::Q6G64,
        Encoding::Q4G32,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Encoding::F32 => "f32",
            Encoding::Bf16 => "bf16",
            Encoding::F16 => "f16",
            Encoding::Fp8E4m3 => "fp8_e4m3",
            Encoding::Nvfp4 => "nvfp4",
            Encoding::Q8G32 => "q8_g32",
            Encoding::Q6G64 => "q6_g64",
            Encoding::Q4G32 => "q4_g32",
        }
    }
}

impl fmt::Display for Encoding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Encoding {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Encoding::ALL
            .into_iter()
            .find(|e| e.name() == s)
            .ok_or_else(|| format!("unknown encoding `{s}` (known: f32, bf16, f16, fp8_e4m3, nvfp4, q8_g32, q6_g64, q4_g32)"))
    }
}

/// xxh3-64 of a byte slice as 16 lower-case hex digits, as stored in the header.
pub fn checksum(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

#[cfg(test)]
mod tests;
