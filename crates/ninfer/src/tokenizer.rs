//! Tokenizer (being written).
