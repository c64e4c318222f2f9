//! Runs `examples/generate.rs` (built by `cargo test`) on the bundled demo model and checks that
//! it prints the prompt followed by a greedy completion equal to the engine's own.

use std::path::PathBuf;
use std::process::Command;

use ninfer::runtime::SamplingParams;
use ninfer::{Engine, EngineOptions};

fn demo_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../python/ninfer/models/demo.ninfer")
}

/// `cargo test` builds examples, `cargo test --test example` does not: build it when missing.
fn example_binary() -> PathBuf {
    // target/<profile>/deps/example-<hash> -> target/<profile>/examples/generate
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let bin = profile_dir.join("examples").join("generate");
    if !bin.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-p", "ninfer", "--example", "generate"]);
        if profile_dir.ends_with("release") {
            cmd.arg("--release");
        }
        assert!(cmd.status().unwrap().success(), "building the example failed");
    }
    bin
}

#[test]
fn generate_example_prints_the_greedy_completion() {
    let out = Command::new(example_binary()).arg(demo_model()).arg("def fibonacci(n):").arg("12").output().unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8(out.stdout).unwrap();
    let engine = Engine::open(demo_model(), EngineOptions::default()).unwrap();
    let ids = engine.encode("def fibonacci(n):").unwrap();
    let want = engine.generate(ids, SamplingParams { max_tokens: 12, temperature: 0.0, ..Default::default() }).unwrap();
    assert_eq!(printed, format!("def fibonacci(n):{}\n", want.text));
    assert!(String::from_utf8_lossy(&out.stderr).contains("12 tokens"));
}
