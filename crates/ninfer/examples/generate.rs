//! Prints a completion for a prompt, streaming it token by token: the smallest Rust embedding.
//!
//! `cargo run --release --example generate -- MODEL.ninfer "def fibonacci(n):" [max_tokens]`

use std::io::Write;

use ninfer::runtime::{Event, SamplingParams};
use ninfer::{Engine, EngineOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(model), Some(prompt)) = (args.next(), args.next()) else {
        eprintln!("usage: generate MODEL.ninfer PROMPT [MAX_TOKENS]");
        std::process::exit(2);
    };
    let max_tokens = args.next().map(|s| s.parse()).transpose()?.unwrap_or(32);
    let engine = Engine::open(&model, EngineOptions::default())?;
    let ids = engine.encode(&prompt)?;
    let params = SamplingParams { max_tokens, temperature: 0.0, ..Default::default() };
    let mut out = std::io::stdout().lock();
    write!(out, "{prompt}")?;
    for event in engine.stream(ids, params)? {
        match event {
            Event::Delta { text, .. } => write!(out, "{text}")?,
            Event::Done { reason, usage, .. } => {
                writeln!(out)?;
                eprintln!("[{} after {} tokens]", reason.as_str(), usage.completion_tokens);
            }
            Event::Error(msg) => return Err(msg.into()),
        }
        out.flush()?;
    }
    Ok(())
}
