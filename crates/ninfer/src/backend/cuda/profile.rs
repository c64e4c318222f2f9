//! Per-launch timing of one eager pass from CUDA events (`CudaBackend::profile_step`): where a
//! step's time goes, kernel by kernel, and how many bytes each launch had to move, so that
//! docs/performance.md can give achieved bandwidth per kernel. Events are recorded between
//! launches on the pass's stream; with the GPU kept busy by queued launches, the time between
//! two events is the kernel's run time plus the launch gap the GPU saw.

use std::cell::RefCell;
use std::sync::Arc;

use ninfer_kernels::cudarc::driver::sys::CUevent_flags;
use ninfer_kernels::cudarc::driver::{CudaEvent, CudaStream};

use super::{drv, BackendError};
use crate::backend::LaunchTime;

pub(super) struct Profiler {
    stream: Arc<CudaStream>,
    start: CudaEvent,
    marks: Vec<(&'static str, usize, CudaEvent)>,
    error: Option<BackendError>,
}

impl Profiler {
    pub fn start(stream: &Arc<CudaStream>) -> Result<RefCell<Profiler>, BackendError> {
        let start = event(stream)?;
        Ok(RefCell::new(Profiler { stream: stream.clone(), start, marks: Vec::new(), error: None }))
    }

    /// Closes the launches issued since the previous mark under `label`.
    pub fn mark(&mut self, label: &'static str, bytes: usize) {
        match event(&self.stream) {
            Ok(e) => self.marks.push((label, bytes, e)),
            Err(e) => self.error = self.error.take().or(Some(e)),
        }
    }

    /// The time of every marked span, in order; call after the stream has finished.
    pub fn finish(self) -> Result<Vec<LaunchTime>, BackendError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let mut prev = &self.start;
        let mut out = Vec::with_capacity(self.marks.len());
        for (label, bytes, e) in &self.marks {
            let ms = prev.elapsed_ms(e).map_err(drv("reading profile events"))? as f64;
            out.push(LaunchTime { label, ms, bytes: *bytes });
            prev = e;
        }
        Ok(out)
    }
}

fn event(s: &Arc<CudaStream>) -> Result<CudaEvent, BackendError> {
    let e = s.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("creating a profile event"))?;
    e.record(s).map_err(drv("recording a profile event"))?;
    Ok(e)
}
