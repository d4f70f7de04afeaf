//! The engine's side of admission: what the scheduler asks of stored KV (`KvLoads`), done
//! with the connectors (the engine's, and a request's given prefix KV) and the backend's
//! pool, which the scheduler does not hold.

use pk_kv::{KvCacheManager, SeqId};
use pk_model::Backend;

use crate::connector::{KvConnector, Lookup};
use crate::scheduler::KvLoads;
use crate::sequence::{SeqReuse, SeqState};

pub(super) struct Loads<'a> {
    pub connector: Option<&'a dyn KvConnector>,
    pub backend: &'a mut dyn Backend,
}

impl KvLoads for Loads<'_> {
    fn lookup(&mut self, s: &SeqState) -> Option<Lookup> {
        let c = self.connector?;
        Some(c.lookup(s.request_key, &s.all_ids, s.req.cache_salt.as_deref()))
    }

    fn load_given(
        &mut self,
        s: &mut SeqState,
        kv: &mut KvCacheManager,
        seq: SeqId,
    ) -> Option<usize> {
        let given = s.req.params.prefix_kv.clone().expect("a given prefix");
        let salt = s.req.cache_salt.as_deref();
        let tokens = given
            .lookup(s.request_key, &s.all_ids, salt)
            .loadable_tokens;
        let query = &s.all_ids[tokens.min(s.n_prompt)..s.n_prompt];
        let loaded = given.load(s.request_key, tokens, query, kv, &mut *self.backend, seq);
        let Some(loaded) = loaded else {
            kv.free(seq);
            return None;
        };
        s.reuse = SeqReuse {
            inexact: true,
            load: loaded.origin,
            ..Default::default()
        };
        Some(loaded.tokens)
    }

    fn load_stored(
        &mut self,
        s: &mut SeqState,
        tokens: usize,
        kv: &mut KvCacheManager,
        seq: SeqId,
    ) -> Option<usize> {
        let c = self.connector.expect("a connector answered");
        let query = &s.all_ids[tokens.min(s.n_prompt)..s.n_prompt];
        let Some(loaded) = c.load(s.request_key, tokens, query, kv, &mut *self.backend, seq) else {
            kv.free(seq);
            return None;
        };
        s.reuse.inexact = !loaded.exact;
        s.reuse.wants_save = loaded.wants_save;
        s.reuse.load = loaded.origin;
        Some(loaded.tokens)
    }
}
