-- gptlua.observe.stragglers — which rank holds the others up.
--
-- Over each log interval every rank sums its step time and the time its
-- host spent blocked in collectives (gptlua.dist's wait_seconds); compute
-- is the difference.  At the log step one all-reduce of 2 x world numbers
-- gives every rank everyone's; a rank whose compute exceeds the median of
-- the other ranks' by more than straggler_threshold (a fraction; the
-- others', so that on 2 ranks the slow one is measured against the fast
-- one, not against a mean it is part of) is a straggler: named on the
-- log and in the metrics record (stragglers, and per rank compute_ms and
-- wait_ms per step).  A slow rank computes longer and waits less; the
-- others wait for it in their collectives, so their compute stays near the
-- median and only the slow one stands out.  Off on one rank, with
-- straggler_threshold = 0, and under policies whose ranks do not meet every
-- step (ps's asynchronous servers).
--
-- Test hook: GPTLUA_TEST_SLOW_RANK=R:MS sleeps MS milliseconds inside every
-- training step of rank R (a deterministic straggler for the specs).
local gl = require 'gptlua'
local ffi = require 'ffi'

local M = {}
local S = {}
S.__index = S

function M.for_trainer(t)
  if not (t.comm and t.world > 1) or t.cfg.straggler_threshold <= 0 or t.policy.asynchronous then return nil end
  local self = setmetatable({ comm = t.comm, threshold = t.cfg.straggler_threshold, step_s = 0, steps = 0,
    wait0 = t.dist.wait_seconds, dist = t.dist }, S)
  local hook = os.getenv('GPTLUA_TEST_SLOW_RANK')
  local r, ms = (hook or ''):match('^(%d+):(%d+)$')
  if r and tonumber(r) == t.rank then
    require 'gptlua.libc'   -- poll
    local step = t.train_step
    t.train_step = function(...)
      ffi.C.poll(nil, 0, tonumber(ms))
      return step(...)
    end
  end
  return self
end

-- one training step of dt seconds (the wait inside it is dist's counter)
function S:step(dt)
  self.step_s, self.steps = self.step_s + dt, self.steps + 1
end

local function median(xs)
  local s = {}
  for i, v in ipairs(xs) do s[i] = v end
  table.sort(s)
  local n = #s
  return n % 2 == 1 and s[(n + 1) / 2] or (s[n / 2] + s[n / 2 + 1]) / 2
end

-- At a log step (every rank): gathers the interval's numbers, adds them to
-- rec, and returns the line naming the stragglers (nil when none).
function S:report(rec)
  local N, me = self.comm.size, self.comm.rank
  local buf = self.buf or gl.zeros({ 2 * N }, { dtype = 'float64' }):keep()
  self.buf = buf
  buf:zero_()
  local wait = self.dist.wait_seconds - self.wait0
  local steps = math.max(self.steps, 1)
  local d = ffi.cast('double *', buf:data_ptr())
  d[2 * me], d[2 * me + 1] = 1000 * math.max(self.step_s - wait, 0) / steps, 1000 * math.min(wait, self.step_s) / steps
  local sent = self.comm.sent_bytes
  self.comm:all_reduce(buf, 'sum')
  self.comm.sent_bytes = sent   -- the report's bytes are not the training's (comm_bytes, the policies' counts)
  local compute, waits = {}, {}
  for r = 0, N - 1 do compute[r + 1], waits[r + 1] = d[2 * r], d[2 * r + 1] end
  self.step_s, self.steps, self.wait0 = 0, 0, self.dist.wait_seconds
  rec.compute_ms, rec.wait_ms = compute, waits
  local slow, named = {}, {}
  for r = 0, N - 1 do
    local others = {}
    for q = 0, N - 1 do if q ~= r then others[#others + 1] = compute[q + 1] end end
    local mid = median(others)
    if compute[r + 1] > mid * (1 + self.threshold) then
      slow[#slow + 1] = r
      named[#named + 1] = ('rank %d computes %.1f ms/step, %.1fx the others\' median %.1f ms'):format(r,
        compute[r + 1], compute[r + 1] / math.max(mid, 1e-9), mid)
    end
  end
  if #slow == 0 then return nil end
  rec.stragglers = slow
  return ('stragglers at step %d (compute more than %d%% over the other ranks\' median): %s'):format(rec.step,
    math.floor(100 * self.threshold + 0.5), table.concat(named, '; '))
end

return M
