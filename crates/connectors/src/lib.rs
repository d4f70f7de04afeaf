//! `pk-connectors`: the stores the engine reuses prompt KV through, each a
//! [`pk_engine::KvConnector`] built here and handed to the engine
//! ([`attach`], `GenerateParams::prefix_kv`), so that `pk-engine` knows none of them:
//!
//! - [`tiering`]: chunks of prompt KV in tiers below the pool (RAM → disk → Redis), keyed by
//!   chained chunk hashes, written by a worker thread;
//! - [`contexts`]: whole contexts in an EVICPRESS store, compressed and placed by utility,
//!   with its [`profiler`] and [`kvzip_scoring`] (clients of the engine's public API that
//!   submit background requests) and the start-up [`calibrate`] of its delay model;
//! - [`prefix_kv`]: a request's given, possibly compressed, prefix KV.

pub mod calibrate;
pub mod contexts;
pub mod kvzip_scoring;
pub mod prefix_kv;
pub mod profiler;
pub mod tiering;

use std::sync::Arc;

use anyhow::Result;
use pk_engine::Engine;

pub use calibrate::{calibrate_context_store, DelayCalibration};
pub use contexts::{ContextReuse, ContextReuseConfig, ContextReuseStats};
pub use prefix_kv::PrefixKv;
pub use tiering::{Tiering, TieringConfig, TieringStats, DEFAULT_WINDOW_CHECKPOINT_TOKENS};

/// The model's name in the connectors' chunk keys: none beyond the cache namespace, which
/// holds the weights' content hash. The engine's `model_name` is the name it serves under
/// (`--served-model-name`), which replicas of the same weights need not share; keyed by it,
/// they never hit each other's chunks.
pub const KEY_MODEL_ID: &str = "";

/// Whether KV read out of a pool of `kv`'s dtype, stored by a connector in f16 (codec
/// `none`) and written back, is what prefill computed: only for an f16 pool. An f32 pool
/// loses bits in f16, and a q8 or q4 pool re-quantizes the f16 copy of its dequantized
/// values, which can round a group's scale or a value differently. Loads into other pools
/// are reported inexact, so that their sequences feed neither the prefix cache nor the
/// store.
pub(crate) fn reload_is_exact(kv: &dyn pk_model::KvBlocks) -> bool {
    kv.dtype() == pk_model::KvDtype::F16
}

/// Which connector an engine reuses prompt KV through.
#[derive(Clone, Debug)]
pub enum ReuseConfig {
    /// Chunks of prompt KV in tiers below the pool (`--tier-*`).
    Chunks(TieringConfig),
    /// Whole contexts in an EVICPRESS store (`--tier-policy evicpress`).
    Contexts(ContextReuseConfig),
}

/// A connector attached to an engine, as the caller that built it keeps it: for its
/// statistics, its store and, for the EVICPRESS store, profiling.
#[derive(Clone, Debug)]
pub enum Attached {
    Chunks(Arc<Tiering>),
    Contexts(Arc<ContextReuse>),
}

impl Attached {
    pub fn tiering(&self) -> Option<&Arc<Tiering>> {
        match self {
            Attached::Chunks(t) => Some(t),
            Attached::Contexts(_) => None,
        }
    }

    pub fn contexts(&self) -> Option<&Arc<ContextReuse>> {
        match self {
            Attached::Contexts(c) => Some(c),
            Attached::Chunks(_) => None,
        }
    }
}

/// Builds the connector `cfg` describes, keyed by `engine`'s cache namespace, and attaches
/// it (the engine must have nothing in flight). Both stores keep an engine's KV cache
/// groups, keyed by a namespace that names them.
pub fn attach(engine: &mut Engine, cfg: &ReuseConfig) -> Result<Attached> {
    let namespace = engine.cache_namespace().clone();
    let block_tokens = engine.config.block_size_tokens as usize;
    let attached = match cfg {
        ReuseConfig::Chunks(t) => {
            let bytes_per_token = engine.kv_bytes_per_token();
            let groups = engine.kv_group_layout();
            let tiering = Tiering::new(
                t,
                &namespace,
                block_tokens,
                bytes_per_token,
                groups.as_ref(),
            )?;
            Attached::Chunks(Arc::new(tiering))
        }
        ReuseConfig::Contexts(c) => {
            let groups = engine.kv_group_layout();
            let contexts = ContextReuse::new(c, &namespace, block_tokens, groups.as_ref())?;
            Attached::Contexts(Arc::new(contexts))
        }
    };
    let connector: Arc<dyn pk_engine::KvConnector> = match &attached {
        Attached::Chunks(t) => t.clone(),
        Attached::Contexts(c) => c.clone(),
    };
    engine.set_connector(connector)?;
    Ok(attached)
}
