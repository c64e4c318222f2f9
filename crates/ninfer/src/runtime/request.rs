//! What goes into the engine (a request) and what comes out of it (events), independent of how
//! they are carried (Rust channel, Python pump, HTTP stream).

use super::sampler::{SamplingParams, TokenLogprob};

/// Why a sequence ended, in OpenAI's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence id, a stop id or a stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
    /// The caller cancelled (client went away).
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "abort",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// New text and the tokens that produced it (text may be empty while a character or a
    /// possible stop string is incomplete).
    Delta { text: String, token_ids: Vec<u32>, logprobs: Vec<TokenLogprob> },
    /// The last event of a request. `stop` names the stop string or id that ended it, if any.
    Done { reason: FinishReason, usage: Usage, stop: Option<String> },
    /// The request failed inside the engine; also the last event.
    Error(String),
}

impl Event {
    pub fn is_last(&self) -> bool {
        !matches!(self, Event::Delta { .. })
    }
}

/// Where a request's events go. Called on the scheduler thread; must not block.
pub type EventSink = Box<dyn FnMut(Event) + Send>;

pub struct Request {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub sink: EventSink,
}

/// The whole result of a non-streaming generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    pub finish_reason: FinishReason,
    pub stop: Option<String>,
    pub usage: Usage,
}

impl Completion {
    /// Folds a request's events into a completion; an `Error` event becomes `Err`.
    pub fn collect(events: impl IntoIterator<Item = Event>) -> Result<Completion, String> {
        let mut c = Completion {
            text: String::new(),
            token_ids: Vec::new(),
            logprobs: Vec::new(),
            finish_reason: FinishReason::Cancelled,
            stop: None,
            usage: Usage::default(),
        };
        for e in events {
            match e {
                Event::Delta { text, token_ids, logprobs } => {
                    c.text.push_str(&text);
                    c.token_ids.extend(token_ids);
                    c.logprobs.extend(logprobs);
                }
                Event::Done { reason, usage, stop } => {
                    c.finish_reason = reason;
                    c.usage = usage;
                    c.stop = stop;
                    return Ok(c);
                }
                Event::Error(msg) => return Err(msg),
            }
        }
        Err("the engine stopped before the request finished".into())
    }
}
