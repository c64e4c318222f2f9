"""The `ninfer` command: generate, doctor, perplexity, help and version, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ninfer.cli import COMMANDS


def ninfer(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer.cli", *args], capture_output=True, text=True, timeout=300, input=input)


def test_generate_with_the_bundled_model_prints_text():
    r = ninfer("generate", "def fibonacci(n):", "--max-tokens", "8", "--temperature", "0", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def fibonacci(n):") and len(r.stdout.strip()) > len("def fibonacci(n):")


def test_chat_answers_and_exits_on_empty_line():
    r = ninfer("chat", "--max-tokens", "4", "--device", "cpu", input="Hello\n\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("> ") and len(r.stdout) > 4


def test_doctor_json_reports_build_and_model_plan():
    r = ninfer("doctor", "--json", "--context", "1024")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["python"] and d["ninfer"] and isinstance(d["gpus"], list)


def test_perplexity_on_a_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("def add(a, b):\n    return a + b\n" * 20)
    r = ninfer("perplexity", str(f), "--context", "64", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["perplexity"] > 1 and d["tokens_scored"] == d["tokens"] - d["windows"]


def test_errors_are_one_line_without_traceback(tmp_path):
    r = ninfer("generate", "x", "--model", str(tmp_path / "missing.ninfer"))
    assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr
    bad = tmp_path / "bad.ninfer"
    bad.write_bytes(b"not a model at all" * 10)
    r = ninfer("generate", "x", "--model", str(bad))
    assert r.returncode == 2 and "bad magic" in r.stderr


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_every_subcommand_has_help(cmd):
    r = ninfer(cmd, "--help")
    assert r.returncode == 0 and "usage:" in r.stdout


def test_version():
    r = ninfer("--version")
    assert r.returncode == 0 and r.stdout.startswith("ninfer ")
