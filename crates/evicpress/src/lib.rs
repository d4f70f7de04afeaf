//! EVICPRESS (spec `evicpress.md`): for every stored context, one configuration
//! (tier, compression method, ratio) chosen by the utility `(α · quality − ttft) · frequency`,
//! by a greedy multi-choice knapsack over the tiers, fastest first.
//!
//! - [`config`]: the grid of compressions (none, 8/4/2-bit quantization, token dropping by
//!   PagedEviction / KNorm / KeyDiff / StreamingLLM scores at a ratio).
//! - [`model`]: quality curves and the prior for unprofiled contexts, the delay model,
//!   the decayed access frequency, the utility.
//! - [`placement`]: the greedy (both rankings) and the LRU / fixed-ratio baselines.
//! - [`store`]: `ContextStore`, the contexts on real `pk-tiers` tiers, with a worker
//!   thread so that storing and moving never block the engine.
//! - `meta`: each context's profile and frequency, persisted beside its master so that a
//!   restart or another server adopts what was learnt.
//!
//! Profiling needs the model, so it lives with the engine (`pk-engine`'s `evicpress`
//! module); this crate keeps its results and asks for re-profiles when served quality
//! drifts.
#![forbid(unsafe_code)]

pub mod config;
mod meta;
pub mod model;
pub mod placement;
pub mod scores;
pub mod store;

pub use config::{Compression, DropScore, Grid, GridError};
pub use model::{DecayedCount, DelayModel, QualityCurve, QualityPrior, QualitySource, TierSpec};
pub use placement::{Item, Placer, Policy, Ranking};
pub use scores::{snapkv_scores, WindowQueries};
pub use store::{
    copy_key, BytesByGroup, ContextReport, ContextStore, Copies, DelayProvenance, DelayReport,
    LoadReport, OptionReport, Provenance, StoreConfig, StoreError, StoreStats, TierCalibration,
    MIN_PREFILL_SAMPLE_TOKENS,
};
