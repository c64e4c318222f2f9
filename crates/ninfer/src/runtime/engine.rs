//! The `Engine`: what Rust embedders, the Python bindings and the server all drive. It owns the
//! artifact, the tokenizer and a scheduler thread that owns the backend. Requests go in as token
//! ids with sampling parameters; events come back through a sink (a channel for Rust callers).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::request::{Completion, Event, EventSink, Request};
use super::sampler::SamplingParams;
use super::scheduler::{self, Limits, Shared, Stats};
use crate::artifact::Artifact;
use crate::backend::cpu::{CpuBackend, CpuOptions};
use crate::backend::{Backend, KvPool};
use crate::model::ModelConfig;
use crate::tokenizer::Tokenizer;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// CUDA when a supported GPU and a CUDA build are present, else CPU.
    Auto,
    Cpu,
    Cuda,
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            _ => Err(format!("unknown device `{s}` (expected auto, cpu or cuda)")),
        }
    }
}

/// Engine settings, resolved once at open.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub device: Device,
    /// Sequences decoded together (each holds one state slot).
    pub max_concurrency: usize,
    /// Longest sequence (prompt + generated) in tokens.
    pub max_context: usize,
    /// Requests allowed to wait for a slot; more are refused.
    pub max_pending: usize,
    /// Prompt tokens per prefill chunk.
    pub prefill_chunk: usize,
    /// Positions of KV all sequences share, rounded up to the backend's pages. None (`auto`):
    /// every slot can hold the full context (`max_concurrency × max_context`; the CUDA backend
    /// takes less when that does not fit on the card).
    pub kv_capacity: Option<usize>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { device: Device::Auto, max_concurrency: 8, max_context: 8192, max_pending: 256, prefill_chunk: 512, kv_capacity: None }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Artifact(#[from] crate::artifact::ArtifactError),
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    #[error("{0}")]
    Invalid(String),
    #[error("too many pending requests ({0}); try again later")]
    QueueFull(usize),
    #[error("the prompt has {prompt} tokens but the context limit is {max}")]
    PromptTooLong { prompt: usize, max: usize },
    #[error(
        "the request needs KV for {needed} tokens (a prompt of {prompt} tokens plus max_tokens {max_tokens}, at most the \
         context limit) but the KV capacity is {capacity} tokens; lower max_tokens or raise the KV capacity"
    )]
    ExceedsKvCapacity { prompt: usize, max_tokens: usize, needed: usize, capacity: usize },
    #[error("{0}")]
    Unsupported(String),
}

pub struct Engine {
    path: PathBuf,
    config: ModelConfig,
    tokenizer: Option<Tokenizer>,
    chat_template: Option<String>,
    generation_config: Option<serde_json::Value>,
    eos: Vec<u32>,
    backend_name: String,
    options: EngineOptions,
    /// The backend's pool as sized at open (`used` is not kept up to date here; see `stats`).
    kv_pool: KvPool,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn open_backend(art: &Artifact, opts: &EngineOptions) -> Result<Box<dyn Backend>, EngineError> {
    let cpu = || -> Result<Box<dyn Backend>, EngineError> {
        let o = CpuOptions { max_slots: opts.max_concurrency, max_context: opts.max_context, mtp: false, kv_capacity: opts.kv_capacity };
        Ok(Box::new(CpuBackend::open(art, o)?))
    };
    match opts.device {
        Device::Cpu => cpu(),
        Device::Auto if !cuda::available() => cpu(),
        Device::Auto | Device::Cuda => cuda::open(art, opts),
    }
}

/// Device selection for CUDA: compiled in only with the `cuda` feature.
#[cfg(feature = "cuda")]
mod cuda {
    use super::{EngineError, EngineOptions};
    use crate::artifact::Artifact;
    use crate::backend::cuda::{supported_gpu, CudaBackend, CudaOptions};
    use crate::backend::Backend;

    /// A GPU this build has kernels for is present.
    pub fn available() -> bool {
        supported_gpu().is_some()
    }

    pub fn open(art: &Artifact, opts: &EngineOptions) -> Result<Box<dyn Backend>, EngineError> {
        // A step holds a decode row per running sequence plus one prompt chunk.
        let o = CudaOptions {
            device: 0,
            max_slots: opts.max_concurrency,
            max_context: opts.max_context,
            max_step_tokens: opts.prefill_chunk + opts.max_concurrency,
            kv_capacity: opts.kv_capacity,
            graphs: true,
            mtp: false,
        };
        let b = CudaBackend::open(art, o).map_err(|e| EngineError::Unsupported(format!("device `cuda`: {e}")))?;
        Ok(Box::new(b))
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::{EngineError, EngineOptions};
    use crate::artifact::Artifact;
    use crate::backend::Backend;

    pub fn available() -> bool {
        false
    }

    pub fn open(_: &Artifact, _: &EngineOptions) -> Result<Box<dyn Backend>, EngineError> {
        Err(EngineError::Unsupported(
            "device `cuda` is not available: this build of ninfer has no CUDA support (built without the `cuda` feature); use device `cpu`".into(),
        ))
    }
}

impl Engine {
    pub fn open(path: impl AsRef<Path>, options: EngineOptions) -> Result<Engine, EngineError> {
        Self::open_with(path, options, |b| b)
    }

    /// As `open`, with the opened backend passed through `wrap` first (tests put a backend of
    /// their own around it).
    pub(crate) fn open_with(
        path: impl AsRef<Path>,
        options: EngineOptions,
        wrap: impl FnOnce(Box<dyn Backend>) -> Box<dyn Backend>,
    ) -> Result<Engine, EngineError> {
        if options.max_concurrency == 0 || options.max_context < 2 || options.prefill_chunk == 0 || options.kv_capacity == Some(0) {
            return Err(EngineError::Invalid("max_concurrency, max_context, prefill_chunk and kv_capacity must be positive".into()));
        }
        let art = Artifact::open(path.as_ref())?;
        let text = art.component("text").expect("validated at open");
        let config = ModelConfig::from_json(text).map_err(EngineError::Invalid)?;
        let tokenizer = match art.resource("tokenizer.json") {
            Some(bytes) => Some(Tokenizer::from_bytes(bytes).map_err(|e| EngineError::Invalid(format!("tokenizer.json: {e}")))?),
            None => None,
        };
        let chat_template = art.resource("chat_template.jinja").map(|b| String::from_utf8_lossy(b).into_owned());
        let generation_config: Option<serde_json::Value> =
            art.resource("generation_config.json").and_then(|b| serde_json::from_slice(b).ok());
        let mut eos = config.eos_token_ids.clone();
        if let Some(g) = generation_config.as_ref().and_then(|g| g.get("eos_token_id")) {
            let ids: Vec<u32> = match g {
                serde_json::Value::Array(a) => a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32).collect(),
                v => v.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            };
            eos.extend(ids.into_iter().filter(|i| !config.eos_token_ids.contains(i)));
        }
        let mut options = options;
        options.max_context = options.max_context.min(config.max_position_embeddings);
        let backend = wrap(open_backend(&art, &options)?);
        let backend_name = backend.name();
        let kv_pool = backend.kv_pool();
        let shared = Arc::new(Shared::default());
        let limits = Limits {
            max_slots: options.max_concurrency,
            max_context: options.max_context,
            prefill_chunk: options.prefill_chunk,
            eos: eos.clone(),
        };
        // The sizes are known before the first request: show them from the start.
        scheduler::publish_occupancy(&mut shared.queue.lock().unwrap_or_else(|p| p.into_inner()).stats, 0, 0, backend.as_ref(), &limits);
        let (sh, tok) = (Arc::clone(&shared), tokenizer.clone());
        let thread = std::thread::Builder::new()
            .name("ninfer-scheduler".into())
            .spawn(move || scheduler::run(backend, tok, sh, limits))
            .map_err(|e| EngineError::Invalid(format!("cannot start the scheduler thread: {e}")))?;
        Ok(Engine {
            path: path.as_ref().to_path_buf(),
            config,
            tokenizer,
            chat_template,
            generation_config,
            eos,
            backend_name,
            options,
            kv_pool,
            shared,
            next_id: AtomicU64::new(1),
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    pub fn backend_name(&self) -> &str {
        &self.backend_name
    }

    /// Positions of KV all sequences share (whole pages; at least the requested capacity).
    pub fn kv_capacity(&self) -> usize {
        self.kv_pool.capacity()
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    pub fn generation_config(&self) -> Option<&serde_json::Value> {
        self.generation_config.as_ref()
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Tokens of a text prompt (special-token text becomes its id, as a rendered chat needs).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let t = self.tokenizer.as_ref().ok_or_else(|| EngineError::Unsupported("this artifact has no tokenizer; pass token ids".into()))?;
        t.encode(text, true).map_err(|e| EngineError::Invalid(e.to_string()))
    }

    pub fn stats(&self) -> Stats {
        self.shared.queue.lock().unwrap_or_else(|p| p.into_inner()).stats
    }

    /// Queues a request; its events go to the sink that `make_sink` builds for the request's id
    /// (called on the scheduler thread; it must not block). Returns the id. A request whose KV
    /// reservation (prompt + max_tokens, at most the context limit) exceeds the whole pool is
    /// refused here, since it could never be admitted.
    pub fn submit(&self, prompt: Vec<u32>, params: SamplingParams, make_sink: impl FnOnce(u64) -> EventSink) -> Result<u64, EngineError> {
        params.validate().map_err(EngineError::Invalid)?;
        if prompt.is_empty() {
            return Err(EngineError::Invalid("the prompt is empty".into()));
        }
        if let Some(bad) = prompt.iter().find(|t| **t as usize >= self.config.vocab_size) {
            return Err(EngineError::Invalid(format!("token id {bad} is out of range (vocabulary {})", self.config.vocab_size)));
        }
        if prompt.len() >= self.options.max_context {
            return Err(EngineError::PromptTooLong { prompt: prompt.len(), max: self.options.max_context });
        }
        // Admission reserves this much; more than the whole pool would wait forever.
        let needed = scheduler::reserved_tokens(prompt.len(), params.max_tokens, self.options.max_context);
        if self.kv_pool.pages_for(needed) > self.kv_pool.pages {
            return Err(EngineError::ExceedsKvCapacity {
                prompt: prompt.len(),
                max_tokens: params.max_tokens,
                needed,
                capacity: self.kv_pool.capacity(),
            });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut q = self.shared.queue.lock().unwrap_or_else(|p| p.into_inner());
        if q.shutdown {
            return Err(EngineError::Invalid("the engine is shut down".into()));
        }
        if q.pending.len() >= self.options.max_pending {
            return Err(EngineError::QueueFull(q.pending.len()));
        }
        q.pending.push_back(Request { id, prompt, params, sink: make_sink(id) });
        q.stats.waiting = q.pending.len();
        drop(q);
        self.shared.wake.notify_all();
        Ok(id)
    }

    /// Cancels a request; its slot and KV pages are freed within one scheduler round and it
    /// ends with `FinishReason::Cancelled`. Unknown or finished ids are ignored.
    pub fn cancel(&self, id: u64) {
        self.shared.queue.lock().unwrap_or_else(|p| p.into_inner()).cancelled.insert(id);
        self.shared.wake.notify_all();
    }

    /// Streams a request's events; dropping the stream cancels the request.
    pub fn stream(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<Stream<'_>, EngineError> {
        let (tx, rx) = mpsc::channel();
        let id = self.submit(prompt, params, move |_| Box::new(move |e| drop(tx.send(e))))?;
        Ok(Stream { engine: self, id, rx, done: false })
    }

    /// Runs a request to the end.
    pub fn generate(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<Completion, EngineError> {
        Completion::collect(self.stream(prompt, params)?).map_err(EngineError::Invalid)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.queue.lock().unwrap_or_else(|p| p.into_inner()).shutdown = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// The events of one request, ending with `Done` or `Error`.
pub struct Stream<'a> {
    engine: &'a Engine,
    id: u64,
    rx: mpsc::Receiver<Event>,
    done: bool,
}

impl Stream<'_> {
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Iterator for Stream<'_> {
    type Item = Event;
    fn next(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        let e = self.rx.recv().ok()?;
        self.done = e.is_last();
        Some(e)
    }
}

impl Drop for Stream<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.engine.cancel(self.id);
        }
    }
}

#[cfg(test)]
mod device_tests {
    use super::*;
    use crate::model::testutil::{write_tiny, TinyOpts};

    #[test]
    fn device_selection_without_a_usable_gpu() {
        let path = write_tiny("device-sel", &TinyOpts::default());
        let opts = |device| EngineOptions { device, ..EngineOptions::default() };
        // CUDA is compiled in only with the `cuda` feature and used only where a GPU is present.
        let gpu = cfg!(feature = "cuda") && cuda::available();
        if !gpu {
            let e = Engine::open(&path, opts(Device::Auto)).unwrap();
            assert_eq!(e.backend_name(), "cpu");
            let err = Engine::open(&path, opts(Device::Cuda)).err().expect("no usable GPU");
            let msg = err.to_string();
            assert!(msg.starts_with("device `cuda`"), "{msg}");
            if !cfg!(feature = "cuda") {
                assert!(msg.contains("no CUDA support"), "{msg}");
            }
        }
        assert_eq!(Engine::open(&path, opts(Device::Cpu)).unwrap().backend_name(), "cpu");
        std::fs::remove_file(&path).unwrap();
    }
}

