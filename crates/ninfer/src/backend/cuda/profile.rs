//! Per-launch timing of one pass from CUDA events (`CudaBackend::profile_step`): where a
//! step's time goes, kernel by kernel, and how many bytes each launch had to move, so that
//! docs/performance.md can give achieved bandwidth per kernel. Events are recorded between
//! launches on the pass's stream. A decode pass is captured as a graph of its own with the
//! events as nodes between its launches (so no host launch gap is timed, but a launch no longer
//! overlaps the one ahead of it); a prefill pass runs eagerly, where the time between two events
//! is the kernel's run time plus the launch gap the GPU saw.

use std::cell::RefCell;
use std::sync::Arc;

use ninfer_kernels::cudarc::driver::sys::{self, CUevent_flags, CUevent_record_flags};
use ninfer_kernels::cudarc::driver::{CudaEvent, CudaStream};

use super::{drv, BackendError};
use crate::backend::LaunchTime;

pub(super) struct Profiler {
    stream: Arc<CudaStream>,
    start: CudaEvent,
    marks: Vec<(&'static str, usize, CudaEvent)>,
    error: Option<BackendError>,
    /// Recording inside a graph capture: events are recorded as graph nodes.
    in_graph: bool,
}

impl Profiler {
    pub fn start(stream: &Arc<CudaStream>) -> Result<RefCell<Profiler>, BackendError> {
        let start = event(stream, false)?;
        Ok(RefCell::new(Profiler { stream: stream.clone(), start, marks: Vec::new(), error: None, in_graph: false }))
    }

    /// Starts over inside a graph capture that has just begun: the start event and every mark
    /// become nodes of the graph, recorded when it is launched.
    pub fn restart_in_capture(&mut self) -> Result<(), BackendError> {
        self.in_graph = true;
        self.marks.clear();
        self.start = event(&self.stream, true)?;
        Ok(())
    }

    /// Closes the launches issued since the previous mark under `label`.
    pub fn mark(&mut self, label: &'static str, bytes: usize) {
        match event(&self.stream, self.in_graph) {
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

/// A new event recorded on `s`; `in_graph`, as an event node of the graph `s` is capturing
/// (an event recorded plainly during a capture cannot be timed afterwards).
fn event(s: &Arc<CudaStream>, in_graph: bool) -> Result<CudaEvent, BackendError> {
    let e = s.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("creating a profile event"))?;
    if in_graph {
        let external = CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32;
        // SAFETY: the event and the stream are alive for the call.
        unsafe { sys::cuEventRecordWithFlags(e.cu_event(), s.cu_stream(), external) }.result().map_err(drv("recording a profile event in a graph"))?;
    } else {
        e.record(s).map_err(drv("recording a profile event"))?;
    }
    Ok(e)
}
