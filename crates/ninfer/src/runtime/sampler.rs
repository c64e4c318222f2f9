//! Sampling parameters and the CPU sampler (DESIGN.md §6 "Sampling"). One sampler per sequence,
//! with its own seeded RNG, so the same seed gives the same output whatever else is running.
//!
//! Order of operations (as in vLLM and llama.cpp): penalties on the raw logits, then temperature,
//! then top-k, top-p and min-p filtering, then a draw. Temperature 0 is greedy (argmax).

use rand::rngs::StdRng;

use crate::backend::{Pick, SampleSpec};
use rand::{RngExt, SeedableRng};

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub max_tokens: usize,
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    /// Also stop at the model's end-of-sequence ids.
    pub ignore_eos: bool,
    /// Number of top alternatives to report per token (None: no logprobs).
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 256,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
        }
    }
}

/// Most alternatives a request may ask for per token (OpenAI allows 20).
pub const MAX_LOGPROBS: usize = 20;

impl SamplingParams {
    /// Checks every field; the message names the field and the allowed range.
    pub fn validate(&self) -> Result<(), String> {
        let finite = |name: &str, v: f32| if v.is_finite() { Ok(()) } else { Err(format!("{name} must be a finite number")) };
        finite("temperature", self.temperature)?;
        finite("top_p", self.top_p)?;
        finite("min_p", self.min_p)?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        finite("repetition_penalty", self.repetition_penalty)?;
        if self.max_tokens == 0 {
            return Err("max_tokens must be at least 1".into());
        }
        if self.temperature < 0.0 {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) || !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err("presence_penalty and frequency_penalty must be in [-2, 2]".into());
        }
        if self.repetition_penalty <= 0.0 {
            return Err(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return Err("stop strings must not be empty".into());
        }
        if let Some(n) = self.logprobs {
            if n > MAX_LOGPROBS {
                return Err(format!("logprobs must be at most {MAX_LOGPROBS}, got {n}"));
            }
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// The log-probability of the chosen token and of the top alternatives, from the distribution
/// after penalties and before temperature and filtering (what OpenAI reports).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// How often each token was generated so far (for the penalties), sparse.
    counts: std::collections::HashMap<u32, u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => rand::make_rng(),
        };
        Sampler { params, rng, counts: Default::default() }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a token of the sequence (prompt tokens count for the repetition penalty only when
    /// the caller pushes them; generated tokens always do).
    pub fn observe(&mut self, token: u32) {
        *self.counts.entry(token).or_insert(0) += 1;
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        if p.presence_penalty == 0.0 && p.frequency_penalty == 0.0 && p.repetition_penalty == 1.0 {
            return;
        }
        for (&tok, &n) in &self.counts {
            let Some(l) = logits.get_mut(tok as usize) else { continue };
            if p.repetition_penalty != 1.0 {
                *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
            }
            *l -= p.frequency_penalty * n as f32 + p.presence_penalty;
        }
    }

    /// How a backend that picks tokens on its device may pick the next one: by argmax or a draw
    /// with a uniform number taken from this sampler's generator, when neither penalties nor
    /// logprobs need the logits on the host. The token then comes back through `accept`.
    pub fn device_pick(&mut self) -> Pick {
        let p = &self.params;
        if p.logprobs.is_some() || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 || p.repetition_penalty != 1.0 {
            return Pick::Logits;
        }
        if p.is_greedy() {
            return Pick::Argmax;
        }
        let (temperature, top_k, top_p, min_p) = (p.temperature, p.top_k, p.top_p, p.min_p);
        Pick::Sample(SampleSpec { temperature, top_k, top_p, min_p, u: self.rng.random::<f32>() })
    }

    /// Takes a token the backend picked as `device_pick` asked.
    pub fn accept(&mut self, token: u32) -> (u32, Option<TokenLogprob>) {
        self.observe(token);
        (token, None)
    }

    /// Picks from the logits a backend returned for a row that asked for a device draw
    /// (`Pick::Sample`, which never has penalties or logprobs; a step that returns logits for
    /// another row returns them for all): the host draw with the uniform number the pick
    /// carried, so the generator advances once per token however the token is picked.
    pub fn sample_drawn(&mut self, logits: &[f32], u: f32) -> (u32, Option<TokenLogprob>) {
        let token = self.draw(logits, Some(u as f64));
        self.observe(token);
        (token, None)
    }

    /// Picks the next token from one row of logits (modified in place).
    pub fn sample(&mut self, logits: &mut [f32]) -> (u32, Option<TokenLogprob>) {
        self.apply_penalties(logits);
        let logprob_view = self.params.logprobs.map(|_| log_softmax(logits));
        let token = if self.params.is_greedy() { argmax(logits) } else { self.draw(logits, None) };
        let lp = logprob_view.map(|lps| {
            let n = self.params.logprobs.unwrap_or(0);
            TokenLogprob { token, logprob: lps[token as usize], top: top_n(&lps, n) }
        });
        self.observe(token);
        (token, lp)
    }

    /// Inverse-CDF draw over the filtered candidates with `u` in [0, 1), or one taken from the
    /// generator.
    fn draw(&mut self, logits: &[f32], u: Option<f64>) -> u32 {
        let p = &self.params;
        let t = p.temperature;
        // Candidates sorted by logit, descending; ties keep the lower id first (deterministic).
        let mut idx: Vec<u32> = (0..logits.len() as u32).filter(|&i| logits[i as usize].is_finite()).collect();
        if idx.is_empty() {
            return 0;
        }
        let k = if p.top_k == 0 { idx.len() } else { p.top_k.min(idx.len()) };
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, |a, b| cmp_desc(logits, *a, *b));
            idx.truncate(k);
        }
        idx.sort_unstable_by(|a, b| cmp_desc(logits, *a, *b));
        let max = logits[idx[0] as usize];
        let mut probs: Vec<f64> = idx.iter().map(|&i| (((logits[i as usize] - max) / t) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        // top-p: the smallest prefix whose mass reaches p (at least one token).
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        // min-p: drop tokens below min_p times the top probability.
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            keep = keep.min(probs.iter().take_while(|q| **q >= floor).count().max(1));
        }
        let mass: f64 = probs[..keep].iter().sum();
        let mut u = u.unwrap_or_else(|| self.rng.random::<f64>()) * mass;
        for (i, q) in probs[..keep].iter().enumerate() {
            u -= q;
            if u <= 0.0 {
                return idx[i];
            }
        }
        idx[keep - 1]
    }
}

fn cmp_desc(logits: &[f32], a: u32, b: u32) -> std::cmp::Ordering {
    logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b))
}

/// Index of the largest value; the lowest index wins ties (as torch.argmax on CPU).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

pub fn log_softmax(v: &[f32]) -> Vec<f32> {
    let max = v.iter().fold(f32::NEG_INFINITY, |m, x| m.max(*x));
    let lse = max + v.iter().map(|x| ((x - max) as f64).exp()).sum::<f64>().ln() as f32;
    v.iter().map(|x| x - lse).collect()
}

fn top_n(lps: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..lps.len() as u32).collect();
    let n = n.min(idx.len());
    if n == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(n - 1, |a, b| cmp_desc(lps, *a, *b));
    idx.truncate(n);
    idx.sort_unstable_by(|a, b| cmp_desc(lps, *a, *b));
    idx.into_iter().map(|i| (i, lps[i as usize])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32) -> SamplingParams {
        SamplingParams { temperature: t, ..Default::default() }
    }

    #[test]
    fn a_device_draw_taken_on_the_host_uses_the_uniform_it_carried() {
        let logits = [2.0f32, 1.0, 0.5, -1.0, 3.0];
        let seeded = || Sampler::new(SamplingParams { top_k: 4, seed: Some(9), ..params(1.0) });
        // Lowest and highest uniforms pick the first and the last kept candidate (by logit).
        assert_eq!(seeded().sample_drawn(&logits, 0.0).0, 4);
        assert_eq!(seeded().sample_drawn(&logits, 0.999_999).0, 2);
        // The generator moves once per token whether the token came back picked or as logits:
        // the next pick's uniform is the same either way.
        let (mut a, mut b) = (seeded(), seeded());
        let (Pick::Sample(pa), Pick::Sample(_)) = (a.device_pick(), b.device_pick()) else { panic!("draws") };
        a.sample_drawn(&logits, pa.u);
        b.accept(4);
        assert_eq!(a.device_pick(), b.device_pick());
    }

    #[test]
    fn device_picks_leave_the_logits_on_the_device_only_when_nothing_else_needs_them() {
        assert_eq!(Sampler::new(params(0.0)).device_pick(), Pick::Argmax);
        assert_eq!(Sampler::new(SamplingParams { logprobs: Some(2), ..params(0.0) }).device_pick(), Pick::Logits);
        assert_eq!(Sampler::new(SamplingParams { repetition_penalty: 1.1, ..params(0.7) }).device_pick(), Pick::Logits);
        assert_eq!(Sampler::new(SamplingParams { presence_penalty: 0.5, ..params(0.7) }).device_pick(), Pick::Logits);
        // A draw carries the filters and a uniform number from the seeded generator.
        let draws = |seed| {
            let mut s = Sampler::new(SamplingParams { top_k: 5, top_p: 0.9, min_p: 0.1, seed: Some(seed), ..params(0.7) });
            (0..4).map(|_| s.device_pick()).collect::<Vec<_>>()
        };
        let a = draws(3);
        assert_eq!(a, draws(3));
        assert_ne!(a, draws(4));
        for p in &a {
            let Pick::Sample(spec) = p else { panic!("{p:?}") };
            assert_eq!((spec.temperature, spec.top_k, spec.top_p, spec.min_p), (0.7, 5, 0.9, 0.1));
            assert!((0.0..1.0).contains(&spec.u));
        }
    }

    #[test]
    fn greedy_is_argmax_and_lowest_index_on_ties() {
        let mut s = Sampler::new(params(0.0));
        assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0]).0, 1);
    }

    #[test]
    fn same_seed_same_draws() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 7919) % 13) as f32 / 3.0).collect();
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams { seed: Some(seed), ..params(1.0) });
            (0..40).map(|_| s.sample(&mut logits.clone()).0).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_restricts() {
        let logits = vec![1.0, 5.0, 2.0, 4.9];
        let mut s = Sampler::new(SamplingParams { top_k: 1, seed: Some(1), ..params(1.0) });
        assert!((0..20).all(|_| s.sample(&mut logits.clone()).0 == 1));
        // Mass of token 1 and 3 is ~0.97 of the total; top_p 0.5 keeps token 1 only.
        let mut s = Sampler::new(SamplingParams { top_p: 0.5, seed: Some(2), ..params(1.0) });
        assert!((0..20).all(|_| s.sample(&mut logits.clone()).0 == 1));
        let mut s = Sampler::new(SamplingParams { top_p: 0.99, seed: Some(3), ..params(1.0) });
        let seen: std::collections::HashSet<u32> = (0..200).map(|_| s.sample(&mut logits.clone()).0).collect();
        assert!(seen.contains(&1) && seen.contains(&3) && !seen.contains(&0));
    }

    #[test]
    fn min_p_filters_unlikely_tokens() {
        let logits = vec![0.0, 10.0, 9.0];
        let mut s = Sampler::new(SamplingParams { min_p: 0.5, seed: Some(4), ..params(1.0) });
        assert!((0..100).all(|_| s.sample(&mut logits.clone()).0 != 0));
    }

    #[test]
    fn penalties_change_the_choice() {
        let mut s = Sampler::new(SamplingParams { frequency_penalty: 2.0, ..params(0.0) });
        assert_eq!(s.sample(&mut [1.0, 1.5]).0, 1);
        // Token 1 was generated once: 1.5 - 2.0 < 1.0.
        assert_eq!(s.sample(&mut [1.0, 1.5]).0, 0);
        let mut r = Sampler::new(SamplingParams { repetition_penalty: 2.0, ..params(0.0) });
        r.observe(0);
        assert_eq!(r.sample(&mut [2.0, 1.5]).0, 1);
    }

    #[test]
    fn logprobs_are_normalised_and_sorted() {
        let mut s = Sampler::new(SamplingParams { logprobs: Some(2), ..params(0.0) });
        let (tok, lp) = s.sample(&mut [0.0, 2.0, 1.0]);
        let lp = lp.unwrap();
        assert_eq!(tok, 1);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        let total: f32 = [0.0f32, 2.0, 1.0].iter().map(|x| (x - 2.0 + lp.logprob).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    #[test]
    fn validation_names_the_field() {
        for (p, word) in [
            (SamplingParams { temperature: -1.0, ..Default::default() }, "temperature"),
            (SamplingParams { top_p: 0.0, ..Default::default() }, "top_p"),
            (SamplingParams { max_tokens: 0, ..Default::default() }, "max_tokens"),
            (SamplingParams { logprobs: Some(99), ..Default::default() }, "logprobs"),
            (SamplingParams { min_p: 2.0, ..Default::default() }, "min_p"),
            (SamplingParams { stop: vec![String::new()], ..Default::default() }, "stop"),
        ] {
            assert!(p.validate().unwrap_err().contains(word), "{word}");
        }
    }
}
