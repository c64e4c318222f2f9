//! `ninfer._core` artifact bindings: the reference codecs and the artifact reader/writer. Arrays
//! cross the boundary as little-endian bytes plus a shape (the Python side wraps them in numpy),
//! which keeps the extension on the stable ABI.

use std::path::PathBuf;

use ninfer::artifact::{codec, Artifact, ArtifactError, ArtifactWriter, Encoding};
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

pub fn err(e: ArtifactError) -> PyErr {
    match e {
        ArtifactError::Io { .. } => PyOSError::new_err(e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    }
}

fn encoding(name: &str) -> PyResult<Encoding> {
    name.parse().map_err(PyValueError::new_err)
}

fn f32_values(data: &[u8]) -> PyResult<Vec<f32>> {
    if !data.len().is_multiple_of(4) {
        return Err(PyValueError::new_err("f32 data must be a multiple of 4 bytes"));
    }
    Ok(data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

type PyPart<'py> = (String, Vec<usize>, Bound<'py, PyBytes>);

/// quantize(encoding, f32 bytes, shape, segments=1) -> [(part name, part shape, bytes)]
#[pyfunction]
#[pyo3(signature = (encoding_name, data, shape, segments = 1))]
fn quantize<'py>(py: Python<'py>, encoding_name: &str, data: &[u8], shape: Vec<usize>, segments: usize) -> PyResult<Vec<PyPart<'py>>> {
    let enc = encoding(encoding_name)?;
    let values = f32_values(data)?;
    let parts = py.detach(|| codec::quantize(enc, &values, &shape, segments)).map_err(err)?;
    Ok(parts.into_iter().map(|p| (p.name, p.shape, PyBytes::new(py, &p.bytes))).collect())
}

struct Parts(Vec<(String, Vec<u8>)>);

impl codec::PartSource for Parts {
    fn part(&self, name: &str) -> Result<&[u8], ArtifactError> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, b)| b.as_slice())
            .ok_or_else(|| ArtifactError::Shape(format!("missing part `{name}`")))
    }
}

/// dequantize(encoding, [(part name, bytes)], shape) -> f32 bytes
#[pyfunction]
fn dequantize<'py>(py: Python<'py>, encoding_name: &str, parts: Vec<(String, Vec<u8>)>, shape: Vec<usize>) -> PyResult<Bound<'py, PyBytes>> {
    let enc = encoding(encoding_name)?;
    let parts = Parts(parts);
    let segments = if enc == Encoding::Nvfp4 {
        let n = shape.get(shape.len().wrapping_sub(2)).copied().unwrap_or(1).max(1);
        let matrices = shape.iter().product::<usize>() / shape.last().copied().unwrap_or(1).max(1) / n;
        parts.0.iter().find(|(p, _)| p == "global").map(|(_, b)| b.len() / 4 / matrices.max(1)).unwrap_or(1)
    } else {
        1
    };
    for (name, want) in codec::part_lengths(enc, &shape, segments).map_err(err)? {
        let got = codec::PartSource::part(&parts, name).map_err(err)?.len();
        if got != want {
            return Err(PyValueError::new_err(format!("part `{name}` has {got} bytes, {enc} of shape {shape:?} needs {want}")));
        }
    }
    let mut out = vec![0f32; shape.iter().product()];
    py.detach(|| codec::dequantize_rows(enc, &parts, &shape, 0, &mut out)).map_err(err)?;
    Ok(PyBytes::new(py, &out.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()))
}

#[pyclass(name = "ArtifactWriter", module = "ninfer._core")]
struct PyArtifactWriter {
    inner: Option<ArtifactWriter>,
}

impl PyArtifactWriter {
    fn w(&mut self) -> PyResult<&mut ArtifactWriter> {
        self.inner.as_mut().ok_or_else(|| PyValueError::new_err("the writer is already finished"))
    }
}

fn json(text: &str) -> PyResult<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| PyValueError::new_err(format!("invalid JSON: {e}")))
}

#[pymethods]
impl PyArtifactWriter {
    #[new]
    #[pyo3(signature = (path, header_reserve = 1 << 20))]
    fn new(path: PathBuf, header_reserve: u64) -> PyResult<Self> {
        Ok(Self { inner: Some(ArtifactWriter::create(path, header_reserve).map_err(err)?) })
    }

    fn set_meta(&mut self, arch: &str, name: &str, provenance_json: &str) -> PyResult<()> {
        let prov = json(provenance_json)?;
        self.w()?.set_meta(arch, name, prov);
        Ok(())
    }

    fn set_component(&mut self, name: &str, config_json: &str) -> PyResult<()> {
        let cfg = json(config_json)?;
        self.w()?.set_component(name, cfg);
        Ok(())
    }

    /// add_tensor(name, encoding, shape, component, [(part name, part shape, bytes)])
    fn add_tensor(
        &mut self,
        py: Python<'_>,
        name: &str,
        encoding_name: &str,
        shape: Vec<usize>,
        component: &str,
        parts: Vec<(String, Vec<usize>, Vec<u8>)>,
    ) -> PyResult<()> {
        let enc = encoding(encoding_name)?;
        let parts: Vec<codec::Part> = parts.into_iter().map(|(name, shape, bytes)| codec::Part { name, shape, bytes }).collect();
        let w = self.w()?;
        py.detach(|| w.add_tensor(name, enc, &shape, component, &parts)).map_err(err)
    }

    fn add_resource(&mut self, name: &str, data: &[u8]) -> PyResult<()> {
        self.w()?.add_resource(name, data).map_err(err)
    }

    /// Writes the header and moves the file into place; returns its path.
    fn finish(&mut self) -> PyResult<String> {
        let w = self.inner.take().ok_or_else(|| PyValueError::new_err("the writer is already finished"))?;
        Ok(w.finish().map_err(err)?.display().to_string())
    }
}

#[pyclass(name = "Artifact", module = "ninfer._core")]
struct PyArtifact {
    inner: Artifact,
}

#[pymethods]
impl PyArtifact {
    #[new]
    fn new(path: PathBuf) -> PyResult<Self> {
        Ok(Self { inner: Artifact::open(path).map_err(err)? })
    }

    fn header_json(&self) -> PyResult<String> {
        serde_json::to_string(self.inner.header()).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    fn file_len(&self) -> u64 {
        self.inner.file_len()
    }

    fn id(&self) -> String {
        self.inner.id().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The tensor dequantized to f32 (little-endian bytes, logical shape).
    fn tensor_f32<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
        let t = self.inner.tensor(name).map_err(err)?;
        let v = py.detach(|| t.to_f32()).map_err(err)?;
        Ok(PyBytes::new(py, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()))
    }

    /// The stored parts: [(part name, part shape, bytes)].
    fn tensor_parts<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Vec<PyPart<'py>>> {
        let t = self.inner.tensor(name).map_err(err)?;
        let entry = &self.inner.header().tensors[name];
        Ok(t.parts().iter().map(|(n, b)| (n.to_string(), entry.parts[*n].shape.clone(), PyBytes::new(py, b))).collect())
    }

    fn resource<'py>(&self, py: Python<'py>, name: &str) -> Option<Bound<'py, PyBytes>> {
        self.inner.resource(name).map(|b| PyBytes::new(py, b))
    }

    /// Checks every tensor checksum; raises ValueError naming the first mismatch.
    fn verify(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.verify()).map_err(err)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quantize, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize, m)?)?;
    m.add_class::<PyArtifactWriter>()?;
    m.add_class::<PyArtifact>()?;
    Ok(())
}
