//! `ninfer._core`: the Python bindings of the ninfer crate (a thin layer; Python never
//! reimplements what the core does).
//! - `artifact`: reference codecs (`quantize`, `dequantize`), `Artifact`, `ArtifactWriter`.

mod artifact;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    artifact::register(m)?;
    Ok(())
}
