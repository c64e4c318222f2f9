//! The scheduler thread: continuous batching over one backend (DESIGN.md §3, §6).
//!
//! Each round: drop cancelled sequences, admit waiting requests in FIFO order while a state slot
//! is free and their KV reservation fits, then run one backend step made of a decode row for
//! every sequence that is generating and at most one prompt chunk, sample, detokenize, match stop
//! rules and send events.
//!
//! KV: a request reserves, at admission, the pages of the longest sequence it may become
//! (`prompt + max_tokens`, capped at the context limit), so a running sequence never finds the
//! pool full halfway through. The head of the queue waits until its reservation fits; nothing
//! overtakes it, so a large request is never starved by a stream of small ones.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex};

use super::request::{Event, FinishReason, Request, Usage};
use super::sampler::{Sampler, TokenLogprob};
use super::stop::{StopMatcher, StopScan};
use crate::backend::{Backend, Pick, SlotId, StepInput};
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
    /// Pages of the backend's KV pool, and positions per page.
    pub kv_pages_total: usize,
    pub kv_page_size: usize,
    /// Pages set aside for the running sequences (what admission counts against the pool).
    pub kv_pages_reserved: usize,
    /// Pages the backend's slots hold now (at most the reserved ones).
    pub kv_pages_used: usize,
}

/// Positions of the longest sequence a request may become: what admission reserves for it.
pub(crate) fn reserved_tokens(prompt: usize, max_tokens: usize, max_context: usize) -> usize {
    prompt.saturating_add(max_tokens).min(max_context)
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
    /// KV pages reserved at admission, released when the sequence leaves `running`.
    reserved: usize,
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

/// Occupancy counters as they are now. Called under the queue lock after every change to
/// `running` or to the backend's slots, so `/metrics` never shows a finished or cancelled
/// request's pages once it has left `running`.
fn publish(stats: &mut Stats, running: &[Sequence], backend: &dyn Backend, limits: &Limits) {
    publish_occupancy(stats, running.len(), running.iter().map(|s| s.reserved).sum(), backend, limits);
}

/// The counters of `running` sequences holding `reserved` pages; with none, the engine's
/// sizes as they are known before the first request.
pub(crate) fn publish_occupancy(stats: &mut Stats, running: usize, reserved: usize, backend: &dyn Backend, limits: &Limits) {
    let pool = backend.kv_pool();
    stats.running = running;
    stats.slots_total = limits.max_slots;
    stats.slots_used = running;
    stats.kv_pages_total = pool.pages;
    stats.kv_page_size = pool.page_size;
    stats.kv_pages_reserved = reserved;
    stats.kv_pages_used = pool.used;
}

pub(crate) fn run(mut backend: Box<dyn Backend>, tokenizer: Option<Tokenizer>, shared: Arc<Shared>, limits: Limits) {
    let pool = backend.kv_pool();
    let mut running: Vec<Sequence> = Vec::new();
    loop {
        let mut dropped = Vec::new();
        let mut refused = Vec::new();
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
                    // Freed here, under the lock, so the stats published below already show
                    // its pages back (freeing a slot is bookkeeping, not device work).
                    let s = running.remove(pos);
                    backend.free_slot(s.slot);
                    dropped.push(s);
                }
            }
            let mut reserved: usize = running.iter().map(|s| s.reserved).sum();
            while running.len() < limits.max_slots {
                let Some(head) = q.pending.front() else { break };
                let need = pool.pages_for(reserved_tokens(head.prompt.len(), head.params.max_tokens, limits.max_context));
                if need > pool.pages {
                    // `Engine::submit` refuses these; kept so that such a request can never
                    // block the queue for good.
                    refused.push(q.pending.pop_front().expect("checked non-empty"));
                    continue;
                }
                if reserved + need > pool.pages {
                    break;
                }
                let slot = match backend.alloc_slot() {
                    Ok(s) => s,
                    Err(_) => break,
                };
                let req = q.pending.pop_front().expect("checked non-empty");
                q.stats.prompt_tokens += req.prompt.len() as u64;
                reserved += need;
                running.push(Sequence {
                    sampler: Sampler::new(req.params.clone()),
                    stop: StopMatcher::new(req.params.stop.clone()),
                    detok: tokenizer.as_ref().map(|t| Detokenizer::new(t, false)),
                    req,
                    slot,
                    reserved: need,
                    fed: 0,
                    generated: Vec::new(),
                });
            }
            q.stats.waiting = q.pending.len();
            publish(&mut q.stats, &running, backend.as_ref(), &limits);
        }
        for mut r in refused {
            (r.sink)(Event::Error(format!("the request needs more KV than the whole pool ({} tokens)", pool.capacity())));
        }
        for mut s in dropped {
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
            publish(&mut q.stats, &running, backend.as_ref(), &limits);
        }
        // Final events go out after the stats say the slots and pages are free, so a caller that
        // sees a request end also sees them released.
        for (mut s, how) in finished {
            if let Some((reason, stop)) = how {
                s.finish(reason, stop);
            }
        }
    }
}

/// How a sequence ended: None for a failed step (its error already sent), else the reason and
/// the stop string that matched.
type Ending = Option<(FinishReason, Option<String>)>;
type Finished = (Sequence, Ending);

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
    let picks = backend.picks_tokens();
    let inputs: Vec<StepInput> = rows
        .iter()
        .map(|(i, t)| {
            let s = &mut running[*i];
            // A prompt chunk that does not end the prompt produces no token.
            let pick = if picks && s.fed + t.len() >= s.req.prompt.len() { s.sampler.device_pick() } else { Pick::Logits };
            StepInput { slot: s.slot, tokens: t, all_logits: false, pick }
        })
        .collect();
    let result = backend.step(&inputs);
    let mut finished: Vec<(usize, Ending)> = Vec::new();
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
            for (((i, toks), mut out), input) in rows.iter().zip(logits).zip(&inputs) {
                let s = &mut running[*i];
                s.fed = (s.fed + toks.len()).min(s.req.prompt.len());
                if s.fed < s.req.prompt.len() {
                    continue;
                }
                let picked = match out.token {
                    Some(tok) => s.sampler.accept(tok),
                    None => {
                        let vocab = out.values.len() / out.rows.max(1);
                        let last = &mut out.values[(out.rows - 1) * vocab..];
                        match input.pick {
                            // Its uniform was drawn already: the same draw, on the host.
                            Pick::Sample(spec) => s.sampler.sample_drawn(last, spec.u),
                            _ => s.sampler.sample(last),
                        }
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
