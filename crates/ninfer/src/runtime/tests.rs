//! Engine tests on a tiny random model: the batched scheduler gives the same tokens as a plain
//! step-by-step loop, seeds reproduce, stop rules and limits end requests, cancellation frees slots.

use super::*;
use crate::artifact::Artifact;
use crate::backend::cpu::{CpuBackend, CpuOptions};
use crate::backend::{Backend, StepInput};
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
        let l = b.step(&[StepInput { slot, tokens: &feed, all_logits: false, argmax: false }]).unwrap().remove(0);
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
