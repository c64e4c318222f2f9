//! Opening an artifact: mmap, validate everything that can be validated without reading the
//! weights, and hand out zero-copy tensor views. Weight checksums are checked on demand
//! ([`Artifact::verify`]); resource checksums at every open (they are small).

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::codec::{self, PartSource};
use super::{checksum, ArtifactError, Encoding, Header, TensorEntry, DATA_ALIGN, FORMAT_VERSION, MAGIC, PART_ALIGN};

pub struct Artifact {
    path: PathBuf,
    map: Mmap,
    header: Header,
    data_start: u64,
    id: [u8; 16],
}

/// A tensor's encoding, logical shape and its parts as slices of the mapped file.
pub struct TensorView<'a> {
    pub name: &'a str,
    pub encoding: Encoding,
    pub shape: &'a [usize],
    pub component: &'a str,
    parts: Vec<(&'a str, &'a [u8])>,
}

impl PartSource for TensorView<'_> {
    fn part(&self, name: &str) -> Result<&[u8], ArtifactError> {
        self.parts
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, b)| *b)
            .ok_or_else(|| ArtifactError::Shape(format!("tensor `{}` has no part `{name}`", self.name)))
    }
}

impl TensorView<'_> {
    /// The parts in name order, as stored.
    pub fn parts(&self) -> &[(&str, &[u8])] {
        &self.parts
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes the tensor occupies on disk (all parts).
    pub fn nbytes(&self) -> usize {
        self.parts.iter().map(|(_, b)| b.len()).sum()
    }

    /// The whole tensor dequantized to f32, row-major in its logical shape.
    pub fn to_f32(&self) -> Result<Vec<f32>, ArtifactError> {
        let mut out = vec![0f32; self.numel()];
        codec::dequantize_rows(self.encoding, self, self.shape, 0, &mut out)?;
        Ok(out)
    }

    /// Rows `[row0, row0 + nrows)` (rows = all dimensions but the last, flattened) as f32.
    pub fn rows_f32(&self, row0: usize, nrows: usize) -> Result<Vec<f32>, ArtifactError> {
        let k = *self.shape.last().unwrap_or(&1);
        let mut out = vec![0f32; nrows * k];
        codec::dequantize_rows(self.encoding, self, self.shape, row0, &mut out)?;
        Ok(out)
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ArtifactError + '_ {
    move |source| ArtifactError::Io { path: path.display().to_string(), source }
}

impl Artifact {
    pub fn open(path: impl AsRef<Path>) -> Result<Self, ArtifactError> {
        let path = path.as_ref();
        let p = path.display().to_string();
        let file = File::open(path).map_err(io_err(path))?;
        // SAFETY: the file is opened read-only; ninfer never writes an artifact in place (the
        // writer renames a finished file into place), so the mapping is not mutated under us.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
        let file_len = map.len() as u64;
        if map.len() < 8 || &map[..7] != MAGIC {
            return Err(ArtifactError::BadMagic(p));
        }
        if map[7] != FORMAT_VERSION {
            return Err(ArtifactError::Version { path: p, found: map[7] });
        }
        if map.len() < 32 {
            return Err(ArtifactError::HeaderPastEnd { path: p, len: 0, file_len });
        }
        let len = u64::from_le_bytes(map[8..16].try_into().unwrap());
        if len > file_len.saturating_sub(32) {
            return Err(ArtifactError::HeaderPastEnd { path: p, len, file_len });
        }
        let raw = &map[32..32 + len as usize];
        let text = std::str::from_utf8(raw)
            .map_err(|e| ArtifactError::HeaderJson { path: p.clone(), msg: e.to_string() })?
            .trim_end_matches([' ', '\n', '\0']);
        let header: Header =
            serde_json::from_str(text).map_err(|e| ArtifactError::HeaderJson { path: p.clone(), msg: e.to_string() })?;
        let data_start = (32 + len).div_ceil(DATA_ALIGN) * DATA_ALIGN;
        let id: [u8; 16] = map[16..32].try_into().unwrap();
        let art = Artifact { path: path.to_path_buf(), map, header, data_start, id };
        art.validate()?;
        Ok(art)
    }

    fn invalid(&self, msg: String) -> ArtifactError {
        ArtifactError::Invalid { path: self.path.display().to_string(), msg }
    }

    fn validate(&self) -> Result<(), ArtifactError> {
        let p = self.path.display().to_string();
        let file_len = self.map.len() as u64;
        if self.header.format != FORMAT_VERSION as u32 {
            return Err(ArtifactError::Version { path: p, found: self.header.format as u8 });
        }
        if !self.header.components.contains_key("text") {
            return Err(self.invalid("the header has no `text` component".into()));
        }
        for (name, t) in &self.header.tensors {
            let enc: Encoding = t.encoding.parse().map_err(|_| ArtifactError::UnknownEncoding {
                path: p.clone(),
                tensor: name.clone(),
                encoding: t.encoding.clone(),
            })?;
            if t.layout != "row_major" {
                return Err(self.invalid(format!("tensor `{name}` has unknown layout `{}`", t.layout)));
            }
            if !self.header.components.contains_key(&t.component) {
                return Err(self.invalid(format!("tensor `{name}` belongs to unknown component `{}`", t.component)));
            }
            let expected = codec::part_lengths(enc, &t.shape, segments_of(t))
                .map_err(|e| self.invalid(format!("tensor `{name}`: {e}")))?;
            if expected.len() != t.parts.len() {
                return Err(self.invalid(format!("tensor `{name}` ({enc}) has parts {:?}", t.parts.keys().collect::<Vec<_>>())));
            }
            for (part, want) in expected {
                let e = t.parts.get(part).ok_or_else(|| self.invalid(format!("tensor `{name}` ({enc}) lacks part `{part}`")))?;
                if e.length != want as u64 {
                    return Err(self.invalid(format!(
                        "tensor `{name}` part `{part}` is {} bytes, shape {:?} as {enc} needs {want}",
                        e.length, t.shape
                    )));
                }
                if e.offset % PART_ALIGN != 0 {
                    return Err(self.invalid(format!("tensor `{name}` part `{part}` offset {} is not 256-aligned", e.offset)));
                }
                let (start, end) = (self.data_start + e.offset, self.data_start + e.offset + e.length);
                if end > file_len {
                    return Err(ArtifactError::RangePastEnd {
                        path: p.clone(),
                        tensor: name.clone(),
                        part: part.to_string(),
                        start,
                        end,
                        file_len,
                    });
                }
            }
        }
        for (name, r) in &self.header.resources {
            let end = self.data_start + r.offset + r.length;
            if end > file_len {
                return Err(ArtifactError::RangePastEnd {
                    path: p.clone(),
                    tensor: format!("resource {name}"),
                    part: "bytes".into(),
                    start: self.data_start + r.offset,
                    end,
                    file_len,
                });
            }
            let computed = checksum(self.slice(r.offset, r.length));
            if computed != r.xxh3 {
                return Err(ArtifactError::Checksum { path: p, what: format!("resource {name}"), stored: r.xxh3.clone(), computed });
            }
        }
        Ok(())
    }

    fn slice(&self, offset: u64, length: u64) -> &[u8] {
        let s = (self.data_start + offset) as usize;
        &self.map[s..s + length as usize]
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn id(&self) -> [u8; 16] {
        self.id
    }

    /// Size of the whole file in bytes.
    pub fn file_len(&self) -> u64 {
        self.map.len() as u64
    }

    /// The config of a component (`text`, `mtp`, ...), if the artifact has it.
    pub fn component(&self, name: &str) -> Option<&serde_json::Value> {
        self.header.components.get(name)
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.header.tensors.contains_key(name)
    }

    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, ArtifactError> {
        let (key, t) = self.header.tensors.get_key_value(name).ok_or_else(|| ArtifactError::MissingTensor(name.into()))?;
        Ok(TensorView {
            name: key,
            encoding: t.encoding.parse().expect("validated at open"),
            shape: &t.shape,
            component: &t.component,
            parts: t.parts.iter().map(|(n, e)| (n.as_str(), self.slice(e.offset, e.length))).collect(),
        })
    }

    pub fn resource(&self, name: &str) -> Option<&[u8]> {
        self.header.resources.get(name).map(|r| self.slice(r.offset, r.length))
    }

    /// Checks the xxh3 of every tensor part; the first mismatch is the error.
    pub fn verify(&self) -> Result<(), ArtifactError> {
        for (name, t) in &self.header.tensors {
            for (part, e) in &t.parts {
                let computed = checksum(self.slice(e.offset, e.length));
                if computed != e.xxh3 {
                    return Err(ArtifactError::Checksum {
                        path: self.path.display().to_string(),
                        what: format!("tensor {name} part {part}"),
                        stored: e.xxh3.clone(),
                        computed,
                    });
                }
            }
        }
        Ok(())
    }
}

/// P of docs/format.md: row segments with their own NVFP4 global scale (1 for other encodings).
pub(crate) fn segments_of(t: &TensorEntry) -> usize {
    t.parts.get("global").and_then(|g| g.shape.get(1).copied()).unwrap_or(1)
}
