//! Lua scripts that keep the Redis tier's shared state consistent. Each runs atomically on
//! the server, so several pagekeeper servers can share one Redis without races.
//!
//! Keys, under a configurable prefix `P` (e.g. `pk:tiers:v1:`):
//! - `P d:<hex>`: the payload bytes. Written first, with a short TTL ("pending").
//! - `P m:<hex>`: metadata `v1 <payload_len> <crc32c>`. Its presence makes the entry visible.
//! - `P lru`: sorted set of `<hex>` scored by a logical clock (`P clock`): the LRU order.
//! - `P sizes`: hash of `<hex>` to the payload bytes `COMMIT` accounted for that entry.
//! - `P usage`: payload bytes of all visible entries, always the sum of `P sizes`.
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
//! NOTE 4 (accounting): Lua scripts do not roll back, so a command that fails half-way
//! through would leave whatever ran before it. Every script therefore checks the control
//! keys first and makes an entry visible (PERSIST, SET of the metadata) only after its
//! accounting (`sizes`, `usage`, `lru`) is written. Usage moves only by sizes the scripts
//! recorded in `P sizes` themselves, never by a number read from metadata, which anyone
//! with access to Redis can overwrite.
//! NOTE 5 (repair): `usage` and `clock` are derived, so a corrupt one is rebuilt (usage from
//! `P sizes`, clock from the newest LRU score) and the script reports the repair; the tier
//! logs it as a warning and carries on, as a cache should. `lru` and `sizes` are the only
//! record of which entries exist: if either holds the wrong type, `COMMIT` refuses to make
//! anything visible and reports the key until an operator deletes it; the next script then
//! rebuilds the accounting from whichever of the two is left (entries it cannot account
//! for are deleted). Prefixes written by versions without `P sizes` are migrated the same
//! way, from their metadata, on first use.

/// Shared helpers, prepended to every script.
macro_rules! control_lua {
    () => {
        r#"
-- A non-negative integer as these scripts write one, or nil.
local function nat(s)
  if type(s) == 'string' and string.match(s, '^%d+$') then return tonumber(s) end
  return nil
end

local function kind(key) return redis.call('TYPE', key)['ok'] end

-- The length in metadata an earlier version wrote, only if the metadata parses exactly.
local function meta_size(mkey)
  if kind(mkey) ~= 'string' then return nil end
  return nat(string.match(redis.call('GET', mkey), '^v1 (%d+) %d+$'))
end

-- Deletes an entry and its accounting record; returns the size it was accounted at.
local function forget(pfx, hex)
  local size = nat(redis.call('HGET', pfx .. 'sizes', hex)) or 0
  redis.call('HDEL', pfx .. 'sizes', hex)
  redis.call('ZREM', pfx .. 'lru', hex)
  redis.call('DEL', pfx .. 'm:' .. hex, pfx .. 'd:' .. hex)
  return size
end

-- Recomputes usage from the entries in lru or sizes (NOTE 5); returns {entries, bytes}.
local function rebuild(pfx)
  local lru, sizes = pfx .. 'lru', pfx .. 'sizes'
  local candidates = redis.call('ZRANGE', lru, 0, -1)
  for _, hex in ipairs(redis.call('HKEYS', sizes)) do table.insert(candidates, hex) end
  local seen, kept, total = {}, 0, 0
  for _, hex in ipairs(candidates) do
    if not seen[hex] then
      seen[hex] = true
      local mkey = pfx .. 'm:' .. hex
      local size = nat(redis.call('HGET', sizes, hex)) or meta_size(mkey)
      if size and redis.call('EXISTS', mkey) == 1 then
        redis.call('HSET', sizes, hex, size)
        redis.call('ZADD', lru, 'NX', 0, hex)
        kept, total = kept + 1, total + size
      else
        forget(pfx, hex)
      end
    end
  end
  redis.call('DEL', pfx .. 'usage')
  redis.call('SET', pfx .. 'usage', total)
  return {kept, total}
end

-- Whether the integer control key `key` is absent (when `absent_ok`) or holds an integer.
local function integer_ok(key, absent_ok)
  local k = kind(key)
  if k == 'none' then return absent_ok end
  return k == 'string' and nat(redis.call('GET', key)) ~= nil
end

-- Checks the control keys (NOTE 4, NOTE 5). Returns {status, keys, reason}: status is
-- 'ok', 'repaired' (usage or clock rebuilt) or 'corrupt' (lru or sizes of the wrong type).
local function check_control(pfx)
  local lru, sizes, usage, clock = pfx .. 'lru', pfx .. 'sizes', pfx .. 'usage', pfx .. 'clock'
  for _, want in ipairs({{lru, 'zset', 'a sorted set'}, {sizes, 'hash', 'a hash'}}) do
    local got = kind(want[1])
    if got ~= want[2] and got ~= 'none' then
      return {'corrupt', want[1], 'holds a ' .. got .. ', not ' .. want[3]}
    end
  end
  local keys, reasons = {}, {}
  if not integer_ok(clock, true) then
    local newest = redis.call('ZRANGE', lru, -1, -1, 'WITHSCORES')[2]
    local score = math.max(0, math.floor(tonumber(newest or '0') or 0))
    redis.call('DEL', clock)
    redis.call('SET', clock, score)
    table.insert(keys, clock)
    table.insert(reasons, 'clock was not an integer; reset to the newest LRU score ' .. score)
  end
  -- Cheap signs that usage no longer equals the sum of the recorded sizes: the entries of
  -- lru and sizes differ in number, or usage is not zero without entries.
  local entries = redis.call('ZCARD', lru)
  local drifted = redis.call('HLEN', sizes) ~= entries
    or (entries == 0 and kind(usage) == 'string' and redis.call('GET', usage) ~= '0')
  if drifted or not integer_ok(usage, entries == 0) then
    local r = rebuild(pfx)
    table.insert(keys, usage)
    table.insert(reasons, 'usage was not the sum of the recorded entry sizes; recomputed as '
      .. r[2] .. ' bytes from ' .. r[1] .. ' entries')
  end
  if #keys == 0 then return {'ok', '', ''} end
  return {'repaired', table.concat(keys, ' and '), table.concat(reasons, '; ')}
end
"#
    };
}

/// ARGV: prefix, capacity_bytes, then (hex, payload_len, meta) triples.
/// Returns {committed, evicted, usage_bytes, status, keys, reason} (`check_control`); when
/// the status is 'corrupt' nothing was committed and usage_bytes is 0.
pub const COMMIT: &str = concat!(
    control_lua!(),
    r#"
local pfx = ARGV[1]
local cap = tonumber(ARGV[2])
local lru, sizes, usage_key, clock = pfx .. 'lru', pfx .. 'sizes', pfx .. 'usage', pfx .. 'clock'
local control = check_control(pfx)
if control[1] == 'corrupt' then
  return {0, 0, 0, control[1], control[2], control[3]}
end
local committed = 0
for i = 3, #ARGV, 3 do
  local hex, size, meta = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local dkey = pfx .. 'd:' .. hex
  if redis.call('EXISTS', dkey) == 1 then
    -- Accounting first (NOTE 4). A store of a key already present replaces its payload
    -- (the pipeline just wrote it), so its metadata and accounted size are replaced too.
    local old = nat(redis.call('HGET', sizes, hex)) or 0
    redis.call('HSET', sizes, hex, size)
    redis.call('INCRBY', usage_key, size - old)
    redis.call('ZADD', lru, redis.call('INCR', clock), hex)
    redis.call('PERSIST', dkey)
    redis.call('SET', pfx .. 'm:' .. hex, meta)
    committed = committed + 1
  end
end
local used = tonumber(redis.call('GET', usage_key) or '0')
local evicted = 0
while used > cap do
  local victim = redis.call('ZPOPMIN', lru)
  if #victim == 0 then break end
  used = redis.call('DECRBY', usage_key, forget(pfx, victim[1]))
  evicted = evicted + 1
end
return {committed, evicted, used, control[1], control[2], control[3]}
"#
);

/// ARGV: prefix, then hexes. Marks them most recently used (only if still present). Leaves
/// the order alone while `lru` or `clock` is corrupt: reads go on, and `COMMIT` reports it.
pub const TOUCH: &str = concat!(
    control_lua!(),
    r#"
local pfx = ARGV[1]
local lru, clock = pfx .. 'lru', pfx .. 'clock'
local lru_kind = kind(lru)
if (lru_kind ~= 'zset' and lru_kind ~= 'none') or not integer_ok(clock, true) then
  return 0
end
for i = 2, #ARGV do
  redis.call('ZADD', lru, 'XX', redis.call('INCR', clock), ARGV[i])
end
return #ARGV - 1
"#
);

/// ARGV: prefix, then hexes. Deletes entries and their accounting.
/// Returns {deleted (entries that had metadata), usage_bytes, status, keys, reason}. While a
/// control key is corrupt the entries are still deleted, so that bad bytes are never served,
/// but usage is left for the repair to recompute and usage_bytes is 0.
pub const DROP: &str = concat!(
    control_lua!(),
    r#"
local pfx = ARGV[1]
local control = check_control(pfx)
local deleted = 0
for i = 2, #ARGV do
  local hex = ARGV[i]
  local mkey = pfx .. 'm:' .. hex
  deleted = deleted + redis.call('EXISTS', mkey)
  if control[1] == 'corrupt' then
    redis.call('DEL', mkey, pfx .. 'd:' .. hex)
  else
    redis.call('DECRBY', pfx .. 'usage', forget(pfx, hex))
  end
end
local used = 0
if control[1] ~= 'corrupt' then used = tonumber(redis.call('GET', pfx .. 'usage') or '0') end
return {deleted, used, control[1], control[2], control[3]}
"#
);
