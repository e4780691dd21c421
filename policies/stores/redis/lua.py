"""Lua scripts of the Redis store. Each runs atomically inside Redis: no read-then-write in Python.

They mirror `policies/stores/token_bucket.py` and `policies/stores/_engine.py` (the same token-bucket rules, the
same all-or-nothing acquire). Numbers travel as '%.17g' strings so doubles survive the round trip.
Expiries are relative (PEXPIRE), computed from the caller's clock, so an injected test clock and the
Redis server's clock never have to agree.
"""

from __future__ import annotations

_COMMON = """
local EPS = 1e-6
local function fmt(x) return string.format('%.17g', x) end
local function drain(key, rate, now)
  local st = redis.call('HMGET', key, 'l', 't')
  if not st[1] then return 0, now end
  local level, ts = tonumber(st[1]), tonumber(st[2])
  local el = now - ts
  if el < 0 then el = 0 end
  level = level - el * rate
  if level < 0 then level = 0 end
  if ts < now then ts = now end
  return level, ts
end
local function store_bucket(key, level, ts, rate)
  redis.call('HSET', key, 'l', fmt(level), 't', fmt(ts))
  -- once drained the bucket is as good as absent: let Redis forget it then
  redis.call('PEXPIRE', key, math.ceil(level / rate * 1000) + 1000)
end
local function extend(key, ms)
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, ms) end
end
"""

# KEYS: bucket keys (nb), lease keys (nl), counter keys (nc), journal hash
# ARGV: now, lease_id, lease_ttl_s, nb, nl, nc, [capacity, rate, cost] * nb, [limit] * nl,
#       [limit (-1: none), cost, ttl_s] * nc, journal payload ('' = none)
# Returns: ok, [remaining, reset_s] * nb, [counter value] * nc, [kind, index, retry (-1: none)] * denials
ACQUIRE = (
    _COMMON
    + """
local now, lease_id, ttl = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local nb, nl, nc = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local a = 7
local denials = {}
local levels, stamps, caps, rates, costs = {}, {}, {}, {}, {}
for i = 1, nb do
  caps[i], rates[i], costs[i] = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  levels[i], stamps[i] = drain(KEYS[i], rates[i], now)
  if levels[i] + costs[i] > caps[i] + EPS then
    local retry = '-1'
    if costs[i] <= caps[i] + EPS then
      retry = fmt(math.max(0, (levels[i] + costs[i] - caps[i]) / rates[i]))
    end
    table.insert(denials, 'bucket'); table.insert(denials, tostring(i - 1)); table.insert(denials, retry)
  end
end
for j = 1, nl do
  local key, limit = KEYS[nb + j], tonumber(ARGV[a])
  a = a + 1
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('ZCARD', key) >= limit then
    table.insert(denials, 'lease'); table.insert(denials, tostring(j - 1)); table.insert(denials, '-1')
  end
end
local used, ccosts, cttls, cargs = {}, {}, {}, {}
for k = 1, nc do
  local key, limit = KEYS[nb + nl + k], tonumber(ARGV[a])
  ccosts[k], cttls[k], cargs[k] = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), a + 1
  a = a + 3
  used[k] = tonumber(redis.call('GET', key) or '0')
  if limit >= 0 and used[k] + ccosts[k] > limit then
    table.insert(denials, 'counter'); table.insert(denials, tostring(k - 1)); table.insert(denials, '-1')
  end
end
local ok = #denials == 0
local out = {ok and '1' or '0'}
for i = 1, nb do
  local level = levels[i]
  if ok then
    level = level + costs[i]
    store_bucket(KEYS[i], level, stamps[i], rates[i])
  end
  table.insert(out, fmt(math.max(0, math.floor(caps[i] - level + EPS))))
  table.insert(out, fmt(level / rates[i]))
end
if ok then
  for j = 1, nl do
    redis.call('ZADD', KEYS[nb + j], now + ttl, lease_id)
    extend(KEYS[nb + j], math.ceil(ttl * 1000) + 1000)
  end
end
for k = 1, nc do
  if ok then
    used[k] = redis.call('INCRBY', KEYS[nb + nl + k], ARGV[cargs[k]])  -- the integer as sent
    extend(KEYS[nb + nl + k], math.ceil(cttls[k] * 1000))
  end
  table.insert(out, fmt(used[k]))
end
if ok and ARGV[a] ~= '' then redis.call('HSET', KEYS[nb + nl + nc + 1], lease_id, ARGV[a]) end
for _, v in ipairs(denials) do table.insert(out, v) end
return out
"""
)

# KEYS: settle marker, bucket keys (nb), lease keys (nl), counter keys (nc), usage keys (nu), usage
#       index, journal hash, mark map keys (nm)
# ARGV: now, lease_id, marker_ttl_s, nb, nl, nc, nu, nm, [capacity, rate, delta] * nb, [delta, ttl_s] * nc,
#       [requests, tokens, cost in micro-USD, index member] * nu, [field, value] * nm
# Returns: 1 when applied, 0 when this settle id was applied before, 2 when one of its marks is
# already set to another value (another attempt's settlement carries that record: nothing applied).
# The marker is written last: Redis does not roll back a script that fails half-way, and a marker
# written first would make the retry of such a settle a no-op with its work half done.
SETTLE = (
    _COMMON
    + """
local now, lease_id, marker_ttl = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local nb, nl, nc, nu = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local nm = tonumber(ARGV[8])
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local am = 9 + 3 * nb + 2 * nc + 4 * nu
for m = 1, nm do
  local found = redis.call('HGET', KEYS[3 + nb + nl + nc + nu + m], ARGV[am + 2 * (m - 1)])
  if found and found ~= ARGV[am + 2 * (m - 1) + 1] then return 2 end
end
local a = 9
for i = 1, nb do
  local key, rate, delta = KEYS[1 + i], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  local level, ts = drain(key, rate, now)
  level = level + delta
  if level < 0 then level = 0 end
  store_bucket(key, level, ts, rate)
end
for j = 1, nl do
  redis.call('ZREM', KEYS[1 + nb + j], lease_id)
end
for k = 1, nc do
  local key, delta, ttl = KEYS[1 + nb + nl + k], tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  a = a + 2
  if redis.call('INCRBY', key, ARGV[a - 2]) < 0 then redis.call('SET', key, '0', 'KEEPTTL') end
  extend(key, math.ceil(ttl * 1000))
end
local index = KEYS[2 + nb + nl + nc + nu]
for u = 1, nu do
  local key = KEYS[1 + nb + nl + nc + u]
  redis.call('HINCRBY', key, 'requests', ARGV[a])
  redis.call('HINCRBY', key, 'tokens', ARGV[a + 1])
  if ARGV[a + 2] ~= '0' then redis.call('HINCRBY', key, 'cost', ARGV[a + 2]) end
  redis.call('SADD', index, ARGV[a + 3])
  a = a + 4
end
redis.call('HDEL', KEYS[3 + nb + nl + nc + nu], lease_id)
for m = 1, nm do
  redis.call('HSET', KEYS[3 + nb + nl + nc + nu + m], ARGV[a], ARGV[a + 1])
  a = a + 2
end
redis.call('SET', KEYS[1], '1', 'PX', math.ceil(marker_ttl * 1000))
return 1
"""
)

# KEYS: lease keys; ARGV: lease_id, expires_at (epoch s, caller's clock), ttl_s
RENEW = (
    _COMMON
    + """
for i = 1, #KEYS do
  if redis.call('ZSCORE', KEYS[i], ARGV[1]) then
    redis.call('ZADD', KEYS[i], 'XX', tonumber(ARGV[2]), ARGV[1])
    extend(KEYS[i], math.ceil(tonumber(ARGV[3]) * 1000) + 1000)
  end
end
return 1
"""
)

# KEYS: key hash, key index set; ARGV: key_id, then field/value pairs
PUT_KEY = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

# KEYS: key hash; ARGV: now
TOUCH_KEY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local old = tonumber(redis.call('HGET', KEYS[1], 'last_used_at') or '0')
if tonumber(ARGV[1]) > old then redis.call('HSET', KEYS[1], 'last_used_at', ARGV[1]) end
return 1
"""

REVOKE_KEY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSETNX', KEYS[1], 'revoked_at', ARGV[1])
return 1
"""
