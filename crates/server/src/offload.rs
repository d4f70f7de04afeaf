//! A request's CPU-heavy preparation, run off the async workers and off the engine thread.
//!
//! The server has two async workers; a 4 MiB prompt rendered through a chat template and
//! tokenized, or a grammar compiled (the first one also builds a trie over the whole
//! vocabulary), would hold one of them for tens to hundreds of milliseconds, and on the
//! engine thread would stall every running stream for as long. Both kinds of work run on
//! tokio's blocking pool instead, each behind a semaphore of its own, so that a burst of
//! them takes at most a bounded number of cores while the others wait without a thread.

use std::sync::Arc;

use pk_engine::{Grammar, GrammarCompiler};
use pk_tokenizer::Tokenizer;
use tokio::sync::{OnceCell, Semaphore};

/// At most this many prompts are rendered and tokenized at once: more than the cores of
/// a serving machine only slows each of them and the engine thread down, and the rest wait
/// their turn in arrival order.
const MAX_CONCURRENT_PROMPT_PREPARATIONS: usize = 8;

/// At most this many grammars compile at once (a compilation holds a core for
/// milliseconds to seconds, the trie's build included), for the same reason.
const MAX_CONCURRENT_GRAMMAR_COMPILATIONS: usize = 8;

/// The blocking work of requests and the limits on it; one per server.
pub struct Offload {
    prompts: Arc<Semaphore>,
    grammars: Arc<Semaphore>,
    tokenizer: Arc<Tokenizer>,
    /// Built on the blocking pool at start-up (`prepare_grammars`), or by the first
    /// grammar if that failed, and shared by every compilation.
    compiler: OnceCell<Arc<GrammarCompiler>>,
}

/// Why offloaded work gave no result.
#[derive(Debug)]
pub enum OffloadError {
    /// The work panicked (a bug): the request gets a 500.
    Panicked(String),
    /// The grammar cannot be compiled (the message names the field): a 400.
    Grammar(&'static str, String),
    /// The grammar compiler could not be built (its token trie): a 500.
    NoGrammarEngine(String),
}

impl Offload {
    /// Limits at most the core count (`available_parallelism`), and at most the constants.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Offload {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Offload {
            prompts: Arc::new(Semaphore::new(
                cores.min(MAX_CONCURRENT_PROMPT_PREPARATIONS),
            )),
            grammars: Arc::new(Semaphore::new(
                cores.min(MAX_CONCURRENT_GRAMMAR_COMPILATIONS),
            )),
            tokenizer,
            compiler: OnceCell::new(),
        }
    }

    /// Runs `work` (rendering and tokenizing a prompt) on the blocking pool.
    pub async fn prompt<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, OffloadError> {
        run_limited(&self.prompts, work).await
    }

    /// `grammar` compiled on the blocking pool, with its matcher set.
    pub async fn compile(&self, mut grammar: Grammar) -> Result<Grammar, OffloadError> {
        let compiler = self.compiler().await?;
        let g = grammar.clone();
        let compiled = run_limited(&self.grammars, move || compiler.compile(&g)).await?;
        let param = grammar.param;
        grammar.compiled = Some(compiled.map_err(|e| OffloadError::Grammar(param, e.to_string()))?);
        Ok(grammar)
    }

    /// Builds the shared compiler now, so that the first request with a grammar neither
    /// waits for the token trie (0.2 s for a 49K vocabulary here) nor takes a core from
    /// the running streams to build it. The server calls it while the model loads; a
    /// failure is logged, and the first request that needs the compiler tries again.
    pub async fn prepare_grammars(&self) {
        if let Err(e) = self.compiler().await {
            tracing::warn!("the grammar engine is not ready: {e:?}");
        }
    }

    /// The shared compiler, built by the first caller (the others wait for it).
    async fn compiler(&self) -> Result<Arc<GrammarCompiler>, OffloadError> {
        let build = || async {
            let tokenizer = self.tokenizer.clone();
            let t0 = std::time::Instant::now();
            let built =
                run_limited(&self.grammars, move || GrammarCompiler::new(tokenizer)).await?;
            let compiler = built.map_err(|e| OffloadError::NoGrammarEngine(e.to_string()))?;
            tracing::info!(
                "grammar engine ready in {:.2} s",
                t0.elapsed().as_secs_f64()
            );
            Ok(Arc::new(compiler))
        };
        self.compiler.get_or_try_init(build).await.cloned()
    }
}

/// Runs `work` on the blocking pool once `limit` gives a permit. The permit moves into the
/// work, so a caller that goes away (a client disconnecting) cannot free it while the work
/// still runs.
async fn run_limited<T: Send + 'static>(
    limit: &Arc<Semaphore>,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, OffloadError> {
    let permit = limit
        .clone()
        .acquire_owned()
        .await
        .expect("the semaphore is never closed");
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        work()
    })
    .await
    .map_err(|e| OffloadError::Panicked(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// However many requests bring work at once, no more than the limit's permits of it
    /// run together; the rest wait and all of it finishes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_more_work_runs_at_once_than_the_limit_allows() {
        const PERMITS: usize = 2;
        let limit = Arc::new(Semaphore::new(PERMITS));
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..12)
            .map(|_| {
                let (limit, running, most) = (limit.clone(), running.clone(), most.clone());
                tokio::spawn(async move {
                    run_limited(&limit, move || {
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_millis(10));
                        running.fetch_sub(1, Ordering::SeqCst);
                    })
                    .await
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("joined").expect("the work ran");
        }
        assert!(most.load(Ordering::SeqCst) <= PERMITS);
        assert_eq!(limit.available_permits(), PERMITS);
    }

    /// Work that panics is a 500 for its request, and gives its permit back.
    #[tokio::test]
    async fn a_panic_in_offloaded_work_is_an_error_and_frees_the_permit() {
        let limit = Arc::new(Semaphore::new(1));
        let r = run_limited(&limit, || panic!("injected")).await;
        assert!(matches!(r, Err(OffloadError::Panicked(_))));
        assert_eq!(limit.available_permits(), 1);
    }
}
