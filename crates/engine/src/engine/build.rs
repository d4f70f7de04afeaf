//! Building an engine: a model file or a backend, the settings checked against the pool the
//! backend holds, and KV cache groups where the model and settings allow.

use std::path::Path;

use anyhow::{bail, Context, Result};
use pk_kv::KvCacheManager;
use pk_model::{Backend, CpuBackend, KvDtype, KvGeometry, Llama, ModelConfig};
use pk_tokenizer::{ChatTemplate, Tokenizer};

use super::{model_content_id, Engine};
use crate::namespace::CacheNamespace;
use crate::params::{EngineConfig, EngineStats};
use crate::scheduler::{Limits, Scheduler};

impl Engine {
    /// Loads a model file onto the CPU backend.
    pub fn load(model_path: &Path, config: EngineConfig) -> Result<Engine> {
        Engine::load_with(model_path, config, |gguf, geometry, dtype| {
            let model = Llama::from_gguf(gguf).context("building the model")?;
            Ok(Box::new(CpuBackend::new(model, geometry, dtype)))
        })
    }

    /// Loads a model file's tokenizer and chat template, and its weights through `build`,
    /// which makes a backend whose pool has the given geometry and dtype (the engine's
    /// settings applied to the file's model).
    pub fn load_with(
        model_path: &Path,
        config: EngineConfig,
        build: impl FnOnce(&pk_gguf::GgufFile, KvGeometry, KvDtype) -> Result<Box<dyn Backend>>,
    ) -> Result<Engine> {
        let gguf = pk_gguf::GgufFile::open(model_path)
            .with_context(|| format!("loading {}", model_path.display()))?;
        let geometry = config.kv_geometry(
            &ModelConfig::from_gguf(&gguf).context("reading the model's configuration")?,
        )?;
        let backend = build(&gguf, geometry, config.kv_dtype)?;
        let tokenizer = Tokenizer::from_gguf(&gguf).context("building the tokenizer")?;
        let chat_template = ChatTemplate::from_gguf(&gguf).context("reading the chat template")?;
        let name = model_path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let identity = model_content_id(model_path)?;
        Engine::with_backend_identified(backend, tokenizer, chat_template, config, &name, &identity)
    }

    /// An engine running `model` on the CPU.
    pub fn new(
        model: Llama,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        config: EngineConfig,
        model_name: &str,
    ) -> Result<Engine> {
        let geometry = config.kv_geometry(&model.config)?;
        let backend = Box::new(CpuBackend::new(model, geometry, config.kv_dtype));
        Engine::with_backend(backend, tokenizer, chat_template, config, model_name)
    }

    /// An engine over any backend, whose pool must have `config.kv_geometry(backend.config())`
    /// and `config.kv_dtype`.
    pub fn with_backend(
        backend: Box<dyn Backend>,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        config: EngineConfig,
        model_name: &str,
    ) -> Result<Engine> {
        Engine::with_backend_identified(
            backend,
            tokenizer,
            chat_template,
            config,
            model_name,
            model_name,
        )
    }

    /// [`Engine::with_backend`], with `model_identity` naming the weights in every cache
    /// key (the prefix cache's and the reuse connector's): [`model_content_id`] for a model
    /// file, so that two different files of the same name sharing a store never read each
    /// other's KV.
    pub fn with_backend_identified(
        backend: Box<dyn Backend>,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        config: EngineConfig,
        model_name: &str,
        model_identity: &str,
    ) -> Result<Engine> {
        let geometry = Engine::check_pool(&*backend, &config)?;
        let bs = geometry.block_size_tokens;
        let (backend, window) = Engine::kv_cache_groups(backend, &config)?;
        let num_blocks = backend.kv().geometry().num_blocks;
        let kv = KvCacheManager::with_windows(num_blocks as u32, bs as u32, window);
        let limits = Limits::new(&config, backend.config().vocab_size);
        let mut cache_namespace =
            CacheNamespace::new(model_identity, config.kv_dtype, backend.name());
        if window.is_some() {
            if let Some(layout) = backend.config().kv_group_layout() {
                cache_namespace = cache_namespace.with_kv_groups(&layout);
            }
        }
        Ok(Engine {
            eviction_stats: Default::default(),
            tokenizer,
            chat_template,
            config,
            model_name: model_name.to_string(),
            stats: EngineStats::default(),
            sched: Scheduler::new(kv, limits),
            backend,
            cache_namespace,
            connector: None,
            grammar: None,
            kvzip_scores: Default::default(),
        })
    }

    /// Checks the settings and that `backend`'s pool has the geometry and dtype they give;
    /// returns that geometry.
    fn check_pool(backend: &dyn Backend, config: &EngineConfig) -> Result<KvGeometry> {
        let geometry = config.kv_geometry(backend.config())?;
        if config.max_batch_tokens == 0 || config.max_running_seqs == 0 {
            bail!("max_batch_tokens and max_running_seqs must be at least 1");
        }
        let interval = config.prefill_prune_interval_tokens;
        if interval != 0 && interval < config.block_size_tokens as usize {
            bail!(
                "prefill_prune_interval_tokens ({interval}) must be 0 (off) or at least the block size ({} tokens)",
                config.block_size_tokens
            );
        }
        let pool = backend.kv().geometry();
        let shape = |g: &KvGeometry| {
            (
                g.n_layers,
                g.n_kv_heads,
                g.head_dim,
                g.block_size_tokens,
                g.num_blocks,
            )
        };
        if shape(&pool) != shape(&geometry) || backend.kv().dtype() != config.kv_dtype {
            bail!("the {} backend's KV pool ({pool:?}, {}) is not the configured one ({geometry:?}, {})", backend.name(), backend.kv().dtype(), config.kv_dtype);
        }
        let (num_blocks, bs) = (geometry.num_blocks, geometry.block_size_tokens);
        tracing::info!(
            "KV cache ({}): {num_blocks} blocks x {bs} tokens = {} tokens, {:.1} MiB ({:?})",
            backend.name(),
            num_blocks * bs,
            backend.kv().capacity_bytes() as f64 / (1 << 20) as f64,
            config.kv_dtype
        );
        Ok(geometry)
    }

    /// Sets up KV cache groups when the model and settings allow (see
    /// `EngineConfig::hybrid_kv_cache`): the pool is rebuilt with blocks of the group size,
    /// as many as keep its bytes, and the manager gets the window groups.
    fn kv_cache_groups(
        mut backend: Box<dyn Backend>,
        config: &EngineConfig,
    ) -> Result<(Box<dyn Backend>, Option<pk_kv::WindowSpec>)> {
        let wanted = config.hybrid_kv_cache;
        let Some(layout) = backend.config().kv_group_layout().filter(|_| wanted) else {
            return Ok((backend, None));
        };
        let g = backend.kv().geometry();
        let num_blocks = g.num_blocks * g.n_layers / layout.layers_per_block;
        if let Err(e) = backend.use_kv_groups(&layout, num_blocks) {
            tracing::info!("one KV cache group: {e}");
            return Ok((backend, None));
        }
        tracing::info!(
            "KV cache groups: {} full-attention layers and {} window groups of up to {} layers ({} tokens), {num_blocks} blocks of {} layers",
            layout.layers_per_block,
            layout.num_window_groups,
            layout.layers_per_block,
            layout.window_tokens,
            layout.layers_per_block
        );
        let window = pk_kv::WindowSpec {
            num_groups: layout.num_window_groups as u32,
            window_tokens: layout.window_tokens as u32,
        };
        Ok((backend, Some(window)))
    }
}
