//! EVICPRESS profiling (spec "Profiling"): how well each configuration of the grid
//! answers a stored context's queries, measured on the engine itself.
//!
//! Quality metric (the spec's **decision**, configurable by [`QualityMetric`]):
//! - `f1` (default): token-level F1 between the greedy answer generated from the compressed
//!   KV and the greedy answer generated from the full KV, the same measure `pk-eval` uses
//!   for answer agreement, averaged over the profiling queries. One early near-tie flip
//!   changes the whole rest of a greedy answer, so this is strict and noisy.
//! - `teacher-forced`: the full KV's greedy answer is forced after the query on the
//!   compressed KV, and the score is the fraction of its tokens the compressed KV also
//!   ranks first. Every position is judged on the same prefix, so a flip costs one token,
//!   not the rest of the answer. It needs the full-KV answers first: a second phase,
//!   submitted by [`Profiling::poll`] once the first is done.
//!
//! All answers of one context (every configuration × every query, the full-KV ones
//! included) are submitted at once and run by the ordinary scheduler, so profiling is
//! batched with whatever else the engine is doing, and a server can start a profile when
//! it is idle and poll it between steps ([`Profiling::is_done`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Result};
use pk_engine::request::EventSink;
use pk_engine::{Engine, GenerateParams, Request, SeqEvent};
use pk_tiers::ChunkKey;

use crate::contexts::ContextReuse;
use crate::prefix_kv::PrefixKv;

pub use pk_engine::quality::{multiset_f1, token_f1};

/// How profiling scores a configuration's answers (see the module's documentation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QualityMetric {
    #[default]
    AnswerF1,
    TeacherForced,
}

/// A profile metric name that is neither `f1` nor `teacher-forced`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown profile metric {0:?} (f1 or teacher-forced)")]
pub struct UnknownMetric(pub String);

impl std::str::FromStr for QualityMetric {
    type Err = UnknownMetric;
    fn from_str(s: &str) -> Result<Self, UnknownMetric> {
        match s {
            "f1" => Ok(QualityMetric::AnswerF1),
            "teacher-forced" => Ok(QualityMetric::TeacherForced),
            _ => Err(UnknownMetric(s.to_owned())),
        }
    }
}

impl std::fmt::Display for QualityMetric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            QualityMetric::AnswerF1 => "f1",
            QualityMetric::TeacherForced => "teacher-forced",
        })
    }
}

/// Results per (configuration, query), written by the requests' sinks.
type PerConfigQuery<T> = Arc<Mutex<HashMap<(usize, usize), T>>>;

/// The teacher-forced phase's inputs: each compressed configuration's KV (`None`: one the
/// context cannot build) and the queries.
type SecondPhase = (Vec<Option<Arc<PrefixKv>>>, Vec<Vec<u32>>);

/// A profile in flight: answers arrive through the requests' sinks.
pub struct Profiling {
    pub key: ChunkKey,
    n_configs: usize,
    n_queries: usize,
    answers: PerConfigQuery<Vec<u32>>,
    /// Teacher-forced agreement per (configuration, query), filled by the second phase.
    agreement: PerConfigQuery<f64>,
    remaining: Arc<AtomicUsize>,
    /// With the teacher-forced metric, the second phase waiting for the full-KV answers:
    /// each compressed configuration's KV and the queries.
    /// (`None`: a configuration the context cannot build, scored 0.)
    second_phase: Option<SecondPhase>,
    metric: QualityMetric,
}

impl Profiling {
    /// Every submitted request has finished (the second phase may not be submitted yet:
    /// use [`Profiling::poll`] to drive a profile to its end).
    fn phase_done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    pub fn is_done(&self) -> bool {
        self.phase_done() && self.second_phase.is_none()
    }

    /// Advances the profile: submits the teacher-forced phase once the full-KV answers are
    /// in. Returns whether the profile is complete.
    pub fn poll(&mut self, e: &mut Engine) -> Result<bool> {
        if !self.phase_done() {
            return Ok(false);
        }
        let Some((prefixes, queries)) = self.second_phase.take() else {
            return Ok(true);
        };
        let refs: Vec<Vec<u32>> = (0..queries.len())
            .map(|q| self.answer(0, q).unwrap_or_default())
            .collect();
        for (c, prefix) in prefixes
            .into_iter()
            .enumerate()
            .filter_map(|(i, p)| Some((i + 1, p?)))
        {
            for (q, query) in queries.iter().enumerate() {
                if refs[q].is_empty() {
                    self.agreement.lock().unwrap().insert((c, q), 1.0);
                    continue;
                }
                self.submit_forced(e, (c, q), &prefix, query, refs[q].clone())?;
            }
        }
        Ok(false)
    }

    /// Submits configuration `c`'s teacher-forced run of query `q`: the full KV's answer
    /// `reference` forced after `prefix`, counting the steps whose most likely token is the
    /// reference's.
    fn submit_forced(
        &self,
        e: &mut Engine,
        (c, q): (usize, usize),
        prefix: &Arc<PrefixKv>,
        query: &[u32],
        reference: Vec<u32>,
    ) -> Result<()> {
        let mut prompt = vec![0u32; prefix.n_tokens()];
        prompt.extend_from_slice(query);
        let params = GenerateParams {
            max_tokens: reference.len(),
            forced_tokens: reference.clone(),
            ignore_eos: true,
            return_logits: true,
            prefix_kv: Some(prefix.clone()),
            background: true,
            ..Default::default()
        };
        let (agreement, remaining) = (self.agreement.clone(), self.remaining.clone());
        let (mut matched, mut seen) = (0usize, 0usize);
        let sink = once_finished(remaining, move |ev: SeqEvent| match ev {
            SeqEvent::Logits(l) => {
                let top = l
                    .iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map(|(i, _)| i as u32);
                matched += usize::from(top == reference.get(seen).copied());
                seen += 1;
                false
            }
            SeqEvent::Finished(_) => {
                let share = matched as f64 / reference.len() as f64;
                agreement.lock().unwrap().insert((c, q), share);
                true
            }
            SeqEvent::Error(_) => true,
            SeqEvent::Text { .. } => false,
        });
        self.remaining.fetch_add(1, Ordering::AcqRel);
        if let Err(err) = e.submit(Request {
            prompt_ids: prompt,
            params,
            cache_salt: None,
            sink,
        }) {
            self.remaining.fetch_sub(1, Ordering::AcqRel);
            bail!("submitting a teacher-forced profiling request: {err}");
        }
        Ok(())
    }

    /// The answer configuration `config` gave to query `query`, once finished.
    pub fn answer(&self, config: usize, query: usize) -> Option<Vec<u32>> {
        self.answers.lock().unwrap().get(&(config, query)).cloned()
    }

    /// The score of one configuration on one query, by the profile's metric.
    pub fn quality_of(&self, config: usize, query: usize) -> f64 {
        if config == 0 {
            return 1.0;
        }
        match self.metric {
            QualityMetric::TeacherForced => self
                .agreement
                .lock()
                .unwrap()
                .get(&(config, query))
                .copied()
                .unwrap_or(0.0),
            QualityMetric::AnswerF1 => {
                let answers = self.answers.lock().unwrap();
                let reference = answers.get(&(0, query)).map(Vec::as_slice).unwrap_or(&[]);
                token_f1(
                    answers
                        .get(&(config, query))
                        .map(Vec::as_slice)
                        .unwrap_or(&[]),
                    reference,
                )
            }
        }
    }

    /// Quality per configuration (index 0, the full KV, is 1 by definition).
    pub fn qualities(&self) -> Vec<f32> {
        if self.metric == QualityMetric::TeacherForced {
            let agreement = self.agreement.lock().unwrap();
            return (0..self.n_configs)
                .map(|c| {
                    if c == 0 {
                        return 1.0;
                    }
                    let sum: f64 = (0..self.n_queries)
                        .map(|q| agreement.get(&(c, q)).copied().unwrap_or(0.0))
                        .sum();
                    (sum / self.n_queries.max(1) as f64) as f32
                })
                .collect();
        }
        let answers = self.answers.lock().unwrap();
        (0..self.n_configs)
            .map(|c| {
                let mut sum = 0.0;
                for q in 0..self.n_queries {
                    let reference = answers.get(&(0, q)).map(Vec::as_slice).unwrap_or(&[]);
                    let answer = answers.get(&(c, q)).map(Vec::as_slice).unwrap_or(&[]);
                    sum += token_f1(answer, reference);
                }
                (sum / self.n_queries.max(1) as f64) as f32
            })
            .collect()
    }
}

/// A sink that hands events to `on_event` and, the first time it says the request is over,
/// counts it off `remaining`.
fn once_finished(
    remaining: Arc<AtomicUsize>,
    mut on_event: impl FnMut(SeqEvent) -> bool + Send + 'static,
) -> EventSink {
    let mut done = false;
    Box::new(move |ev: SeqEvent| {
        if on_event(ev) && !done {
            done = true;
            remaining.fetch_sub(1, Ordering::AcqRel);
        }
        true
    })
}

/// Submits the profiling requests of one stored context: for every configuration of
/// the store's grid and every query (tokens that follow the context), a greedy answer
/// of at most `max_answer_tokens` from the configuration's KV.
pub fn start_profile(
    e: &mut Engine,
    contexts: &ContextReuse,
    key: ChunkKey,
    queries: &[Vec<u32>],
    max_answer_tokens: usize,
) -> Result<Profiling> {
    let metric = contexts.profile_metric();
    start_profile_with(e, contexts, key, queries, max_answer_tokens, metric)
}

/// As [`start_profile`], scored by `metric` instead of the configured one.
pub fn start_profile_with(
    e: &mut Engine,
    contexts: &ContextReuse,
    key: ChunkKey,
    queries: &[Vec<u32>],
    max_answer_tokens: usize,
    metric: QualityMetric,
) -> Result<Profiling> {
    let store = contexts.store();
    let n_configs = store.grid().len();
    check_profile_size(e, n_configs, queries.len())?;
    let full = store.load_master(&key).map_err(anyhow::Error::msg)?;
    let answers = Arc::new(Mutex::new(HashMap::new()));
    // With teacher forcing, the first phase answers from the full KV only. A
    // configuration this context cannot build (SnapKV without its scores) is not run:
    // it scores 0, and the store never places it anyway.
    let first_phase_configs = if metric == QualityMetric::TeacherForced {
        1
    } else {
        n_configs
    };
    let available = |c: usize| c == 0 || store.is_available(&key, c);
    let first_phase = (0..first_phase_configs).filter(|&c| available(c)).count();
    let remaining = Arc::new(AtomicUsize::new(first_phase * queries.len()));
    let mut later = Vec::new();
    for c in 0..n_configs {
        if !available(c) {
            if c >= first_phase_configs {
                later.push(None);
            }
            continue;
        }
        let kv = if c == 0 {
            full.clone()
        } else {
            store.compress(&key, &full, c).map_err(anyhow::Error::msg)?
        };
        let prefix = Arc::new(PrefixKv { kv });
        if c >= first_phase_configs {
            later.push(Some(prefix));
            continue;
        }
        for (q, query) in queries.iter().enumerate() {
            let answers = answers.clone();
            let sink = once_finished(remaining.clone(), move |e: SeqEvent| match e {
                SeqEvent::Finished(o) => {
                    answers.lock().unwrap().insert((c, q), o.token_ids);
                    true
                }
                SeqEvent::Error(_) => true,
                _ => false,
            });
            submit_greedy(e, &prefix, query, max_answer_tokens, sink)?;
        }
    }
    Ok(Profiling {
        key,
        n_configs,
        n_queries: queries.len(),
        answers,
        agreement: Arc::new(Mutex::new(HashMap::new())),
        remaining,
        second_phase: (metric == QualityMetric::TeacherForced).then(|| (later, queries.to_vec())),
        metric,
    })
}

/// Refuses a profile without queries, or whose requests (one per configuration and
/// query) would not fit the queue.
fn check_profile_size(e: &Engine, n_configs: usize, n_queries: usize) -> Result<()> {
    if n_queries == 0 {
        bail!("profiling needs at least one query");
    }
    let n_requests = n_configs * n_queries;
    let room = e
        .config
        .max_waiting_requests
        .saturating_sub(e.num_waiting());
    if n_requests > room {
        bail!("profiling needs {n_requests} requests; the queue has room for {room}");
    }
    Ok(())
}

/// Submits one greedy profiling answer of at most `max_tokens` to `query` after the
/// given `prefix` KV (the context's own token ids are not needed: its KV is given).
fn submit_greedy(
    e: &mut Engine,
    prefix: &Arc<PrefixKv>,
    query: &[u32],
    max_tokens: usize,
    sink: EventSink,
) -> Result<()> {
    let mut prompt = vec![0u32; prefix.n_tokens()];
    prompt.extend_from_slice(query);
    let params = GenerateParams {
        max_tokens,
        prefix_kv: Some(prefix.clone()),
        background: true,
        ..Default::default()
    };
    e.submit(Request {
        prompt_ids: prompt,
        params,
        cache_salt: None,
        sink,
    })
    .map_err(|e| anyhow::anyhow!("{e}"))
}

/// Profiles one context to completion and records the curve in the store. Returns it.
pub fn profile_blocking(
    e: &mut Engine,
    contexts: &ContextReuse,
    key: ChunkKey,
    queries: &[Vec<u32>],
    max_answer_tokens: usize,
) -> Result<Vec<f32>> {
    let mut p = start_profile(e, contexts, key, queries, max_answer_tokens)?;
    while !p.poll(e)? {
        if !e.has_work() {
            bail!("profiling requests ended without results");
        }
        e.step();
    }
    let q = p.qualities();
    contexts
        .store()
        .set_profile(&key, q.clone())
        .map_err(anyhow::Error::msg)?;
    Ok(q)
}

/// A server's idle hook: if nothing waits and a stored context wants a (re)profile with
/// queries seen for it, starts profiling it.
pub fn maybe_start_background_profile(
    e: &mut Engine,
    contexts: &ContextReuse,
    max_answer_tokens: usize,
) -> Option<Profiling> {
    if e.num_waiting() > 0 || e.num_running() * 2 > e.config.max_running_seqs {
        return None;
    }
    let store = contexts.store();
    let (key, queries) = store.profiling_candidates(1).into_iter().next()?;
    match start_profile(e, contexts, key, &queries, max_answer_tokens) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::debug!("background profiling not started: {e}");
            None
        }
    }
}
