-- The Redis + Lua baseline: the seeds' token bucket (seed 000, "Reserving an
-- estimate and refunding the difference"), generalised the way that seed
-- suggests for layered limits: one script over every layer's key (here the
-- tenant's and the global one), so the composite decision stays atomic and
-- costs one round trip. Each key is a hash with fields tokens and ts.
--
-- KEYS[i]  bucket of layer i
-- ARGV[1]  tokens requested
-- ARGV[2]  now, in milliseconds (the caller's clock, as in the seed)
-- ARGV[1 + 2i], ARGV[2 + 2i]  capacity and refill per second of layer i
-- Returns {1, tokens left in the first layer} or {0, seconds until it fits}.
local want = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local levels = {}
local wait = 0
for i, key in ipairs(KEYS) do
  local cap = tonumber(ARGV[1 + 2 * i])
  local rate = tonumber(ARGV[2 + 2 * i])
  local b = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens = tonumber(b[1]) or cap
  local ts = tonumber(b[2]) or now
  tokens = math.min(cap, tokens + (now - ts) / 1000 * rate)
  levels[i] = tokens
  if want > tokens then
    wait = math.max(wait, math.ceil((want - tokens) / rate))
  end
end

if wait > 0 then
  for i, key in ipairs(KEYS) do
    redis.call('HSET', key, 'tokens', levels[i], 'ts', now)
  end
  return {0, wait}
end

for i, key in ipairs(KEYS) do
  redis.call('HSET', key, 'tokens', levels[i] - want, 'ts', now)
  redis.call('PEXPIRE', key, 600000)
end
return {1, math.floor(levels[1] - want)}
