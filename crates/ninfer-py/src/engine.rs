//! `ninfer._core` engine bindings: `Engine` (the scheduler-backed engine: submit, poll, cancel),
//! `Runner` (one backend driven step by step, for parity tests and perplexity) and `Tokenizer`.
//!
//! Events of every request of an engine go into one channel tagged with the request id; a single
//! Python thread drains it with `poll` (GIL released while waiting) and hands the events to
//! threads or asyncio loops. That keeps one OS thread for any number of streams.

use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::Duration;

use ninfer::artifact::Artifact;
use ninfer::backend::cpu::{CpuBackend, CpuOptions};
use ninfer::backend::{Backend, Pick, SampleSpec, SlotId, StepInput};
use ninfer::runtime::{Device, Engine, EngineError, EngineOptions, Event, SamplingParams};
use ninfer::tokenizer::Tokenizer;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::artifact::err as artifact_err;

fn engine_err(e: EngineError) -> PyErr {
    match e {
        EngineError::Artifact(a) => artifact_err(a),
        EngineError::QueueFull(_) => PyRuntimeError::new_err(format!("queue full: {e}")),
        other => PyValueError::new_err(other.to_string()),
    }
}

fn get<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<T>> {
    match d.get_item(key)? {
        Some(v) if !v.is_none() => {
            v.extract::<T>().map(Some).map_err(|_| PyValueError::new_err(format!("sampling parameter `{key}` has the wrong type")))
        }
        _ => Ok(None),
    }
}

/// Builds `SamplingParams` from a dict of the Python `SamplingParams` fields; unknown keys are
/// refused so that a misspelt option never goes silently unused.
fn params(d: &Bound<'_, PyDict>) -> PyResult<SamplingParams> {
    const KNOWN: [&str; 13] = [
        "max_tokens",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
    ];
    for k in d.keys() {
        let k: String = k.extract()?;
        if !KNOWN.contains(&k.as_str()) {
            return Err(PyValueError::new_err(format!("unknown sampling parameter `{k}`")));
        }
    }
    let z = SamplingParams::default();
    let p = SamplingParams {
        max_tokens: get(d, "max_tokens")?.unwrap_or(z.max_tokens),
        temperature: get(d, "temperature")?.unwrap_or(z.temperature),
        top_k: get(d, "top_k")?.unwrap_or(z.top_k),
        top_p: get(d, "top_p")?.unwrap_or(z.top_p),
        min_p: get(d, "min_p")?.unwrap_or(z.min_p),
        presence_penalty: get(d, "presence_penalty")?.unwrap_or(z.presence_penalty),
        frequency_penalty: get(d, "frequency_penalty")?.unwrap_or(z.frequency_penalty),
        repetition_penalty: get(d, "repetition_penalty")?.unwrap_or(z.repetition_penalty),
        seed: get(d, "seed")?,
        stop: get(d, "stop")?.unwrap_or_default(),
        stop_token_ids: get(d, "stop_token_ids")?.unwrap_or_default(),
        ignore_eos: get(d, "ignore_eos")?.unwrap_or(false),
        logprobs: get(d, "logprobs")?,
    };
    p.validate().map_err(PyValueError::new_err)?;
    Ok(p)
}

fn event_dict<'py>(py: Python<'py>, e: Event) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match e {
        Event::Delta { text, token_ids, logprobs } => {
            d.set_item("type", "delta")?;
            d.set_item("text", text)?;
            d.set_item("token_ids", token_ids)?;
            // (token, logprob, [(alternative, logprob)]) per generated token.
            type Row = (u32, f32, Vec<(u32, f32)>);
            let lps: Vec<Row> = logprobs.into_iter().map(|l| (l.token, l.logprob, l.top)).collect();
            d.set_item("logprobs", lps)?;
        }
        Event::Done { reason, usage, stop } => {
            d.set_item("type", "done")?;
            d.set_item("finish_reason", reason.as_str())?;
            d.set_item("prompt_tokens", usage.prompt_tokens)?;
            d.set_item("completion_tokens", usage.completion_tokens)?;
            d.set_item("stop", stop)?;
        }
        Event::Error(msg) => {
            d.set_item("type", "error")?;
            d.set_item("message", msg)?;
        }
    }
    Ok(d)
}

#[pyclass(name = "Engine", module = "ninfer._core", frozen)]
struct PyEngine {
    inner: std::sync::RwLock<Option<std::sync::Arc<Engine>>>,
    tx: mpsc::Sender<(u64, Event)>,
    rx: Mutex<mpsc::Receiver<(u64, Event)>>,
}

impl PyEngine {
    fn e(&self) -> PyResult<std::sync::Arc<Engine>> {
        let g = self.inner.read().unwrap_or_else(|p| p.into_inner());
        g.clone().ok_or_else(|| PyValueError::new_err("the engine is closed"))
    }
}

#[pymethods]
impl PyEngine {
    #[new]
    /// `kv_capacity`: positions of KV all sequences share; None: every slot can hold the full
    /// context.
    #[pyo3(signature = (path, device = "auto", max_concurrency = 8, max_context = 8192, max_pending = 256, prefill_chunk = 512, kv_capacity = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        device: &str,
        max_concurrency: usize,
        max_context: usize,
        max_pending: usize,
        prefill_chunk: usize,
        kv_capacity: Option<usize>,
    ) -> PyResult<Self> {
        let device: Device = device.parse().map_err(PyValueError::new_err)?;
        let opts = EngineOptions { device, max_concurrency, max_context, max_pending, prefill_chunk, kv_capacity };
        let inner = py.detach(|| Engine::open(&path, opts)).map_err(engine_err)?;
        let (tx, rx) = mpsc::channel();
        Ok(PyEngine { inner: std::sync::RwLock::new(Some(std::sync::Arc::new(inner))), tx, rx: Mutex::new(rx) })
    }

    #[getter]
    fn config_json(&self) -> PyResult<String> {
        serde_json::to_string(self.e()?.config()).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    #[getter]
    fn chat_template(&self) -> PyResult<Option<String>> {
        Ok(self.e()?.chat_template().map(str::to_string))
    }

    #[getter]
    fn generation_config_json(&self) -> PyResult<Option<String>> {
        Ok(self.e()?.generation_config().map(|g| g.to_string()))
    }

    #[getter]
    fn eos_token_ids(&self) -> PyResult<Vec<u32>> {
        Ok(self.e()?.eos_token_ids().to_vec())
    }

    #[getter]
    fn backend_name(&self) -> PyResult<String> {
        Ok(self.e()?.backend_name().to_string())
    }

    #[getter]
    fn max_context(&self) -> PyResult<usize> {
        Ok(self.e()?.options().max_context)
    }

    #[getter]
    fn max_concurrency(&self) -> PyResult<usize> {
        Ok(self.e()?.options().max_concurrency)
    }

    /// Positions of KV all sequences share, as sized at open (whole pages).
    #[getter]
    fn kv_capacity(&self) -> PyResult<usize> {
        Ok(self.e()?.kv_capacity())
    }

    #[getter]
    fn has_tokenizer(&self) -> PyResult<bool> {
        Ok(self.e()?.tokenizer().is_some())
    }

    fn encode(&self, py: Python<'_>, text: &str) -> PyResult<Vec<u32>> {
        let e = self.e()?;
        py.detach(|| e.encode(text)).map_err(engine_err)
    }

    #[pyo3(signature = (ids, skip_special = false))]
    fn decode(&self, ids: Vec<u32>, skip_special: bool) -> PyResult<String> {
        let e = self.e()?;
        let t = e.tokenizer().ok_or_else(|| PyValueError::new_err("this artifact has no tokenizer"))?;
        Ok(t.decode(&ids, skip_special))
    }

    /// Queues a request (token ids + a dict of sampling parameters); returns its id. Its events
    /// come out of `poll`.
    fn submit(&self, prompt: Vec<u32>, sampling: &Bound<'_, PyDict>) -> PyResult<u64> {
        let p = params(sampling)?;
        let e = self.e()?;
        let tx = self.tx.clone();
        let id = e.submit(prompt, p, move |id| Box::new(move |ev| drop(tx.send((id, ev))))).map_err(engine_err)?;
        Ok(id)
    }

    fn cancel(&self, id: u64) -> PyResult<()> {
        self.e()?.cancel(id);
        Ok(())
    }

    /// Waits up to `timeout` seconds for events and returns all that are ready: [(id, event)].
    fn poll<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyList>> {
        let batch: Vec<(u64, Event)> = py.detach(|| {
            let rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
            let mut out = Vec::new();
            if let Ok(first) = rx.recv_timeout(Duration::from_secs_f64(timeout.max(0.0))) {
                out.push(first);
                out.extend(rx.try_iter());
            }
            out
        });
        let list = PyList::empty(py);
        for (id, ev) in batch {
            list.append((id, event_dict(py, ev)?))?;
        }
        Ok(list)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.e()?.stats();
        let d = PyDict::new(py);
        d.set_item("running", s.running)?;
        d.set_item("waiting", s.waiting)?;
        d.set_item("slots_total", s.slots_total)?;
        d.set_item("slots_used", s.slots_used)?;
        d.set_item("prompt_tokens", s.prompt_tokens)?;
        d.set_item("generated_tokens", s.generated_tokens)?;
        d.set_item("steps", s.steps)?;
        d.set_item("kv_pages_total", s.kv_pages_total)?;
        d.set_item("kv_pages_reserved", s.kv_pages_reserved)?;
        d.set_item("kv_pages_used", s.kv_pages_used)?;
        d.set_item("kv_page_size", s.kv_page_size)?;
        Ok(d)
    }

    /// Stops the scheduler (pending requests end with an error event).
    fn close(&self, py: Python<'_>) {
        let taken = self.inner.write().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(e) = taken {
            py.detach(move || drop(e));
        }
    }
}

/// The backend of a `Runner`: `auto` is CUDA when this build has it and a supported GPU is
/// present, else the CPU.
fn open_runner_backend(art: &Artifact, device: Device, max_slots: usize, max_context: usize, graphs: bool) -> Result<Box<dyn Backend>, String> {
    #[cfg(feature = "cuda")]
    {
        use ninfer::backend::cuda::{supported_gpu, CudaBackend, CudaOptions};
        if device == Device::Cuda || (device == Device::Auto && supported_gpu().is_some()) {
            let o = CudaOptions { max_slots, max_context, graphs, ..CudaOptions::default() };
            return match CudaBackend::open(art, o) {
                Ok(b) => Ok(Box::new(b)),
                Err(e) => Err(format!("device `cuda`: {e}")),
            };
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = graphs;
    #[cfg(not(feature = "cuda"))]
    if device == Device::Cuda {
        return Err("device `cuda` is not available: this build of ninfer has no CUDA support (built without the `cuda` feature)".into());
    }
    let b = CpuBackend::open(art, CpuOptions { max_slots, max_context, mtp: false, kv_capacity: None }).map_err(|e| e.to_string())?;
    Ok(Box::new(b))
}

/// Whether this build carries the CUDA backend (`_core.CUDA_BUILT`).
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// Device-to-device copy bandwidth of GPU 0 in bytes/s: a 1 GiB buffer copied several times,
/// the best run, bytes read plus bytes written.
#[pyfunction]
fn cuda_copy_bandwidth(py: Python<'_>) -> PyResult<f64> {
    #[cfg(feature = "cuda")]
    {
        py.detach(ninfer::backend::cuda::copy_bandwidth).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = py;
        Err(PyRuntimeError::new_err("this build of ninfer has no CUDA support"))
    }
}

/// One backend driven directly, step by step, without the scheduler.
#[pyclass(name = "Runner", module = "ninfer._core", frozen)]
struct PyRunner {
    backend: Mutex<Box<dyn Backend>>,
}

#[pymethods]
impl PyRunner {
    #[new]
    /// `cuda_graphs`: replay decode steps as CUDA graphs (the engine's way); off, every launch
    /// is issued from the host.
    #[pyo3(signature = (path, device = "cpu", max_slots = 4, max_context = 8192, cuda_graphs = true))]
    fn new(py: Python<'_>, path: PathBuf, device: &str, max_slots: usize, max_context: usize, cuda_graphs: bool) -> PyResult<Self> {
        let device: Device = device.parse().map_err(PyValueError::new_err)?;
        let backend = py
            .detach(|| -> Result<Box<dyn Backend>, String> {
                let art = Artifact::open(&path).map_err(|e| e.to_string())?;
                open_runner_backend(&art, device, max_slots, max_context, cuda_graphs)
            })
            .map_err(PyValueError::new_err)?;
        Ok(PyRunner { backend: Mutex::new(backend) })
    }

    /// The backend's name ("cpu", "cuda:0 NVIDIA H200").
    #[getter]
    fn backend_name(&self) -> String {
        self.backend.lock().unwrap_or_else(|p| p.into_inner()).name()
    }

    fn alloc_slot(&self) -> PyResult<u32> {
        let mut b = self.backend.lock().unwrap_or_else(|p| p.into_inner());
        b.alloc_slot().map(|s| s.0).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    fn free_slot(&self, slot: u32) {
        self.backend.lock().unwrap_or_else(|p| p.into_inner()).free_slot(SlotId(slot));
    }

    fn slot_len(&self, slot: u32) -> PyResult<usize> {
        let b = self.backend.lock().unwrap_or_else(|p| p.into_inner());
        b.slot_len(SlotId(slot)).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Feeds `tokens` to the slot's sequence; returns f32 logits (last row, or every row).
    #[pyo3(signature = (slot, tokens, all_logits = false))]
    fn step<'py>(&self, py: Python<'py>, slot: u32, tokens: Vec<u32>, all_logits: bool) -> PyResult<Bound<'py, PyBytes>> {
        let out = py
            .detach(|| {
                let mut b = self.backend.lock().unwrap_or_else(|p| p.into_inner());
                b.step(&[StepInput { slot: SlotId(slot), tokens: &tokens, all_logits, pick: Pick::Logits }])
            })
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let values = &out[0].values;
        Ok(PyBytes::new(py, &values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()))
    }

    /// Feeds `tokens` like `step`, timing every launch of the step: a list of (label,
    /// milliseconds, bytes moved) in launch order. Backends that cannot time launches raise.
    fn profile_step(&self, py: Python<'_>, slot: u32, tokens: Vec<u32>) -> PyResult<Vec<(&'static str, f64, usize)>> {
        let (_, times) = py
            .detach(|| {
                let mut b = self.backend.lock().unwrap_or_else(|p| p.into_inner());
                b.profile_step(&[StepInput { slot: SlotId(slot), tokens: &tokens, all_logits: false, pick: Pick::Argmax }])
            })
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(times.into_iter().map(|t| (t.label, t.ms, t.bytes)).collect())
    }

    /// Feeds `tokens` and returns the argmax of the last position's logits, taken where the
    /// backend takes it for greedy decoding (on the GPU for CUDA).
    fn step_argmax(&self, py: Python<'_>, slot: u32, tokens: Vec<u32>) -> PyResult<u32> {
        let mut out = py
            .detach(|| {
                let mut b = self.backend.lock().unwrap_or_else(|p| p.into_inner());
                b.step(&[StepInput { slot: SlotId(slot), tokens: &tokens, all_logits: false, pick: Pick::Argmax }])
            })
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let row = out.remove(0);
        Ok(match row.token {
            Some(t) => t,
            None => ninfer::runtime::sampler::argmax(&row.values[row.values.len() - self.vocab()..]),
        })
    }

    /// Feeds `tokens` and returns a token drawn from the last position's logits by the
    /// backend's own sampler with uniform number `u` (`Pick::Sample`); only backends that pick
    /// tokens on their device (CUDA) can.
    #[pyo3(signature = (slot, tokens, u, temperature = 1.0, top_k = 0, top_p = 1.0, min_p = 0.0))]
    #[allow(clippy::too_many_arguments)]
    fn step_sample(&self, py: Python<'_>, slot: u32, tokens: Vec<u32>, u: f32, temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> PyResult<u32> {
        let pick = Pick::Sample(SampleSpec { temperature, top_k, top_p, min_p, u });
        let mut out = py
            .detach(|| {
                let mut b = self.backend.lock().unwrap_or_else(|p| p.into_inner());
                if !b.picks_tokens() {
                    return Err(format!("the {} backend does not pick tokens on its device", b.name()));
                }
                b.step(&[StepInput { slot: SlotId(slot), tokens: &tokens, all_logits: false, pick }]).map_err(|e| e.to_string())
            })
            .map_err(PyValueError::new_err)?;
        out.remove(0).token.ok_or_else(|| PyValueError::new_err("the backend returned logits for a sampled row"))
    }
}

impl PyRunner {
    fn vocab(&self) -> usize {
        self.backend.lock().unwrap_or_else(|p| p.into_inner()).config().vocab_size
    }
}

#[pyclass(name = "Tokenizer", module = "ninfer._core", frozen)]
struct PyTokenizer {
    inner: Tokenizer,
}

#[pymethods]
impl PyTokenizer {
    #[new]
    fn new(json: &[u8]) -> PyResult<Self> {
        Ok(PyTokenizer { inner: Tokenizer::from_bytes(json).map_err(|e| PyValueError::new_err(e.to_string()))? })
    }

    #[pyo3(signature = (text, allow_special = true))]
    fn encode(&self, py: Python<'_>, text: &str, allow_special: bool) -> PyResult<Vec<u32>> {
        py.detach(|| self.inner.encode(text, allow_special)).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    #[pyo3(signature = (ids, skip_special = false))]
    fn decode(&self, ids: Vec<u32>, skip_special: bool) -> String {
        self.inner.decode(&ids, skip_special)
    }

    fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_id(token)
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_class::<PyRunner>()?;
    m.add_class::<PyTokenizer>()?;
    m.add("CUDA_BUILT", CUDA_BUILT)?;
    m.add_function(wrap_pyfunction!(cuda_copy_bandwidth, m)?)?;
    Ok(())
}
