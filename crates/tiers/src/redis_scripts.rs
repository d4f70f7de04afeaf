//! Lua scripts that keep the Redis tier's shared state consistent. Each runs atomically on
//! the server, so several pagekeeper servers can share one Redis without races.
//!
//! Keys, under a configurable prefix `P` (e.g. `pk:tiers:v1:`):
//! - `P d:<hex>`: the payload bytes. Written first, with a short TTL ("pending").
//! - `P m:<hex>`: metadata `v1 <payload_len> <crc32c>`. Its presence makes the entry visible.
//! - `P lru`: sorted set of `<hex>` scored by a logical clock (`P clock`): the LRU order.
//! - `P usage`: payload bytes of all visible entries.
//!
//! NOTE 1: payload before metadata. A reader that sees metadata finds the payload; a writer
//! that dies between the two leaves a pending payload that expires on its own, unaccounted.
//! NOTE 2: capacity is enforced by `COMMIT`: after making entries visible it pops the least
//! recently used entries until `usage <= capacity`. Loads refresh recency through `TOUCH`.
//! The policy is therefore LRU, exact and shared by all clients; there is no TTL on
//! committed entries. Configure Redis's own `maxmemory` above the tier's capacity as a
//! backstop: if Redis evicts a payload itself, the reader finds metadata without a payload,
//! treats it as corrupt, and `DROP`s it.
//! NOTE 3: scripts touch keys they derive from `P` instead of declaring them all in KEYS
//! (LRU victims cannot be known beforehand). KEYS[1] is `P lru`, which routes the call on a
//! cluster; on a cluster `P` carries a hash tag, so every key a script touches lives in that
//! one slot (`redis_link.rs`, NOTE 1).

/// ARGV: prefix, capacity_bytes, then (hex, payload_len, meta) triples.
/// Returns {committed, evicted, usage_bytes}.
pub const COMMIT: &str = r#"
local pfx = ARGV[1]
local cap = tonumber(ARGV[2])
local lru, usage_key, clock = pfx .. 'lru', pfx .. 'usage', pfx .. 'clock'
local committed = 0
for i = 3, #ARGV, 3 do
  local hex, size, meta = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local dkey, mkey = pfx .. 'd:' .. hex, pfx .. 'm:' .. hex
  if redis.call('EXISTS', dkey) == 1 then
    redis.call('PERSIST', dkey)
    if redis.call('SET', mkey, meta, 'NX') then
      redis.call('INCRBY', usage_key, size)
    end
    redis.call('ZADD', lru, redis.call('INCR', clock), hex)
    committed = committed + 1
  end
end
local used = tonumber(redis.call('GET', usage_key) or '0')
local evicted = 0
while used > cap do
  local victim = redis.call('ZPOPMIN', lru)
  if #victim == 0 then break end
  local vh = victim[1]
  local vm = redis.call('GET', pfx .. 'm:' .. vh)
  if vm then
    used = redis.call('DECRBY', usage_key, tonumber(string.match(vm, '^v1 (%d+) ') or '0'))
  end
  redis.call('DEL', pfx .. 'm:' .. vh, pfx .. 'd:' .. vh)
  evicted = evicted + 1
end
return {committed, evicted, used}
"#;

/// ARGV: prefix, then hexes. Marks them most recently used (only if still present).
pub const TOUCH: &str = r#"
local pfx = ARGV[1]
local lru, clock = pfx .. 'lru', pfx .. 'clock'
for i = 2, #ARGV do
  redis.call('ZADD', lru, 'XX', redis.call('INCR', clock), ARGV[i])
end
return #ARGV - 1
"#;

/// ARGV: prefix, then hexes. Deletes entries and their accounting.
/// Returns {deleted (entries that had metadata), usage_bytes}.
pub const DROP: &str = r#"
local pfx = ARGV[1]
local lru, usage_key = pfx .. 'lru', pfx .. 'usage'
local deleted = 0
for i = 2, #ARGV do
  local hex = ARGV[i]
  local mkey = pfx .. 'm:' .. hex
  local vm = redis.call('GET', mkey)
  if vm then
    local size = tonumber(string.match(vm, '^v1 (%d+) ') or '0')
    redis.call('DECRBY', usage_key, size)
    deleted = deleted + 1
  end
  redis.call('DEL', mkey, pfx .. 'd:' .. hex)
  redis.call('ZREM', lru, hex)
end
return {deleted, tonumber(redis.call('GET', usage_key) or '0')}
"#;
