//! A tiny thread pool for decode-sized parallel regions: the calling thread plus
//! `threads - 1` dedicated helpers share the chunks of one region through an atomic
//! counter, so whoever is running takes the next chunk.
//!
//! Why not rayon: a decode step of SmolLM2-135M is 151 parallel regions of a few to a few
//! tens of microseconds (Q/K/V, attention, O, gate/up and down of 30 layers, then the head). Calling rayon from the engine
//! thread (not a rayon worker) injects the job, wakes workers and then blocks the caller on
//! a latch, so every region costs two cross-thread hand-offs and the caller's core sits idle;
//! and an idle rayon worker spins before it sleeps, which on this host (whose 2 vCPUs often
//! act as one core) takes time from the thread that holds the rest of the work.
//!
//! Here the caller always works on its own region, chunks are claimed dynamically (a helper
//! that is descheduled simply claims nothing, and the caller does all the chunks itself, so a
//! region never waits for a thread that is not running unless that thread already holds a
//! chunk), and every wait is bounded: spin for a few microseconds, then `sched_yield` for a
//! while (which hands the core to the other thread when both share one), then park on a
//! futex (`std::thread::park`). Which thread computes which chunk never changes a result:
//! chunks are disjoint output rows computed by the same code.
//!
//! Whether a decode step is split at all is decided per step by measurement (`Pool::step`,
//! `Tuner`): on a quiet host the split wins, while on a busy one (another job on the second
//! core) a region waits whenever the helper is preempted holding a chunk, and running the
//! step on the caller alone, exactly the 1-thread path, is as fast or faster.
//!
//! Only one region runs at a time: a second caller (another engine in the same process,
//! parallel tests) or a region started from inside a chunk runs its chunks inline on its own
//! thread.

use std::cell::UnsafeCell;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// How long a waiting thread spins (checking with `pause`) before it starts yielding: long
/// enough to cover the gap between two matmul regions of a layer on a quiet host (norms,
/// RoPE, the KV write: a few microseconds), short enough that a spinner sharing a core with
/// the thread it waits for wastes little of it.
const SPIN_US: u64 = 20;

/// How long a waiting thread then calls `sched_yield` between checks before parking: this
/// covers the gap between two decode steps (sampling, the engine's bookkeeping), so a helper
/// stays awake through a generation, and gives the core away at once when another runnable
/// thread shares it (`taskset -c 0`, or a busy host).
const YIELD_US: u64 = 200;

/// The spin and yield phases, overridable by `PK_POOL_SPIN_US` / `PK_POOL_YIELD_US` (read
/// once) so that benchmarks can compare waiting strategies without rebuilding.
fn tune() -> (Duration, Duration) {
    static T: OnceLock<(Duration, Duration)> = OnceLock::new();
    *T.get_or_init(|| {
        let v = |k: &str, d: u64| env_number(k, WAIT_US_RANGE).map_or(d, |n| n as u64);
        (
            Duration::from_micros(v("PK_POOL_SPIN_US", SPIN_US)),
            Duration::from_micros(v("PK_POOL_YIELD_US", YIELD_US)),
        )
    })
}

/// A region's chunk function, with its lifetime erased (see `run`'s safety argument).
type Job = *const (dyn Fn(usize) + Sync);

#[repr(align(128))]
struct Padded<T>(T);

struct Shared {
    /// `epoch << 32 | n_chunks << 16 | next_chunk`: a new region bumps the epoch, and a chunk
    /// is claimed by a compare-and-swap on the whole word, so a thread that arrives late can
    /// never claim a chunk of a newer region while holding an older one's job.
    word: Padded<AtomicU64>,
    /// Chunks finished in the current region.
    done: Padded<AtomicU32>,
    /// Chunks finished by helpers since start-up (for `helper_chunks`).
    helper_done: AtomicU64,
    /// The current region's job; written only while no helper can hold a claimed chunk.
    job: UnsafeCell<Job>,
    /// Per helper: it is parked (or about to park) and needs an `unpark`.
    sleeping: Vec<Padded<AtomicBool>>,
    /// The caller is parked waiting for the last chunk.
    caller_waiting: AtomicBool,
    caller: Mutex<Option<Thread>>,
    /// Set while decode runs inline: helpers park at once instead of spinning and yielding
    /// beside the caller (which would slow the inline steps, and bias the tuner's view of them).
    hold: AtomicBool,
    /// The CPU the caller last published a region from (-1: unknown).
    caller_cpu: AtomicI32,
    shutdown: AtomicBool,
}

// SAFETY: `job` is written only by the thread holding `Pool::busy` before the region is
// published, and read by helpers only after they claimed a chunk of that region (which keeps
// the caller from returning, and so from writing it again, until that chunk is done).
unsafe impl Sync for Shared {}
// SAFETY: the only field that is not `Send` is `job`, a raw pointer to a `Sync` closure; it
// is dereferenced only under the protocol above, whichever thread holds or drops the `Arc`.
unsafe impl Send for Shared {}

pub struct Pool {
    shared: Arc<Shared>,
    helpers: Vec<Thread>,
    /// Threads a region may use now (1 ..= `threads`); `set_active_threads` changes it.
    active: AtomicUsize,
    threads: usize,
    /// Steps run split and steps run solo (for benchmarks).
    split_steps: AtomicU64,
    solo_steps: AtomicU64,
    /// Set while the current step runs inline on the caller (see `step`).
    solo_now: AtomicBool,
    tuner: Mutex<Tuner>,
    /// Held by the thread running a region.
    busy: Mutex<()>,
}

/// The step-level choice between splitting decode over the pool and running it inline: an
/// A/B test that never stops. Each mode keeps its last `SAMPLES` times per token, and the
/// mode with the lower median runs; every `gap` steps one step runs the other way so that its
/// samples follow the host. `gap` doubles (up to `MAX_GAP`) while the choice holds and drops
/// back to `MIN_GAP` when it flips, so a steady host pays for few probes. The first
/// `2 * WARM_UP` steps alternate. Medians, not averages: with exponential averages seeded by
/// each mode's first step, `bench perf --contexts 16 --threads 2` ran at 0.84× of 1 thread in
/// two series of six runs on a busy host (one slow sample, such as the first decode step
/// after a prefill, holds an average up for many steps; a median of seven drops it).
struct Tuner {
    /// Seconds per token, newest last: [solo, split].
    samples: [Vec<f64>; 2],
    steps: u64,
    next_probe: u64,
    gap: u64,
    last_best: usize,
    /// Off: every step splits (`Pool::set_tuning`).
    enabled: bool,
    /// The last step: its mode, start, tokens and forward-pass seconds; recorded when the
    /// next step starts.
    pending: Option<(usize, Instant, usize, f64)>,
}

const SAMPLES: usize = 7;
/// The split must beat inline by this factor to be chosen: inline is the safe mode (no waits
/// on a preempted helper), and when the two are this close (both threads on one core under
/// `taskset -c 0`, where a 1-in-5 split measured 0.96× of 1 thread) the choice would flip
/// often and every flip brings probes back to every `MIN_GAP` steps.
const SPLIT_MARGIN: f64 = 0.97;
const WARM_UP: u64 = 3;
const MIN_GAP: u64 = 8;
const MAX_GAP: u64 = 64;

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

impl Tuner {
    fn new(enabled: bool) -> Tuner {
        Tuner {
            samples: [Vec::new(), Vec::new()],
            steps: 0,
            next_probe: 0,
            gap: MIN_GAP,
            last_best: 1,
            enabled,
            pending: None,
        }
    }

    fn choose(&mut self) -> usize {
        self.steps += 1;
        if !self.enabled {
            return 1;
        }
        if self.steps <= 2 * WARM_UP || self.samples.iter().any(Vec::is_empty) {
            return (self.steps % 2) as usize;
        }
        let best = usize::from(median(&self.samples[1]) < SPLIT_MARGIN * median(&self.samples[0]));
        if best != self.last_best || self.next_probe == 0 {
            self.last_best = best;
            self.gap = MIN_GAP;
            self.next_probe = self.steps + self.gap;
        }
        if self.steps >= self.next_probe {
            self.gap = (self.gap * 2).min(MAX_GAP);
            self.next_probe = self.steps + self.gap;
            return 1 - best;
        }
        best
    }

    fn record(&mut self, mode: usize, secs_per_token: f64) {
        let v = &mut self.samples[mode];
        if v.len() == SAMPLES {
            v.remove(0);
        }
        v.push(secs_per_token);
    }
}

/// A decode step in progress (see [`Pool::step`]); notes its forward-pass time when dropped.
pub struct Step<'a> {
    pool: &'a Pool,
    mode: usize,
    tokens: usize,
    t0: Instant,
}

impl Drop for Step<'_> {
    fn drop(&mut self) {
        if self.mode == usize::MAX {
            return;
        }
        let forward = self.t0.elapsed().as_secs_f64();
        self.pool.solo_now.store(false, Relaxed);
        self.pool
            .tuner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pending = Some((self.mode, self.t0, self.tokens, forward));
    }
}

const fn epoch(w: u64) -> u32 {
    (w >> 32) as u32
}
const fn n_chunks(w: u64) -> usize {
    ((w >> 16) & 0xffff) as usize
}
const fn next_chunk(w: u64) -> usize {
    (w & 0xffff) as usize
}

/// Forward calls of up to this many tokens are decode steps: their matmuls and attention
/// run on this pool (larger ones, prefill, keep rayon), and `step` times them.
pub const DECODE_MAX_TOKENS: usize = 8;

/// Most chunks one region can have.
pub const MAX_CHUNKS: usize = 0xffff;

impl Pool {
    /// A pool where regions use up to `threads` threads (the caller and `threads - 1` helpers).
    pub fn new(threads: usize) -> Pool {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            word: Padded(AtomicU64::new(0)),
            done: Padded(AtomicU32::new(0)),
            helper_done: AtomicU64::new(0),
            job: UnsafeCell::new(std::ptr::null::<fn(usize)>() as Job),
            sleeping: (1..threads)
                .map(|_| Padded(AtomicBool::new(false)))
                .collect(),
            caller_waiting: AtomicBool::new(false),
            caller: Mutex::new(None),
            caller_cpu: AtomicI32::new(-1),
            hold: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
        });
        let helpers = (1..threads)
            .map(|i| {
                let sh = Arc::clone(&shared);
                thread::Builder::new()
                    .name(format!("pk-decode-{i}"))
                    .spawn(move || helper_loop(&sh, i - 1))
                    .expect("spawning a decode helper")
                    .thread()
                    .clone()
            })
            .collect();
        Pool {
            shared,
            helpers,
            active: AtomicUsize::new(threads),
            threads,
            split_steps: AtomicU64::new(0),
            solo_steps: AtomicU64::new(0),
            solo_now: AtomicBool::new(false),
            // `PK_POOL_TUNE=0` starts with tuning off, so benchmarks can time the split itself.
            tuner: Mutex::new(Tuner::new(
                super::switch_value("PK_POOL_TUNE")
                    .unwrap_or_else(|e| panic!("{e}"))
                    .unwrap_or(true),
            )),
            busy: Mutex::new(()),
        }
    }

    /// Threads this pool was built with.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Threads regions use from now on, clamped to `1..=threads()` (1: everything inline on
    /// the caller, the helpers stay parked). Benchmarks switch it to compare 1 and 2 threads
    /// in one process.
    pub fn set_active_threads(&self, n: usize) {
        self.active.store(n.clamp(1, self.threads), Relaxed);
    }

    pub fn active_threads(&self) -> usize {
        self.active.load(Relaxed)
    }

    /// With `false`, every decode step splits (tests of the split path, benchmarks of the
    /// split itself); with `true` (the default) `step` chooses.
    pub fn set_tuning(&self, on: bool) {
        self.tuner.lock().unwrap_or_else(|e| e.into_inner()).enabled = on;
    }

    /// Decode steps run split over the pool and run inline, since start-up.
    pub fn step_counts(&self) -> (u64, u64) {
        (
            self.split_steps.load(Relaxed),
            self.solo_steps.load(Relaxed),
        )
    }

    /// Starts a decode step of `tokens` tokens (the forward pass calls this when its matmuls
    /// and attention will run on this pool). It chooses whether the step's regions are
    /// split over the threads or run inline on the caller, by which has been faster per
    /// token lately (see `Tuner`): on a busy host, where the helper's core is shared with
    /// other jobs and a region waits whenever the helper is preempted holding a chunk, the
    /// split can cost more than it gains, and then decode runs as at one thread. Which
    /// way a step runs never changes its results.
    pub fn step(&self, tokens: usize) -> Step<'_> {
        if self.active_threads() == 1 {
            return Step {
                pool: self,
                mode: usize::MAX,
                tokens,
                t0: Instant::now(),
            };
        }
        let mode = {
            let mut tuner = self.tuner.lock().unwrap_or_else(|e| e.into_inner());
            // The previous step's cost runs from its start to this one's: whatever a mode
            // leaves behind (a helper spinning and yielding beside the caller's sampling)
            // is charged to it. A gap over twice the forward pass was the caller doing
            // something else (a new request, idle), so then the forward pass alone counts.
            if let Some((m, t0, tokens, forward)) = tuner.pending.take() {
                let cycle = t0.elapsed().as_secs_f64();
                let cost = if cycle <= 2.0 * forward {
                    cycle
                } else {
                    forward
                };
                tuner.record(m, cost / tokens.max(1) as f64);
            }
            tuner.choose()
        };
        self.solo_now.store(mode == 0, Relaxed);
        self.shared.hold.store(mode == 0, Relaxed);
        [&self.solo_steps, &self.split_steps][mode].fetch_add(1, Relaxed);
        Step {
            pool: self,
            mode,
            tokens,
            t0: Instant::now(),
        }
    }

    /// Chunks the helpers have computed since start-up.
    pub fn helper_chunks(&self) -> u64 {
        self.shared.helper_done.load(Relaxed)
    }

    /// Calls `f(i)` once for every chunk `i` in `0..n`, spread over the active threads, and
    /// returns when all calls have returned. Chunks must not depend on each other's results.
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        assert!(n <= MAX_CHUNKS, "too many chunks");
        if n <= 1 || self.active_threads() == 1 {
            return (0..n).for_each(f);
        }
        if self.solo_now.load(Relaxed) {
            return (0..n).for_each(f);
        }
        let Ok(_busy) = self.busy.try_lock() else {
            return (0..n).for_each(f);
        };
        let sh = &*self.shared;
        {
            let mut caller = sh.caller.lock().unwrap_or_else(|e| e.into_inner());
            if caller.as_ref().map(|t| t.id()) != Some(thread::current().id()) {
                *caller = Some(thread::current());
            }
        }
        // SAFETY: no helper holds a claimed chunk (the previous region finished all of its
        // chunks before `run` returned), so none reads `job` now. The erased lifetime is
        // sound because `run` does not return before every claimed chunk is done.
        unsafe {
            *sh.job.get() =
                std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), Job>(f as *const _)
        };
        sh.done.0.store(0, Relaxed);
        sh.caller_cpu.store(affinity::current_cpu(), Relaxed);
        let e = epoch(sh.word.0.load(Relaxed)).wrapping_add(1);
        let w0 = (e as u64) << 32 | (n as u64) << 16;
        sh.word.0.store(w0, SeqCst);
        for (h, s) in self
            .helpers
            .iter()
            .zip(&sh.sleeping)
            .take(self.active_threads() - 1)
        {
            if s.0.load(SeqCst) && s.0.swap(false, SeqCst) {
                h.unpark();
            }
        }
        let mut mine = 0;
        while let Some((i, _)) = claim(sh, e) {
            f(i);
            mine += 1;
        }
        let done = sh.done.0.fetch_add(mine, SeqCst) + mine;
        if done as usize == n {
            return;
        }
        // Wait for the chunks helpers hold: spin, yield, then park until the last one wakes us.
        let t0 = Instant::now();
        let mut k = 0u32;
        while (sh.done.0.load(Acquire) as usize) < n {
            k = k.wrapping_add(1);
            if !k.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let waited = t0.elapsed();
            let (spin, yld) = tune();
            if waited < spin {
                continue;
            }
            if waited < spin + yld {
                thread::yield_now();
                continue;
            }
            sh.caller_waiting.store(true, SeqCst);
            if (sh.done.0.load(SeqCst) as usize) < n {
                thread::park_timeout(Duration::from_millis(1));
            }
            sh.caller_waiting.store(false, SeqCst);
        }
    }
}

/// Claims the next chunk of region `e`, if it is still current and has one left; returns
/// the chunk and the region's chunk count.
fn claim(sh: &Shared, e: u32) -> Option<(usize, usize)> {
    let mut w = sh.word.0.load(Acquire);
    loop {
        if epoch(w) != e || next_chunk(w) >= n_chunks(w) {
            return None;
        }
        match sh.word.0.compare_exchange_weak(w, w + 1, AcqRel, Acquire) {
            Ok(_) => return Some((next_chunk(w), n_chunks(w))),
            Err(now) => w = now,
        }
    }
}

fn helper_loop(sh: &Shared, me: usize) {
    let mut affinity = affinity::Spread::new();
    let mut seen = 0u32;
    loop {
        // Wait for a region newer than the last one seen.
        let t0 = Instant::now();
        let mut k = 0u32;
        let e = loop {
            let e = epoch(sh.word.0.load(Acquire));
            if e != seen {
                break e;
            }
            if sh.shutdown.load(Relaxed) {
                return;
            }
            k = k.wrapping_add(1);
            if !sh.hold.load(Relaxed) {
                if !k.is_multiple_of(64) {
                    std::hint::spin_loop();
                    continue;
                }
                let waited = t0.elapsed();
                let (spin, yld) = tune();
                if waited < spin {
                    continue;
                }
                if waited < spin + yld {
                    thread::yield_now();
                    continue;
                }
            }
            sh.sleeping[me].0.store(true, SeqCst);
            if epoch(sh.word.0.load(SeqCst)) == seen && !sh.shutdown.load(SeqCst) {
                thread::park();
            }
            sh.sleeping[me].0.store(false, SeqCst);
        };
        seen = e;
        affinity.away_from(sh.caller_cpu.load(Relaxed));
        let mut mine = 0;
        while let Some((i, n)) = claim(sh, e) {
            // SAFETY: holding a claimed chunk of region `e` keeps its caller inside `run`,
            // so the job it published for `e` is alive and unchanged.
            let job = unsafe { &**sh.job.get() };
            job(i);
            mine += 1;
            if sh.done.0.fetch_add(1, SeqCst) + 1 == n as u32
                && sh.caller_waiting.swap(false, SeqCst)
            {
                // The caller may already have moved on (it polls `done` too); a spurious
                // unpark only makes one of its later parks return early, and it re-checks.
                if let Some(t) = sh.caller.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                    t.unpark();
                }
            }
        }
        sh.helper_done.fetch_add(mine, Relaxed);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
        for h in &self.helpers {
            h.unpark();
        }
    }
}

/// The process-wide decode pool, sized on first use to rayon's thread count (which
/// `--threads` sets), so one flag configures both; `PK_DECODE_THREADS=N` sizes it apart
/// (benchmarks: prefill on rayon's threads, decode on N).
pub fn global() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        Pool::new(
            env_number("PK_DECODE_THREADS", DECODE_THREADS_RANGE)
                .unwrap_or_else(rayon::current_num_threads),
        )
    })
}

/// The developer switch `name` as a number in `range`, `None` when unset; any other value
/// is refused by name, like the kernels' other `PK_*` switches, rather than ignored.
fn number_value(name: &str, range: RangeInclusive<usize>) -> Result<Option<usize>, String> {
    let Ok(v) = std::env::var(name) else {
        return Ok(None);
    };
    match v.parse::<usize>() {
        Ok(n) if range.contains(&n) => Ok(Some(n)),
        _ => Err(format!(
            "{name}={v:?} is not a number from {} to {}",
            range.start(),
            range.end()
        )),
    }
}

/// [`number_value`] where the pool reads it lazily (see [`super::env_switch`]).
fn env_number(name: &str, range: RangeInclusive<usize>) -> Option<usize> {
    number_value(name, range).unwrap_or_else(|e| panic!("{e}"))
}

/// The pool's switches as [`tune`], [`global`] and [`Pool::new`] read them.
pub(super) fn check_switches() -> Result<(), String> {
    number_value("PK_POOL_SPIN_US", WAIT_US_RANGE)?;
    number_value("PK_POOL_YIELD_US", WAIT_US_RANGE)?;
    number_value("PK_DECODE_THREADS", DECODE_THREADS_RANGE)?;
    super::switch_value("PK_POOL_TUNE")?;
    Ok(())
}

/// What `PK_POOL_SPIN_US` and `PK_POOL_YIELD_US` may be, in microseconds.
const WAIT_US_RANGE: RangeInclusive<usize> = 0..=1_000_000;
/// What `PK_DECODE_THREADS` may be: the CLI's own thread limit.
const DECODE_THREADS_RANGE: RangeInclusive<usize> = 1..=512;

/// Keeps a helper off the caller's CPU.
///
/// On a host where another job keeps one of two CPUs busy, the scheduler tends to wake a
/// parked helper on the caller's CPU (the other one is not idle), and a helper that mostly
/// spins and yields adds too little load for the balancer to move it: both threads then
/// share one core and the helper computes a few percent of the chunks (measured with
/// `pool_bench`: 1–6 %). So when a helper sees that it runs on the caller's CPU it narrows
/// its own affinity to the CPUs it may use minus that one (never the caller's affinity, and
/// nothing when no other CPU is allowed, as under `taskset -c 0`).
mod affinity {
    #[cfg(target_os = "linux")]
    mod sys {
        pub const WORDS: usize = 16;
        extern "C" {
            pub fn sched_getcpu() -> i32;
            pub fn sched_getaffinity(pid: i32, size: usize, mask: *mut u64) -> i32;
            pub fn sched_setaffinity(pid: i32, size: usize, mask: *const u64) -> i32;
        }
    }

    /// The CPU this thread runs on, or -1.
    pub fn current_cpu() -> i32 {
        #[cfg(target_os = "linux")]
        // SAFETY: no arguments; glibc answers from the vDSO or rseq area.
        return unsafe { sys::sched_getcpu() };
        #[cfg(not(target_os = "linux"))]
        return -1;
    }

    pub struct Spread {
        /// The CPUs this thread was allowed at start (the process's affinity).
        #[cfg(target_os = "linux")]
        allowed: Option<[u64; sys::WORDS]>,
        /// The CPU the affinity now excludes (-1: none).
        excluded: i32,
    }

    impl Spread {
        pub fn new() -> Spread {
            #[cfg(target_os = "linux")]
            {
                let mut mask = [0u64; sys::WORDS];
                // SAFETY: `mask` is `WORDS` words long, as the size says.
                let ok =
                    unsafe { sys::sched_getaffinity(0, sys::WORDS * 8, mask.as_mut_ptr()) } == 0;
                Spread {
                    allowed: ok.then_some(mask),
                    excluded: -1,
                }
            }
            #[cfg(not(target_os = "linux"))]
            Spread { excluded: -1 }
        }

        /// If this thread runs on `caller_cpu`, moves it to the other allowed CPUs.
        pub fn away_from(&mut self, caller_cpu: i32) {
            #[cfg(target_os = "linux")]
            {
                let Some(allowed) = self.allowed else { return };
                if caller_cpu < 0
                    || caller_cpu == self.excluded
                    || current_cpu() != caller_cpu
                    || caller_cpu as usize >= sys::WORDS * 64
                {
                    return;
                }
                let mut mask = allowed;
                mask[caller_cpu as usize / 64] &= !(1u64 << (caller_cpu % 64));
                if mask.iter().all(|&w| w == 0) {
                    // Only the caller's CPU is allowed: nothing to do, and nothing to retry.
                    self.allowed = None;
                    return;
                }
                // SAFETY: `mask` is `WORDS` words long, as the size says.
                if unsafe { sys::sched_setaffinity(0, sys::WORDS * 8, mask.as_ptr()) } == 0 {
                    self.excluded = caller_cpu;
                } else {
                    self.allowed = None;
                }
            }
            #[cfg(not(target_os = "linux"))]
            let _ = caller_cpu;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Every chunk runs exactly once per region, over many regions back to back (helpers
    /// arriving late to a finished region must claim nothing), at 1, 2 and 3 threads, with
    /// waits long enough that helpers park between some regions.
    #[test]
    fn every_chunk_runs_once() {
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads);
            for round in 0..3000usize {
                let n = 1 + round % 37;
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Relaxed);
                    if round % 7 == 0 {
                        std::hint::black_box((0..200).sum::<usize>());
                    }
                });
                assert!(
                    hits.iter().all(|h| h.load(Relaxed) == 1),
                    "threads {threads} round {round}"
                );
                if round % 500 == 0 {
                    thread::sleep(Duration::from_millis(2));
                }
            }
        }
    }

    /// A region started from inside a chunk, or while another thread's region runs, runs
    /// inline and still covers every chunk.
    #[test]
    fn nested_and_concurrent_regions_run_inline() {
        let pool = Arc::new(Pool::new(2));
        let total = AtomicUsize::new(0);
        pool.run(4, &|_| {
            pool.run(5, &|_| {
                total.fetch_add(1, Relaxed);
            })
        });
        assert_eq!(total.load(Relaxed), 20);
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let pool = Arc::clone(&pool);
                thread::spawn(move || {
                    let c = AtomicUsize::new(0);
                    for _ in 0..500 {
                        pool.run(9, &|_| {
                            c.fetch_add(1, Relaxed);
                        });
                    }
                    c.load(Relaxed)
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), 4500);
        }
    }
}
