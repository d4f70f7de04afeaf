//! Shared helpers for the engine's end-to-end tests against the real default model.

use pk_engine::{Engine, EngineConfig};

/// The default model; tests fail (rather than skip) when it is missing, because CI
/// fetches it before running them.
pub fn model_path() -> std::path::PathBuf {
    let p = pk_engine::model_store::default_model_path();
    assert!(
        p.exists(),
        "{} is missing: run `pagekeeper fetch-model` first",
        p.display()
    );
    p
}

#[allow(dead_code)]
pub fn engine(config: EngineConfig) -> Engine {
    Engine::load(&model_path(), config).expect("engine loads")
}

#[allow(dead_code)]
pub fn golden() -> serde_json::Value {
    serde_json::from_str(include_str!(
        "../../../../tests/fixtures/smollm2-greedy.json"
    ))
    .unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[allow(dead_code)]
pub fn book_ids() -> Vec<u32> {
    let v: serde_json::Value = serde_json::from_str(include_str!(
        "../../../../tests/fixtures/eighty-days-token-ids.json"
    ))
    .unwrap();
    ids(&v["token_ids"])
}
