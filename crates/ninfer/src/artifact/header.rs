//! The header JSON of an artifact (docs/format.md §2), shared by the reader and the writer.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PartEntry {
    pub offset: u64,
    pub length: u64,
    pub shape: Vec<usize>,
    pub xxh3: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TensorEntry {
    pub encoding: String,
    pub shape: Vec<usize>,
    pub component: String,
    #[serde(default = "row_major")]
    pub layout: String,
    pub parts: BTreeMap<String, PartEntry>,
}

fn row_major() -> String {
    "row_major".into()
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ResourceEntry {
    pub offset: u64,
    pub length: u64,
    pub xxh3: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct Header {
    pub format: u32,
    pub arch: String,
    pub name: String,
    pub components: BTreeMap<String, Value>,
    pub tensors: BTreeMap<String, TensorEntry>,
    #[serde(default)]
    pub resources: BTreeMap<String, ResourceEntry>,
    #[serde(default)]
    pub provenance: Value,
}
