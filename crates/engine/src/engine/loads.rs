//! The engine's side of admission: what the scheduler asks of stored KV (`KvLoads`), done
//! with the reuse connector and the backend's pool, which the scheduler does not hold.

use pk_kv::{KvCacheManager, SeqId};
use pk_model::Backend;

use crate::prefix_kv;
use crate::reuse::{KvReuse, ReuseMatch, SeqReuse};
use crate::scheduler::KvLoads;
use crate::sequence::SeqState;

pub(super) struct Loads<'a> {
    pub reuse: Option<&'a mut (dyn KvReuse + 'static)>,
    pub backend: &'a mut dyn Backend,
}

impl KvLoads for Loads<'_> {
    fn lookup(&mut self, s: &SeqState) -> Option<ReuseMatch> {
        let r = self.reuse.as_mut()?;
        Some(r.lookup(&s.all_ids, s.req.cache_salt.as_deref()))
    }

    fn load_given(
        &mut self,
        s: &mut SeqState,
        kv: &mut KvCacheManager,
        seq: SeqId,
    ) -> Option<usize> {
        let p = s.req.params.prefix_kv.clone().expect("a given prefix");
        if !prefix_kv::place_prefix(&p.kv, kv, self.backend.kv_mut(), seq) {
            kv.free(seq);
            return None;
        }
        s.reuse = SeqReuse {
            inexact: true,
            ..Default::default()
        };
        Some(p.n_tokens())
    }

    fn load_stored(
        &mut self,
        s: &mut SeqState,
        probe: &ReuseMatch,
        kv: &mut KvCacheManager,
        seq: SeqId,
    ) -> Option<usize> {
        let r = self.reuse.as_mut().expect("a connector answered");
        let query = &s.all_ids[probe.loadable_tokens.min(s.n_prompt)..s.n_prompt];
        let Some(placed) = r.load(probe, query, kv, &mut *self.backend, seq) else {
            kv.free(seq);
            return None;
        };
        s.reuse.inexact = !placed.exact;
        s.reuse.saved_chunks = placed.saved_chunks;
        s.reuse.load = placed.report;
        Some(placed.tokens)
    }
}
