//! Engine tests on a tiny random model: the batched scheduler gives the same tokens as a plain
//! step-by-step loop, seeds reproduce, stop rules and limits end requests, cancellation frees slots,
//! the KV pool bounds admission (requests wait for pages, oversized ones are refused), and a seeded
//! draw does not depend on which rows share its step on a backend that picks tokens.

use super::*;
use crate::artifact::Artifact;
use crate::backend::cpu::{CpuBackend, CpuOptions};
use crate::backend::{Backend, Pick, StepInput};
use crate::model::testutil::{tokens, write_tiny, TinyOpts};
use crate::runtime::sampler::argmax;

fn engine(tag: &str, opts: EngineOptions) -> Engine {
    let path = write_tiny(tag, &TinyOpts::default());
    Engine::open(path, EngineOptions { device: Device::Cpu, ..opts }).unwrap()
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { temperature: 0.0, max_tokens: n, ..Default::default() }
}

/// Greedy continuation computed directly on the backend, one token per step.
fn reference_greedy(path: &std::path::Path, prompt: &[u32], n: usize) -> Vec<u32> {
    let art = Artifact::open(path).unwrap();
    let mut b = CpuBackend::open(&art, CpuOptions::default()).unwrap();
    let slot = b.alloc_slot().unwrap();
    let mut out = Vec::new();
    let mut feed = prompt.to_vec();
    for _ in 0..n {
        let l = b.step(&[StepInput { slot, tokens: &feed, all_logits: false, pick: Pick::Logits }]).unwrap().remove(0);
        let t = argmax(&l.values);
        out.push(t);
        feed = vec![t];
    }
    out
}

#[test]
fn greedy_matches_plain_loop_and_chunked_prefill() {
    let e = engine("rt-greedy", EngineOptions { prefill_chunk: 5, ..Default::default() });
    let prompt = tokens(11, 23);
    let c = e.generate(prompt.clone(), greedy(12)).unwrap();
    assert_eq!(c.token_ids, reference_greedy(e.path(), &prompt, 12));
    assert_eq!(c.finish_reason, FinishReason::Length);
    assert_eq!(c.usage, Usage { prompt_tokens: 23, completion_tokens: 12 });
}

#[test]
fn concurrent_requests_equal_sequential_ones() {
    let e = engine("rt-conc", EngineOptions { max_concurrency: 3, prefill_chunk: 7, ..Default::default() });
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| tokens(100 + i, 5 + 3 * i as usize)).collect();
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| e.generate(p.clone(), greedy(8)).unwrap().token_ids).collect();
    let streams: Vec<_> = prompts.iter().map(|p| e.stream(p.clone(), greedy(8)).unwrap()).collect();
    let together: Vec<Vec<u32>> = streams.into_iter().map(|s| Completion::collect(s).unwrap().token_ids).collect();
    assert_eq!(alone, together);
}

#[test]
fn seeds_reproduce() {
    let e = engine("rt-seed", EngineOptions::default());
    let p = SamplingParams { temperature: 1.0, top_p: 0.9, seed: Some(5), max_tokens: 16, ..Default::default() };
    let a = e.generate(tokens(1, 4), p.clone()).unwrap().token_ids;
    let b = e.generate(tokens(1, 4), p.clone()).unwrap().token_ids;
    let c = e.generate(tokens(1, 4), SamplingParams { seed: Some(6), ..p }).unwrap().token_ids;
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn stop_ids_and_limits() {
    let e = engine("rt-stop", EngineOptions { max_context: 40, ..Default::default() });
    let prompt = tokens(3, 6);
    let free = e.generate(prompt.clone(), greedy(10)).unwrap().token_ids;
    let stop_at = free[4];
    let first = free.iter().position(|t| *t == stop_at).unwrap();
    let c = e.generate(prompt.clone(), SamplingParams { stop_token_ids: vec![stop_at], ..greedy(10) }).unwrap();
    assert_eq!(c.finish_reason, FinishReason::Stop);
    assert_eq!(c.token_ids, free[..=first]);
    // The context limit ends generation with `length`.
    let c = e.generate(tokens(4, 30), greedy(100)).unwrap();
    assert_eq!((c.finish_reason, c.usage.completion_tokens), (FinishReason::Length, 10));
    assert!(matches!(e.generate(tokens(4, 40), greedy(1)), Err(EngineError::PromptTooLong { prompt: 40, max: 40 })));
    assert!(matches!(e.generate(vec![], greedy(1)), Err(EngineError::Invalid(_))));
    assert!(matches!(e.generate(vec![100_000], greedy(1)), Err(EngineError::Invalid(_))));
    let bad = SamplingParams { temperature: -1.0, ..Default::default() };
    assert!(e.generate(tokens(1, 3), bad).unwrap_err().to_string().contains("temperature"));
}

#[test]
fn dropping_a_stream_cancels_and_frees_the_slot() {
    let e = engine("rt-cancel", EngineOptions { max_concurrency: 1, ..Default::default() });
    let mut s = e.stream(tokens(9, 5), greedy(10_000)).unwrap();
    assert!(matches!(s.next(), Some(Event::Delta { .. })));
    drop(s);
    // The only slot must come back: a new request completes.
    let c = e.generate(tokens(9, 5), greedy(3)).unwrap();
    assert_eq!(c.usage.completion_tokens, 3);
    let st = e.stats();
    assert_eq!((st.running, st.waiting, st.slots_used), (0, 0, 0));
}

#[test]
fn full_queue_is_refused() {
    let e = engine("rt-queue", EngineOptions { max_concurrency: 1, max_pending: 1, ..Default::default() });
    let long = SamplingParams { ignore_eos: true, ..greedy(4000) };
    let mut a = e.stream(tokens(1, 3), long.clone()).unwrap();
    // Its first token proves `a` holds the only slot, so `b` must wait and `c` finds the queue full.
    assert!(matches!(a.next(), Some(Event::Delta { .. })));
    let _b = e.stream(tokens(2, 3), long).unwrap();
    assert!(matches!(e.stream(tokens(3, 3), greedy(5)), Err(EngineError::QueueFull(1))));
}

#[test]
fn requests_beyond_the_kv_pool_wait_then_run() {
    // 6 pages of 16; each request reserves 8 + 40 = 48 positions (3 pages): two run at once
    // although four slots are free.
    let e = engine("rt-kv", EngineOptions { max_concurrency: 4, max_context: 64, kv_capacity: Some(96), ..Default::default() });
    assert_eq!(e.kv_capacity(), 96);
    let st = e.stats();
    assert_eq!((st.kv_pages_total, st.kv_page_size, st.kv_pages_reserved, st.kv_pages_used), (6, 16, 0, 0));
    let params = SamplingParams { ignore_eos: true, ..greedy(40) };
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| tokens(200 + i, 8)).collect();
    let mut streams: Vec<_> = prompts.iter().map(|p| e.stream(p.clone(), params.clone()).unwrap()).collect();
    let mut firsts = Vec::new();
    for s in streams.iter_mut().take(2) {
        firsts.push(s.next().unwrap());
    }
    // The first two produced tokens, so both are admitted; the other three wait for pages.
    let st = e.stats();
    assert_eq!((st.running, st.waiting, st.slots_used, st.kv_pages_reserved), (2, 3, 2, 6));
    assert!(st.kv_pages_used <= st.kv_pages_reserved);
    let mut together = Vec::new();
    for (i, s) in streams.into_iter().enumerate() {
        let head = if i < 2 { vec![firsts[i].clone()] } else { vec![] };
        together.push(Completion::collect(head.into_iter().chain(s)).unwrap().token_ids);
    }
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| e.generate(p.clone(), params.clone()).unwrap().token_ids).collect();
    assert_eq!(together, alone);
    assert!(together.iter().all(|t| t.len() == 40));
    let st = e.stats();
    assert_eq!((st.running, st.waiting, st.kv_pages_reserved, st.kv_pages_used), (0, 0, 0, 0));
}

#[test]
fn a_request_larger_than_the_kv_pool_is_refused_at_submit() {
    let e = engine("rt-kv-big", EngineOptions { max_concurrency: 2, max_context: 200, kv_capacity: Some(90), ..Default::default() });
    // 90 positions round up to 6 pages of 16.
    assert_eq!(e.kv_capacity(), 96);
    let err = e.generate(tokens(1, 8), greedy(100)).unwrap_err();
    assert!(
        matches!(err, EngineError::ExceedsKvCapacity { prompt: 8, max_tokens: 100, needed: 108, capacity: 96 }),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("KV capacity is 96 tokens") && msg.contains("108"), "{msg}");
    // A reservation is capped at the context limit: with a limit of 96 the same request fits.
    let capped = engine("rt-kv-cap", EngineOptions { max_concurrency: 2, max_context: 96, kv_capacity: Some(96), ..Default::default() });
    assert_eq!(capped.generate(tokens(1, 8), greedy(100)).unwrap().usage.prompt_tokens, 8);
    assert!(matches!(
        Engine::open(write_tiny("rt-kv-zero", &TinyOpts::default()), EngineOptions { device: Device::Cpu, kv_capacity: Some(0), ..Default::default() }),
        Err(EngineError::Invalid(_))
    ));
    let st = e.stats();
    assert_eq!((st.running, st.waiting, st.kv_pages_reserved), (0, 0, 0));
}

#[test]
fn cancelling_releases_the_kv_reservation() {
    // One request of 5 + 50 positions (4 pages) fills the pool, so the second can only start
    // once the first's reservation is released.
    // Steps of 2 ms keep the first request running while its stats are read (a tiny model
    // otherwise finishes all 50 tokens before the test thread looks).
    let path = write_tiny("rt-kv-cancel", &TinyOpts::default());
    let opts = EngineOptions { device: Device::Cpu, max_concurrency: 2, kv_capacity: Some(64), ..Default::default() };
    let e = Engine::open_with(path, opts, |b| Box::new(Wrapped { inner: b, picks: false, pause: std::time::Duration::from_millis(2) })).unwrap();
    let params = SamplingParams { ignore_eos: true, ..greedy(50) };
    let mut a = e.stream(tokens(7, 5), params.clone()).unwrap();
    // Tokens are sent during a step and the stats published after it: the second token proves
    // the stats of the first step are out.
    assert!(matches!(a.next(), Some(Event::Delta { .. })));
    assert!(matches!(a.next(), Some(Event::Delta { .. })));
    let st = e.stats();
    assert_eq!((st.running, st.kv_pages_reserved, st.kv_pages_total, st.kv_pages_used), (1, 4, 4, 1));
    let b = e.stream(tokens(8, 5), params).unwrap();
    drop(a);
    let c = Completion::collect(b).unwrap();
    assert_eq!(c.usage.completion_tokens, 50);
    let st = e.stats();
    assert_eq!((st.running, st.waiting, st.slots_used, st.kv_pages_reserved, st.kv_pages_used), (0, 0, 0, 0, 0));
}

/// A backend around another for the engine tests: each step waits `pause` first, and with
/// `picks` it picks tokens as the CUDA backend does (argmax and draws where no row of the step
/// needs logits, here on the host by the sampler's own draw with the pick's uniform; logits for
/// every row of a step in which one row needs them).
struct Wrapped {
    inner: Box<dyn Backend>,
    picks: bool,
    pause: std::time::Duration,
}

impl Backend for Wrapped {
    fn config(&self) -> &crate::model::ModelConfig {
        self.inner.config()
    }
    fn name(&self) -> String {
        format!("wrapped {}", self.inner.name())
    }
    fn alloc_slot(&mut self) -> Result<crate::backend::SlotId, crate::backend::BackendError> {
        self.inner.alloc_slot()
    }
    fn free_slot(&mut self, slot: crate::backend::SlotId) {
        self.inner.free_slot(slot)
    }
    fn slot_len(&self, slot: crate::backend::SlotId) -> Result<usize, crate::backend::BackendError> {
        self.inner.slot_len(slot)
    }
    fn kv_pool(&self) -> crate::backend::KvPool {
        self.inner.kv_pool()
    }
    fn picks_tokens(&self) -> bool {
        self.picks
    }
    fn step(&mut self, rows: &[StepInput<'_>]) -> Result<Vec<crate::backend::RowLogits>, crate::backend::BackendError> {
        std::thread::sleep(self.pause);
        let mut out = self.inner.step(rows)?;
        if !self.picks || rows.iter().any(|r| r.pick == Pick::Logits) {
            return Ok(out);
        }
        for (r, o) in rows.iter().zip(&mut out) {
            let last = &o.values[o.values.len() - o.values.len() / o.rows..];
            o.token = Some(match r.pick {
                Pick::Sample(s) => {
                    let p = SamplingParams { temperature: s.temperature, top_k: s.top_k, top_p: s.top_p, min_p: s.min_p, ..Default::default() };
                    crate::runtime::sampler::Sampler::new(p).sample_drawn(last, s.u).0
                }
                _ => argmax(last),
            });
            o.values.clear();
        }
        Ok(out)
    }
}

#[test]
fn a_seeded_draw_does_not_depend_on_what_shares_its_step() {
    let path = write_tiny("rt-mixed", &TinyOpts::default());
    let opts = EngineOptions { device: Device::Cpu, max_concurrency: 2, ..Default::default() };
    let e = Engine::open_with(path, opts, |b| Box::new(Wrapped { inner: b, picks: true, pause: std::time::Duration::ZERO })).unwrap();
    let p = SamplingParams { temperature: 1.0, top_p: 0.95, seed: Some(11), max_tokens: 12, ..Default::default() };
    let alone = e.generate(tokens(3, 6), p.clone()).unwrap();
    // Beside a request with logprobs, every step returns logits, and the seeded request's
    // tokens are drawn on the host.
    let other = e.stream(tokens(4, 5), SamplingParams { temperature: 0.0, logprobs: Some(1), max_tokens: 40, ..Default::default() }).unwrap();
    let together = e.generate(tokens(3, 6), p).unwrap();
    let other = Completion::collect(other).unwrap();
    assert!(other.logprobs.len() >= together.token_ids.len(), "the requests shared their steps");
    assert_eq!(alone.token_ids, together.token_ids);
}
