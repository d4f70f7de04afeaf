//! A tiny thread pool for decode-sized parallel regions: the calling thread plus
//! `threads - 1` dedicated helpers share the chunks of one region through an atomic
//! counter, so whoever is running takes the next chunk.
//!
//! Why not rayon: a decode step of SmolLM2-135M is ≈ 120 parallel regions of 2–20 µs each
//! (Q/K/V, O, gate/up and down of 30 layers, then the head). Calling rayon from the engine
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
//! Only one region runs at a time: a second caller (another engine in the same process,
//! parallel tests) or a region started from inside a chunk runs its chunks inline on its own
//! thread.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// How long a waiting thread spins (checking with `pause`) before it starts yielding: long
/// enough to cover the gap between two matmul regions of a layer on a quiet host (norms,
/// RoPE, the KV write: a few microseconds), short enough that a spinner sharing a core with
/// the thread it waits for wastes little of it.
const SPIN_US: u64 = 20;

/// How long a waiting thread then calls `sched_yield` between checks before parking: this
/// covers decode attention between the O projection of one layer and Q/K/V of the next
/// (tens of microseconds at a few hundred tokens of context), and gives the core away at
/// once when another runnable thread shares it.
const YIELD_US: u64 = 200;

/// The spin and yield phases, overridable by `PK_POOL_SPIN_US` / `PK_POOL_YIELD_US` (read
/// once) so that benchmarks can compare waiting strategies without rebuilding.
fn tune() -> (Duration, Duration) {
    static T: OnceLock<(Duration, Duration)> = OnceLock::new();
    *T.get_or_init(|| {
        let v = |k: &str, d: u64| std::env::var(k).ok().and_then(|s| s.parse().ok()).unwrap_or(d);
        (Duration::from_micros(v("PK_POOL_SPIN_US", SPIN_US)), Duration::from_micros(v("PK_POOL_YIELD_US", YIELD_US)))
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
    shutdown: AtomicBool,
}

// SAFETY: `job` is written only by the thread holding `Pool::busy` before the region is
// published, and read by helpers only after they claimed a chunk of that region (which keeps
// the caller from returning, and so from writing it again, until that chunk is done).
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct Pool {
    shared: Arc<Shared>,
    helpers: Vec<Thread>,
    /// Threads a region may use now (1 ..= `threads`); `set_active_threads` changes it.
    active: AtomicUsize,
    threads: usize,
    /// Windows after which regions went solo (for benchmarks).
    solo_windows: AtomicU64,
    /// Held by the thread running a region; guards the adaptive state.
    busy: Mutex<Adaptive>,
}

/// Whether splitting pays now, judged by how much of the work the helpers actually did.
#[derive(Default)]
struct Adaptive {
    /// Regions and chunks in the current measuring window, and the helpers' chunk count
    /// when it began.
    regions: usize,
    chunks: u64,
    helper_start: u64,
    /// Regions left to run inline on the caller before measuring again.
    solo_left: usize,
}

/// Regions per measuring window (≈ one SmolLM2 decode step has 150).
const WINDOW_REGIONS: usize = 128;

/// Below this share of a window's chunks done by helpers (percent), the helpers are not
/// getting a core (a busy host, or both threads pinned to one CPU), and every region pays
/// the wake-ups and the waits on preempted chunks for almost no work shared, so the next
/// `SOLO_REGIONS` regions run inline on the caller: exactly the 1-thread path. A quiet host
/// gives helpers 30–50 %.
const MIN_HELPER_PERCENT: u64 = 10;

/// Regions run inline after a poor window (≈ 7 decode steps) before the helpers are tried
/// again.
const SOLO_REGIONS: usize = 1024;

const fn epoch(w: u64) -> u32 {
    (w >> 32) as u32
}
const fn n_chunks(w: u64) -> usize {
    ((w >> 16) & 0xffff) as usize
}
const fn next_chunk(w: u64) -> usize {
    (w & 0xffff) as usize
}

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
            sleeping: (1..threads).map(|_| Padded(AtomicBool::new(false))).collect(),
            caller_waiting: AtomicBool::new(false),
            caller: Mutex::new(None),
            shutdown: AtomicBool::new(false),
        });
        let helpers = (1..threads)
            .map(|i| {
                let sh = Arc::clone(&shared);
                thread::Builder::new().name(format!("pk-decode-{i}")).spawn(move || helper_loop(&sh, i - 1)).expect("spawning a decode helper").thread().clone()
            })
            .collect();
        Pool { shared, helpers, active: AtomicUsize::new(threads), threads, solo_windows: AtomicU64::new(0), busy: Mutex::new(Adaptive::default()) }
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

    /// How often a measuring window found the helpers doing under `MIN_HELPER_PERCENT` of
    /// the work, so that the pool ran the next `SOLO_REGIONS` regions on the caller alone.
    pub fn solo_windows(&self) -> u64 {
        self.solo_windows.load(Relaxed)
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
        let Ok(mut adaptive) = self.busy.try_lock() else {
            return (0..n).for_each(f);
        };
        if adaptive.solo_left > 0 {
            adaptive.solo_left -= 1;
            return (0..n).for_each(f);
        }
        let sh = &*self.shared;
        if adaptive.regions == 0 {
            adaptive.helper_start = sh.helper_done.load(Relaxed);
        }
        adaptive.regions += 1;
        adaptive.chunks += n as u64;
        if adaptive.regions == WINDOW_REGIONS {
            // Judged before this region runs, on the window's earlier regions (the helpers
            // count their chunks when they leave a region, so the last one may lag).
            let helped = sh.helper_done.load(Relaxed) - adaptive.helper_start;
            if helped * 100 < adaptive.chunks * MIN_HELPER_PERCENT {
                adaptive.solo_left = SOLO_REGIONS;
                self.solo_windows.fetch_add(1, Relaxed);
            }
            adaptive.regions = 0;
            adaptive.chunks = 0;
        }
        {
            let mut caller = sh.caller.lock().unwrap_or_else(|e| e.into_inner());
            if caller.as_ref().map(|t| t.id()) != Some(thread::current().id()) {
                *caller = Some(thread::current());
            }
        }
        // SAFETY: no helper holds a claimed chunk (the previous region finished all of its
        // chunks before `run` returned), so none reads `job` now. The erased lifetime is
        // sound because `run` does not return before every claimed chunk is done.
        unsafe { *sh.job.get() = std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), Job>(f as *const _) };
        sh.done.0.store(0, Relaxed);
        let e = epoch(sh.word.0.load(Relaxed)).wrapping_add(1);
        let w0 = (e as u64) << 32 | (n as u64) << 16;
        sh.word.0.store(w0, SeqCst);
        for (h, s) in self.helpers.iter().zip(&sh.sleeping).take(self.active_threads() - 1) {
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
            if k % 64 != 0 {
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
            if k % 64 != 0 {
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
            sh.sleeping[me].0.store(true, SeqCst);
            if epoch(sh.word.0.load(SeqCst)) == seen && !sh.shutdown.load(SeqCst) {
                thread::park();
            }
            sh.sleeping[me].0.store(false, SeqCst);
        };
        seen = e;
        let mut mine = 0;
        while let Some((i, n)) = claim(sh, e) {
            // SAFETY: holding a claimed chunk of region `e` keeps its caller inside `run`,
            // so the job it published for `e` is alive and unchanged.
            let job = unsafe { &**sh.job.get() };
            job(i);
            mine += 1;
            if sh.done.0.fetch_add(1, SeqCst) + 1 == n as u32 && sh.caller_waiting.swap(false, SeqCst) {
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
/// `--threads` sets), so one flag configures both.
pub fn global() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool::new(rayon::current_num_threads()))
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
                assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "threads {threads} round {round}");
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
        pool.run(4, &|_| pool.run(5, &|_| {
            total.fetch_add(1, Relaxed);
        }));
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
