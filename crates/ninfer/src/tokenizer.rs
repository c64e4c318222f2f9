//! Text <-> token ids for Qwen3.5/3.6: a `tokenizer.json` loaded through the `tokenizers` crate,
//! plus the incremental detokenizer used when streaming (DESIGN.md, layout: `tokenizer.rs`).
//!
//! Encoding follows the reference tokenizer of the model (tiktoken ranks with the Qwen3.5 split
//! regex): the whole input is NFC-normalised first, then the special tokens of model-spec.md §5.1
//! are cut out (only when the caller allows them), then byte-level BPE runs on the rest.
//!
//! Decoding is done here rather than through the `tokenizers` decoder: byte-level BPE makes every
//! id stand for a fixed byte string, so a table of those bytes gives both the full decode and an
//! exact streaming decode (the concatenation of streamed pieces always equals the full decode,
//! invalid UTF-8 included).

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use tokenizers::{
    DecoderWrapper, Model, NormalizedString, Normalizer, OffsetReferential, OffsetType,
    PreTokenizedString, PreTokenizer,
};

/// Why a tokenizer could not be built or could not encode.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot parse tokenizer.json: {0}")]
    Parse(#[source] tokenizers::Error),
    #[error("unsupported tokenizer.json: {0}")]
    Unsupported(String),
    #[error("encoding failed: {0}")]
    Encode(#[source] tokenizers::Error),
}

/// A loaded tokenizer. Cloning is cheap (shared, immutable state); it is `Send + Sync`.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    pieces: Arc<TokenPieces>,
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`. Only byte-level BPE vocabularies (the Qwen family's
    /// kind) are accepted, because decoding relies on each id being a fixed byte string.
    pub fn from_bytes(json: &[u8]) -> Result<Tokenizer, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_bytes(json).map_err(TokenizerError::Parse)?;
        if !matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return Err(TokenizerError::Unsupported(
                "the decoder must be ByteLevel (byte-level BPE)".to_string(),
            ));
        }
        let pieces = TokenPieces::build(&inner);
        Ok(Tokenizer {
            inner: Arc::new(inner),
            pieces: Arc::new(pieces),
        })
    }

    /// Token ids of `text`. With `allow_special`, special-token text such as `<|im_start|>` becomes
    /// its single id (what a rendered chat prompt needs); without it, such text is encoded as
    /// ordinary characters (what untrusted user content needs). No BOS is added (model-spec.md §5.1).
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let text = self.normalize(text)?;
        if allow_special {
            let encoding = self
                .inner
                .encode_fast(text.as_ref(), false)
                .map_err(TokenizerError::Encode)?;
            return Ok(encoding.get_ids().to_vec());
        }
        // The same pipeline without the added-vocabulary pass, so special-token text stays text.
        let mut pre = PreTokenizedString::from(text.as_ref());
        if let Some(pre_tokenizer) = self.inner.get_pre_tokenizer() {
            pre_tokenizer
                .pre_tokenize(&mut pre)
                .map_err(TokenizerError::Encode)?;
        }
        let model = self.inner.get_model();
        pre.tokenize(|piece| model.tokenize(piece.get()))
            .map_err(TokenizerError::Encode)?;
        let ids = pre
            .get_splits(OffsetReferential::Normalized, OffsetType::None)
            .into_iter()
            .flat_map(|(_, _, tokens)| tokens.iter().flatten().map(|token| token.id))
            .collect();
        Ok(ids)
    }

    /// Text of `ids`. Invalid UTF-8 becomes U+FFFD; ids outside the vocabulary are ignored; with
    /// `skip_special`, special tokens are left out.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.pieces.bytes(id, skip_special));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Id of a token given as written in tokenizer.json: special tokens as themselves
    /// (`"<|im_end|>"` -> 248046), ordinary tokens in the byte-level alphabet (`"Ġthe"` for " the").
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of ids the tokenizer can produce, added tokens included (248077 for Qwen3.5/3.6;
    /// the embedding has padding rows beyond that, model-spec.md §5.1).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Whether `id` is one of the special added tokens.
    pub fn is_special(&self, id: u32) -> bool {
        self.pieces.is_special(id)
    }

    /// The reference normalises the whole text before it looks for special tokens; the
    /// `tokenizers` pipeline would only normalise the pieces between them, which differs when a
    /// combining mark follows a special token's closing `>` (`>` + U+0338 composes to `≯`).
    fn normalize<'t>(&self, text: &'t str) -> Result<Cow<'t, str>, TokenizerError> {
        let Some(normalizer) = self.inner.get_normalizer() else {
            return Ok(Cow::Borrowed(text));
        };
        if text.is_ascii() {
            // Unicode normal forms leave ASCII unchanged.
            return Ok(Cow::Borrowed(text));
        }
        let mut normalized = NormalizedString::from(text);
        normalizer
            .normalize(&mut normalized)
            .map_err(TokenizerError::Encode)?;
        Ok(Cow::Owned(normalized.get().to_owned()))
    }
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

/// The byte string of every id, stored back to back.
struct TokenPieces {
    bytes: Vec<u8>,
    /// `ends[id]` is where the bytes of `id` end; they start at `ends[id - 1]` (0 for id 0).
    ends: Vec<usize>,
    special: Vec<bool>,
}

impl TokenPieces {
    fn build(inner: &tokenizers::Tokenizer) -> TokenPieces {
        let count = inner
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        let alphabet = ByteAlphabet::new();
        let mut bytes = Vec::new();
        let mut ends = Vec::with_capacity(count);
        let mut special = vec![false; count];
        for id in 0..count {
            if let Some(token) = inner.id_to_token(id as u32) {
                alphabet.append_bytes(&token, &mut bytes);
            }
            ends.push(bytes.len());
        }
        for (id, added) in inner.get_added_tokens_decoder() {
            if let Some(flag) = special.get_mut(id as usize) {
                *flag = added.special;
            }
        }
        TokenPieces {
            bytes,
            ends,
            special,
        }
    }

    fn bytes(&self, id: u32, skip_special: bool) -> &[u8] {
        let id = id as usize;
        if id >= self.ends.len() || (skip_special && self.special[id]) {
            return &[];
        }
        let start = if id == 0 { 0 } else { self.ends[id - 1] };
        &self.bytes[start..self.ends[id]]
    }

    fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }
}

/// The printable-character alphabet of byte-level BPE vocabularies: bytes that are printable
/// Latin-1 characters stand for themselves, the other 68 bytes, in byte order, for U+0100.. .
struct ByteAlphabet {
    /// Indexed by code point (below U+0144); the byte the character stands for.
    byte_of: Vec<Option<u8>>,
}

impl ByteAlphabet {
    fn new() -> ByteAlphabet {
        let mut byte_of = vec![None; 0x100 + 68];
        let mut shifted = 0;
        for b in 0..=255u8 {
            let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
            if printable {
                byte_of[b as usize] = Some(b);
            } else {
                byte_of[0x100 + shifted] = Some(b);
                shifted += 1;
            }
        }
        ByteAlphabet { byte_of }
    }

    /// Appends the bytes `token` stands for. A token with a character outside the alphabet (an
    /// added token such as `<think>` may contain anything) stands for its own UTF-8 bytes, which
    /// is also how the `tokenizers` ByteLevel decoder treats it.
    fn append_bytes(&self, token: &str, out: &mut Vec<u8>) {
        let start = out.len();
        for c in token.chars() {
            match self.byte_of.get(c as usize).copied().flatten() {
                Some(b) => out.push(b),
                None => {
                    out.truncate(start);
                    out.extend_from_slice(token.as_bytes());
                    return;
                }
            }
        }
    }
}

/// Streaming decode of one sequence: feed ids as they are generated, get text as soon as it is
/// final. Text is emitted only up to the last complete UTF-8 character, so a character whose bytes
/// are spread over several tokens (most emoji, many CJK characters) is never emitted broken or as
/// U+FFFD; emitted text is never revised. The concatenation of everything `push` and `finish`
/// return equals `Tokenizer::decode` of all pushed ids.
pub struct Detokenizer {
    pieces: Arc<TokenPieces>,
    skip_special: bool,
    /// Bytes received but not emitted: at most an incomplete character (3 bytes) between calls.
    pending: Vec<u8>,
}

impl Detokenizer {
    /// A detokenizer for a new sequence; `skip_special` as in [`Tokenizer::decode`].
    pub fn new(tokenizer: &Tokenizer, skip_special: bool) -> Detokenizer {
        Detokenizer {
            pieces: Arc::clone(&tokenizer.pieces),
            skip_special,
            pending: Vec::new(),
        }
    }

    /// Adds one generated id and returns the text that became final (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        self.pending
            .extend_from_slice(self.pieces.bytes(id, self.skip_special));
        let ready = final_prefix_len(&self.pending);
        if ready == 0 {
            return String::new();
        }
        let text = String::from_utf8_lossy(&self.pending[..ready]).into_owned();
        self.pending.drain(..ready);
        text
    }

    /// Ends the sequence: returns whatever is still held back (an incomplete character becomes
    /// U+FFFD, as in a full decode) and leaves the detokenizer empty.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

/// Length of the longest prefix of `bytes` whose lossy UTF-8 decoding cannot change when more
/// bytes follow: everything except a trailing sequence that is a valid but unfinished character.
/// Invalid bytes before it are final, since a lossy decoder's choice there does not depend on
/// what comes later.
fn final_prefix_len(bytes: &[u8]) -> usize {
    let mut start = 0;
    loop {
        match std::str::from_utf8(&bytes[start..]) {
            Ok(_) => return bytes.len(),
            Err(err) => match err.error_len() {
                // The input ends inside a character that may still be completed.
                None => return start + err.valid_up_to(),
                Some(invalid) => start += err.valid_up_to() + invalid,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::sync::OnceLock;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures");

    /// The Qwen3.6 tokenizer built by scripts/make_qwen_tokenizer.py, loaded once per test run.
    fn qwen() -> &'static Tokenizer {
        static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
        TOKENIZER.get_or_init(|| {
            let gz = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../../python/ninfer/models/qwen3_6_tokenizer.json.gz")).unwrap();
            let mut json = Vec::new();
            flate2::read::GzDecoder::new(&gz[..])
                .read_to_end(&mut json)
                .unwrap();
            Tokenizer::from_bytes(&json).unwrap()
        })
    }

    #[derive(serde::Deserialize)]
    struct Case {
        text: String,
        ids: Vec<u32>,
        ids_plain: Vec<u32>,
        decoded: String,
    }

    #[derive(serde::Deserialize)]
    struct Expected {
        cases: Vec<Case>,
    }

    fn expected_cases() -> Vec<Case> {
        let corpus: Vec<String> = serde_json::from_str(
            &std::fs::read_to_string(format!("{FIXTURES}/tokenizer_corpus.json")).unwrap(),
        )
        .unwrap();
        let expected: Expected = serde_json::from_str(
            &std::fs::read_to_string(format!("{FIXTURES}/tokenizer_expected_ids.json")).unwrap(),
        )
        .unwrap();
        let texts: Vec<&String> = expected.cases.iter().map(|c| &c.text).collect();
        assert_eq!(
            texts,
            corpus.iter().collect::<Vec<_>>(),
            "expected ids are stale: rerun the script"
        );
        assert!(expected.cases.len() >= 200);
        expected.cases
    }

    fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
        let mut detok = Detokenizer::new(tok, skip_special);
        let mut chunks: Vec<String> = ids.iter().map(|&id| detok.push(id)).collect();
        chunks.push(detok.finish());
        chunks
    }

    /// Deterministic xorshift generator, enough to pick ids.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    #[test]
    fn tokenizer_matches_reference_ids_on_corpus() {
        let tok = qwen();
        let mut failures = Vec::new();
        for case in expected_cases() {
            let ids = tok.encode(&case.text, true).unwrap();
            let plain = tok.encode(&case.text, false).unwrap();
            if ids != case.ids || plain != case.ids_plain {
                failures.push(format!(
                    "{:?}: {ids:?} / {plain:?}, want {:?} / {:?}",
                    case.text, case.ids, case.ids_plain
                ));
            }
            assert_eq!(tok.decode(&case.ids, false), case.decoded);
            assert_eq!(tok.decode(&case.ids_plain, false), case.decoded);
        }
        assert!(
            failures.is_empty(),
            "{} mismatches:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }

    #[test]
    fn tokenizer_round_trips_nfc_text() {
        let tok = qwen();
        for text in [
            "",
            "Hello, world!",
            "def f(x):\n\treturn x  \n\n",
            "你好，世界 😀👨‍👩‍👧‍👦",
            "مرحبا بالعالم 123",
            "<|im_start|>user\nhi<|im_end|>",
            "   \r\n\r\n   x",
        ] {
            assert_eq!(tok.decode(&tok.encode(text, true).unwrap(), false), text);
            assert_eq!(tok.decode(&tok.encode(text, false).unwrap(), false), text);
        }
        // Non-NFC input comes back composed, as in the reference.
        assert_eq!(
            tok.decode(&tok.encode("Cafe\u{301}", true).unwrap(), false),
            "Caf\u{e9}"
        );
        assert_eq!(
            tok.encode("Cafe\u{301}", true).unwrap(),
            tok.encode("Caf\u{e9}", true).unwrap()
        );
    }

    #[test]
    fn tokenizer_special_tokens() {
        let tok = qwen();
        assert_eq!(tok.vocab_size(), 248077);
        // model-spec.md §5.1, in id order from 248044.
        let names = [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
            "<|audio_start|>",
            "<|audio_end|>",
            "<tts_pad>",
            "<tts_text_bos>",
            "<tts_text_eod>",
            "<tts_text_bos_single>",
            "<|audio_pad|>",
        ];
        for (offset, name) in names.iter().enumerate() {
            let id = 248044 + offset as u32;
            assert_eq!(tok.token_id(name), Some(id), "{name}");
            assert!(tok.is_special(id));
            assert_eq!(tok.encode(name, true).unwrap(), vec![id]);
            assert!(tok.encode(name, false).unwrap().iter().all(|&t| t < 248044));
            assert_eq!(tok.decode(&[id], false), *name);
            assert_eq!(tok.decode(&[id], true), "");
        }
        assert!(!tok.is_special(0) && !tok.is_special(248043) && !tok.is_special(248077));
        assert_eq!(tok.token_id("<|not_a_token|>"), None);

        let prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n";
        let ids = tok.encode(prompt, true).unwrap();
        assert_eq!(ids[0], 248045);
        assert_eq!(ids.iter().filter(|&&id| id >= 248044).count(), 4);
        assert_eq!(tok.decode(&ids, false), prompt);
        assert_eq!(tok.decode(&ids, true), "user\nHi\nassistant\n\n");
        // Ids past the tokenizer (the embedding's padding rows) decode to nothing.
        assert_eq!(
            tok.decode(&[248100, 9419], false),
            tok.decode(&[9419], false)
        );
    }

    #[test]
    fn tokenizer_rejects_bad_json() {
        assert!(matches!(
            Tokenizer::from_bytes(b"not json"),
            Err(TokenizerError::Parse(_))
        ));
    }

    #[test]
    fn tokenizer_detokenizer_streams_corpus_like_full_decode() {
        let tok = qwen();
        for case in expected_cases() {
            for skip_special in [false, true] {
                let chunks = stream(tok, &case.ids, skip_special);
                assert_eq!(
                    chunks.concat(),
                    tok.decode(&case.ids, skip_special),
                    "{:?}",
                    case.text
                );
                if !case.text.contains('\u{fffd}') {
                    assert!(
                        chunks.iter().all(|c| !c.contains('\u{fffd}')),
                        "{:?}",
                        case.text
                    );
                }
            }
        }
    }

    #[test]
    fn tokenizer_detokenizer_holds_back_split_characters() {
        let tok = qwen();
        let text = "a👩🏿‍❤️‍💋‍👨🏻 🫠 𠀀中文";
        let ids = tok.encode(text, false).unwrap();
        let chunks = stream(tok, &ids, false);
        assert_eq!(chunks.concat(), text);
        assert!(chunks.iter().all(|c| !c.contains('\u{fffd}')));
        // Some character is spread over several ids, so some pushes must have held text back.
        assert!(chunks[..ids.len()].iter().any(String::is_empty), "{ids:?}");
        for &id in &ids {
            if std::str::from_utf8(tok.pieces.bytes(id, false)).is_err() {
                // Decoded on its own, a partial character is U+FFFD; streamed, it never is.
                assert!(tok.decode(&[id], false).contains('\u{fffd}'));
            }
        }
        // Each emitted piece ends exactly at a character boundary of the text.
        let mut at = 0;
        for chunk in &chunks {
            at += chunk.len();
            assert!(text.is_char_boundary(at));
        }
    }

    #[test]
    fn tokenizer_detokenizer_matches_decode_on_random_ids() {
        // Byte tokens (ids 0..256) and random ids produce invalid and unfinished UTF-8 too;
        // the stream must still equal the full decode, which must equal the `tokenizers` one.
        let tok = qwen();
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..500 {
            let len = 1 + rng.below(24) as usize;
            let ids: Vec<u32> = (0..len)
                .map(|_| match rng.below(4) {
                    0 => rng.below(256) as u32,
                    1 => 248044 + rng.below(40) as u32,
                    _ => rng.below(248044) as u32,
                })
                .collect();
            for skip_special in [false, true] {
                let full = tok.decode(&ids, skip_special);
                assert_eq!(
                    full,
                    tok.inner.decode(&ids, skip_special).unwrap(),
                    "{ids:?}"
                );
                assert_eq!(stream(tok, &ids, skip_special).concat(), full, "{ids:?}");
            }
        }
    }

    #[test]
    fn tokenizer_final_prefix_len_keeps_only_unfinished_tails() {
        assert_eq!(final_prefix_len(b"abc"), 3);
        assert_eq!(final_prefix_len(&[b'a', 0xE4, 0xB8]), 1); // first two bytes of U+4E2D
        assert_eq!(final_prefix_len(&[0xF0, 0x9F, 0x98]), 0); // three of four bytes of an emoji
        assert_eq!(final_prefix_len(&[b'a', 0x80]), 2); // a lone continuation byte is final
        assert_eq!(final_prefix_len(&[0xE0, 0x80]), 2); // never valid, whatever follows
        assert_eq!(final_prefix_len(&[0xFF, 0xC3]), 1);
        assert_eq!(final_prefix_len(&[0xE4, 0xB8, 0xAD, 0x80, 0xC3]), 4);
    }
}
