//! The scheduler thread: continuous batching over one backend (DESIGN.md §3, §6).
//!
//! Each round: drop cancelled sequences, admit waiting requests in FIFO order while a state slot
//! is free, then run one backend step made of a decode row for every sequence that is generating
//! and at most one prompt chunk, sample, detokenize, match stop rules and send events.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex};

use super::request::{Event, FinishReason, Request, Usage};
use super::sampler::{Sampler, TokenLogprob};
use super::stop::{StopMatcher, StopScan};
use crate::backend::{Backend, SlotId, StepInput};
use crate::tokenizer::{Detokenizer, Tokenizer};

/// Counters read by `/metrics` and `doctor`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    pub running: usize,
    pub waiting: usize,
    pub slots_total: usize,
    pub slots_used: usize,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub steps: u64,
}

#[derive(Default)]
pub(crate) struct Queue {
    pub pending: VecDeque<Request>,
    pub cancelled: HashSet<u64>,
    pub shutdown: bool,
    pub stats: Stats,
}

#[derive(Default)]
pub(crate) struct Shared {
    pub queue: Mutex<Queue>,
    pub wake: Condvar,
}

pub(crate) struct Limits {
    pub max_slots: usize,
    pub max_context: usize,
    pub prefill_chunk: usize,
    pub eos: Vec<u32>,
}

struct Sequence {
    req: Request,
    slot: SlotId,
    fed: usize,
    generated: Vec<u32>,
    sampler: Sampler,
    detok: Option<Detokenizer>,
    stop: StopMatcher,
}

impl Sequence {
    fn finish(&mut self, reason: FinishReason, stop: Option<String>) {
        let mut text = self.detok.as_mut().map(|d| d.finish()).unwrap_or_default();
        let (mut reason, mut stop) = (reason, stop);
        if reason != FinishReason::Cancelled {
            match self.stop.push(&text) {
                StopScan::Stopped(t, which) => {
                    text = t;
                    reason = FinishReason::Stop;
                    stop = Some(which);
                }
                StopScan::Continue(t) => text = t + &self.stop.finish(),
            }
            if !text.is_empty() {
                (self.req.sink)(Event::Delta { text, token_ids: vec![], logprobs: vec![] });
            }
        }
        let usage = Usage { prompt_tokens: self.req.prompt.len(), completion_tokens: self.generated.len() };
        (self.req.sink)(Event::Done { reason, usage, stop });
    }
}

pub(crate) fn run(mut backend: Box<dyn Backend>, tokenizer: Option<Tokenizer>, shared: Arc<Shared>, limits: Limits) {
    let mut running: Vec<Sequence> = Vec::new();
    loop {
        let mut dropped = Vec::new();
        {
            let mut q = shared.queue.lock().unwrap_or_else(|p| p.into_inner());
            while running.is_empty() && q.pending.is_empty() && !q.shutdown {
                q = shared.wake.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            if q.shutdown {
                for mut r in q.pending.drain(..) {
                    (r.sink)(Event::Error("the engine shut down".into()));
                }
                for s in running.iter_mut() {
                    (s.req.sink)(Event::Error("the engine shut down".into()));
                }
                return;
            }
            let cancelled: Vec<u64> = q.cancelled.drain().collect();
            for id in cancelled {
                if let Some(pos) = q.pending.iter().position(|r| r.id == id) {
                    let mut r = q.pending.remove(pos).expect("position is valid");
                    (r.sink)(Event::Done { reason: FinishReason::Cancelled, usage: Usage::default(), stop: None });
                } else if let Some(pos) = running.iter().position(|s| s.req.id == id) {
                    dropped.push(running.remove(pos));
                }
            }
            while running.len() < limits.max_slots && !q.pending.is_empty() {
                let slot = match backend.alloc_slot() {
                    Ok(s) => s,
                    Err(_) => break,
                };
                let req = q.pending.pop_front().expect("checked non-empty");
                q.stats.prompt_tokens += req.prompt.len() as u64;
                running.push(Sequence {
                    sampler: Sampler::new(req.params.clone()),
                    stop: StopMatcher::new(req.params.stop.clone()),
                    detok: tokenizer.as_ref().map(|t| Detokenizer::new(t, false)),
                    req,
                    slot,
                    fed: 0,
                    generated: Vec::new(),
                });
            }
            q.stats.running = running.len();
            q.stats.waiting = q.pending.len();
            q.stats.slots_total = limits.max_slots;
            q.stats.slots_used = running.len();
        }
        for mut s in dropped {
            backend.free_slot(s.slot);
            s.finish(FinishReason::Cancelled, None);
        }
        if running.is_empty() {
            continue;
        }
        let (generated, finished) = step(backend.as_mut(), &mut running, &limits);
        {
            let mut q = shared.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.stats.generated_tokens += generated;
            q.stats.steps += 1;
            q.stats.running = running.len();
            q.stats.slots_used = running.len();
        }
        // Final events go out after the stats say the slots are free, so a caller that sees a
        // request end also sees its slot released.
        for (mut s, how) in finished {
            if let Some((reason, stop)) = how {
                s.finish(reason, stop);
            }
        }
    }
}

type Finished = (Sequence, Option<(FinishReason, Option<String>)>);

/// One round over the running sequences; finished ones are removed and their slots freed.
/// Returns the number of tokens generated and the finished sequences, whose final events the
/// caller sends (a failed step has already sent its error events).
fn step(backend: &mut dyn Backend, running: &mut Vec<Sequence>, limits: &Limits) -> (u64, Vec<Finished>) {
    // Rows: every generating sequence decodes one token; the first sequence still reading its
    // prompt contributes one chunk.
    let mut rows: Vec<(usize, Vec<u32>)> = Vec::new();
    let mut prefill_taken = false;
    for (i, s) in running.iter().enumerate() {
        if s.fed < s.req.prompt.len() {
            if !prefill_taken {
                let end = (s.fed + limits.prefill_chunk).min(s.req.prompt.len());
                rows.push((i, s.req.prompt[s.fed..end].to_vec()));
                prefill_taken = true;
            }
        } else {
            rows.push((i, vec![*s.generated.last().expect("a generating sequence has a token")]));
        }
    }
    let inputs: Vec<StepInput> = rows
        .iter()
        .map(|(i, t)| {
            let s = &running[*i];
            StepInput { slot: s.slot, tokens: t, all_logits: false, argmax: s.sampler.argmax_suffices() }
        })
        .collect();
    let result = backend.step(&inputs);
    let mut finished: Vec<(usize, Option<(FinishReason, Option<String>)>)> = Vec::new();
    let mut produced = 0;
    match result {
        Err(e) => {
            // A failed step fails every sequence in it; the others keep going.
            for (i, _) in &rows {
                (running[*i].req.sink)(Event::Error(format!("backend step failed: {e}")));
                finished.push((*i, None));
            }
        }
        Ok(logits) => {
            for ((i, toks), mut out) in rows.iter().zip(logits) {
                let s = &mut running[*i];
                s.fed = (s.fed + toks.len()).min(s.req.prompt.len());
                if s.fed < s.req.prompt.len() {
                    continue;
                }
                let picked = match out.token {
                    Some(tok) => s.sampler.accept(tok),
                    None => {
                        let vocab = out.values.len() / out.rows.max(1);
                        s.sampler.sample(&mut out.values[(out.rows - 1) * vocab..])
                    }
                };
                produced += 1;
                if let Some(f) = emit(s, picked, limits) {
                    finished.push((*i, Some(f)));
                }
            }
        }
    }
    finished.sort_by_key(|f| std::cmp::Reverse(f.0));
    let done = finished
        .into_iter()
        .map(|(i, how)| {
            let s = running.remove(i);
            backend.free_slot(s.slot);
            (s, how)
        })
        .collect();
    (produced, done)
}

/// Appends the token picked for `s` and sends its text; returns the finish reason if it ended.
fn emit(s: &mut Sequence, picked: (u32, Option<TokenLogprob>), limits: &Limits) -> Option<(FinishReason, Option<String>)> {
    let (tok, lp) = picked;
    s.generated.push(tok);
    let p = s.sampler.params();
    if (!p.ignore_eos && limits.eos.contains(&tok)) || p.stop_token_ids.contains(&tok) {
        // The stop token is reported (ids, usage) but its text is not.
        let logprobs = lp.into_iter().collect();
        (s.req.sink)(Event::Delta { text: String::new(), token_ids: vec![tok], logprobs });
        return Some((FinishReason::Stop, Some(format!("token {tok}"))));
    }
    let piece = s.detok.as_mut().map(|d| d.push(tok)).unwrap_or_default();
    let logprobs = lp.into_iter().collect();
    match s.stop.push(&piece) {
        StopScan::Stopped(text, which) => {
            (s.req.sink)(Event::Delta { text, token_ids: vec![tok], logprobs });
            return Some((FinishReason::Stop, Some(which)));
        }
        StopScan::Continue(text) => (s.req.sink)(Event::Delta { text, token_ids: vec![tok], logprobs }),
    }
    let context = s.req.prompt.len() + s.generated.len();
    if s.generated.len() >= p.max_tokens || context >= limits.max_context {
        return Some((FinishReason::Length, None));
    }
    None
}
