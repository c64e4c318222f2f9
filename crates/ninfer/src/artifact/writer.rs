//! Writing an artifact: parts are streamed to disk as they come (bounded memory for a full-size
//! model), the header is written last into space reserved at the front, and the finished file is
//! renamed into place so that a crash never leaves a half-written file under the final name.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::codec::{self, Part};
use super::{checksum, ArtifactError, Encoding, Header, PartEntry, ResourceEntry, TensorEntry, DATA_ALIGN, FORMAT_VERSION, MAGIC, PART_ALIGN};

pub struct ArtifactWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: BufWriter<File>,
    header: Header,
    header_reserve: u64,
    data_start: u64,
    /// Next free offset in the data section.
    cursor: u64,
}

fn io_err(path: &Path, source: std::io::Error) -> ArtifactError {
    ArtifactError::Io { path: path.display().to_string(), source }
}

impl ArtifactWriter {
    /// `header_reserve` bytes are kept for the header JSON; [`finish`](Self::finish) fails if the
    /// header turns out larger (about 400 bytes a tensor is typical).
    pub fn create(path: impl AsRef<Path>, header_reserve: u64) -> Result<Self, ArtifactError> {
        let path = path.as_ref().to_path_buf();
        let mut tmp = path.clone().into_os_string();
        tmp.push(".partial");
        let tmp = PathBuf::from(tmp);
        let file = File::create(&tmp).map_err(|e| io_err(&tmp, e))?;
        let data_start = (32 + header_reserve).div_ceil(DATA_ALIGN) * DATA_ALIGN;
        let mut out = BufWriter::with_capacity(1 << 22, file);
        out.seek(SeekFrom::Start(data_start)).map_err(|e| io_err(&tmp, e))?;
        let header = Header { format: FORMAT_VERSION as u32, ..Header::default() };
        Ok(ArtifactWriter { path, tmp, out, header, header_reserve: data_start - 32, data_start, cursor: 0 })
    }

    pub fn set_meta(&mut self, arch: &str, name: &str, provenance: Value) {
        self.header.arch = arch.into();
        self.header.name = name.into();
        self.header.provenance = provenance;
    }

    pub fn set_component(&mut self, name: &str, config: Value) {
        self.header.components.insert(name.into(), config);
    }

    fn write_aligned(&mut self, bytes: &[u8]) -> Result<u64, ArtifactError> {
        let start = self.cursor.div_ceil(PART_ALIGN) * PART_ALIGN;
        if start > self.cursor {
            let pad = vec![0u8; (start - self.cursor) as usize];
            self.out.write_all(&pad).map_err(|e| io_err(&self.tmp, e))?;
        }
        self.out.write_all(bytes).map_err(|e| io_err(&self.tmp, e))?;
        self.cursor = start + bytes.len() as u64;
        Ok(start)
    }

    /// Adds an already-encoded tensor; part names and byte lengths must match `encoding`.
    pub fn add_tensor(
        &mut self,
        name: &str,
        encoding: Encoding,
        shape: &[usize],
        component: &str,
        parts: &[Part],
    ) -> Result<(), ArtifactError> {
        if self.header.tensors.contains_key(name) {
            return Err(ArtifactError::Shape(format!("tensor `{name}` added twice")));
        }
        let segments = parts.iter().find(|p| p.name == "global").and_then(|p| p.shape.get(1).copied()).unwrap_or(1);
        let expected = codec::part_lengths(encoding, shape, segments)?;
        if expected.len() != parts.len() {
            return Err(ArtifactError::Shape(format!("tensor `{name}` ({encoding}) needs parts {:?}", expected.iter().map(|e| e.0).collect::<Vec<_>>())));
        }
        let mut entries = BTreeMap::new();
        for (pname, want) in expected {
            let p = parts
                .iter()
                .find(|p| p.name == pname)
                .ok_or_else(|| ArtifactError::Shape(format!("tensor `{name}` ({encoding}) lacks part `{pname}`")))?;
            if p.bytes.len() != want {
                return Err(ArtifactError::Shape(format!(
                    "tensor `{name}` part `{pname}` has {} bytes, shape {shape:?} as {encoding} needs {want}",
                    p.bytes.len()
                )));
            }
            let offset = self.write_aligned(&p.bytes)?;
            entries.insert(
                pname.to_string(),
                PartEntry { offset, length: want as u64, shape: p.shape.clone(), xxh3: checksum(&p.bytes) },
            );
        }
        self.header.tensors.insert(
            name.into(),
            TensorEntry { encoding: encoding.name().into(), shape: shape.to_vec(), component: component.into(), layout: "row_major".into(), parts: entries },
        );
        Ok(())
    }

    /// Quantizes f32 values with the reference codec and adds them.
    pub fn add_f32(&mut self, name: &str, encoding: Encoding, shape: &[usize], component: &str, values: &[f32]) -> Result<(), ArtifactError> {
        let parts = codec::quantize(encoding, values, shape, 1)?;
        self.add_tensor(name, encoding, shape, component, &parts)
    }

    pub fn add_resource(&mut self, name: &str, bytes: &[u8]) -> Result<(), ArtifactError> {
        let offset = self.write_aligned(bytes)?;
        self.header.resources.insert(name.into(), ResourceEntry { offset, length: bytes.len() as u64, xxh3: checksum(bytes) });
        Ok(())
    }

    /// Writes the header and renames the file into place. Returns the final path.
    pub fn finish(self) -> Result<PathBuf, ArtifactError> {
        if !self.header.components.contains_key("text") {
            return Err(ArtifactError::Shape("an artifact needs a `text` component".into()));
        }
        let json = serde_json::to_vec(&self.header).map_err(|e| ArtifactError::Shape(e.to_string()))?;
        if json.len() as u64 > self.header_reserve {
            return Err(ArtifactError::Shape(format!(
                "header is {} bytes but only {} were reserved; create the writer with a larger reserve",
                json.len(),
                self.header_reserve
            )));
        }
        let tmp = self.tmp.clone();
        let mut file = self.out.into_inner().map_err(|e| io_err(&tmp, e.into_error()))?;
        let mut id = [0u8; 16];
        getrandom::fill(&mut id).map_err(|e| io_err(&tmp, std::io::Error::other(e.to_string())))?;
        let mut front = Vec::with_capacity(self.data_start as usize);
        front.extend_from_slice(MAGIC);
        front.push(FORMAT_VERSION);
        front.extend_from_slice(&self.header_reserve.to_le_bytes());
        front.extend_from_slice(&id);
        front.extend_from_slice(&json);
        front.resize(32 + self.header_reserve as usize, b' ');
        file.seek(SeekFrom::Start(0)).map_err(|e| io_err(&tmp, e))?;
        file.write_all(&front).map_err(|e| io_err(&tmp, e))?;
        file.set_len(self.data_start + self.cursor).map_err(|e| io_err(&tmp, e))?;
        file.sync_all().map_err(|e| io_err(&tmp, e))?;
        fs::rename(&tmp, &self.path).map_err(|e| io_err(&self.path, e))?;
        Ok(self.path)
    }
}
