//! `ninfer._core`: the Python bindings of the ninfer crate (a thin layer; Python never
//! reimplements what the core does).
//! - `artifact`: reference codecs (`quantize`, `dequantize`), `Artifact`, `ArtifactWriter`.
//! - `engine`: `Engine` (submit / poll / cancel), `Runner` (step by step), `Tokenizer`.

mod artifact;
mod engine;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    artifact::register(m)?;
    engine::register(m)?;
    Ok(())
}
