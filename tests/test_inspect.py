"""`ninfer inspect`: the summary of a converted artifact (text and JSON), checksum verification
catching a flipped byte, and clean `error:` exits for files that are not artifacts."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from ninfer.cli import main
from ninfer.convert import convert

from test_convert import make_checkpoint, n_tensors, tiny_text_config


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("inspect")
    make_checkpoint(d / "Tiny", experts="per_expert", nvfp4="modelopt")
    rep = convert(d / "Tiny", d / "tiny.ninfer", "qwen3_6_35b_a3b_nvfp4", progress=False)
    return Path(rep["paths"]["artifact"])


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _part_offset(path: Path, tensor: str, part: str) -> int:
    """Absolute file offset of a part (docs/format.md §1: data starts at 32 + L rounded to 4096)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[32 : 32 + length])
    data_start = (32 + length + 4095) // 4096 * 4096
    return data_start + header["tensors"][tensor]["parts"][part]["offset"]


def test_inspect_text(artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _run(capsys, "inspect", str(artifact))
    assert status == 0 and err == ""
    assert "name        Tiny" in out and "arch        qwen3_5_moe" in out
    assert "  text" in out and "    rotary_dim: 4" in out and '  mtp\n    num_layers: 1' in out
    assert "tokenizer.json" in out and "chat_template.jinja" in out
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["layers.0.moe.experts.gate_up"])
    assert row == ["layers.0.moe.experts.gate_up", "text", "nvfp4", "[8,", "64,", "64]", str(8 * 64 * 32 + 8 * 64 * 4 + 8 * 2 * 4)]
    head = next(line.split() for line in out.splitlines() if line.split()[:1] == ["head"])
    assert head[1:3] == ["text", "q6_g64"]
    assert "totals by encoding" in out and "totals by component" in out
    total = n_tensors(tiny_text_config())
    assert f"total       {total} tensors" in out
    enc_section = out.split("totals by encoding")[1].split("totals by component")[0]
    assert {line.split()[0] for line in enc_section.strip().splitlines()[1:]} == {"bf16", "f32", "nvfp4", "q6_g64", "q8_g32"}
    comp_section = out.split("totals by component")[1]
    assert {line.split()[0] for line in comp_section.strip().splitlines()[1:-1]} == {"mtp", "text"}


def test_inspect_json_totals_add_up(artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "inspect", str(artifact), "--json")
    assert status == 0
    s = json.loads(out)
    assert s["arch"] == "qwen3_5_moe" and s["components"]["text"]["num_layers"] == 4 and s["verified"] is False
    assert len(s["tensors"]) == s["totals"]["tensors"] == n_tensors(tiny_text_config())
    total = sum(t["bytes"] for t in s["tensors"])
    assert total == s["totals"]["bytes"] < s["file_bytes"]
    for key in ("by_encoding", "by_component"):
        assert sum(v["bytes"] for v in s["totals"][key].values()) == total
        assert sum(v["tensors"] for v in s["totals"][key].values()) == len(s["tensors"])
    mtp = [t for t in s["tensors"] if t["component"] == "mtp"]
    assert s["totals"]["by_component"]["mtp"] == {"tensors": len(mtp), "bytes": sum(t["bytes"] for t in mtp)}
    assert set(s["resources"]) == {"tokenizer.json", "chat_template.jinja", "generation_config.json"}


def test_verify_catches_a_flipped_byte(artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "inspect", str(artifact), "--verify")
    assert status == 0 and "verify      ok" in out
    bad = tmp_path / "bad.ninfer"
    raw = bytearray(artifact.read_bytes())
    raw[_part_offset(artifact, "layers.2.gdn.qkv", "q") + 100] ^= 0x01
    bad.write_bytes(bytes(raw))
    # Tensor checksums are checked on demand: plain inspect still works, --verify fails.
    assert _run(capsys, "inspect", str(bad))[0] == 0
    status, out, err = _run(capsys, "inspect", str(bad), "--verify")
    assert status == 1 and out == ""
    assert err.startswith("error: ") and "checksum mismatch" in err and "layers.2.gdn.qkv" in err
    assert "Traceback" not in err


def test_open_errors_exit_2_without_traceback(artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    foreign = tmp_path / "foreign.ninfer"
    foreign.write_bytes(b"GGUF" + bytes(100))
    status, out, err = _run(capsys, "inspect", str(foreign))
    assert (status, out) == (2, "") and err.startswith("error: ") and "bad magic" in err and "Traceback" not in err

    status, _, err = _run(capsys, "inspect", str(tmp_path / "absent.ninfer"))
    assert status == 2 and err.startswith("error: ")

    truncated = tmp_path / "truncated.ninfer"
    truncated.write_bytes(artifact.read_bytes()[:5000])
    status, _, err = _run(capsys, "inspect", str(truncated), "--verify")
    assert status == 2 and err.startswith("error: ") and "past the end" in err
