-- gptlua.observe.profiler — what a training step spends its time on: a
-- Chrome/Perfetto trace per rank and a table of the top ops, like
-- torch.profiler's trace and key_averages().
--
--   gptlua recipes/shakespeare.lua --profile=5       -- steps 2..6 (step 1 warms up)
--   gptlua recipes/shakespeare.lua --profile=10:15   -- steps 10..15 (as the log numbers them)
--   local prof = require('gptlua.observe.profiler').new{ rank = 0, device = 'cpu' }
--   prof:start(); ...; prof:stop(); prof:write('trace.json'); print(prof:table())
--
-- How it sees ops.  While a profile runs (and only then) every public op —
-- each function named in gl.signatures (gptlua/init.lua), wherever it is
-- reachable: gl.*, Tensor methods and operators — is replaced by a timing
-- wrapper, each autograd node's backward runs through A.profile_node, and
-- the collectives of gptlua.dist (Comm methods, Work:wait/test) are wrapped
-- too; stop() puts the originals back.  When no profile runs nothing is
-- wrapped: the ops cost exactly what they cost without a profiler, and
-- autograd pays one field test per node.
--
-- What the trace holds (pid = rank; times in microseconds from start()):
--   tid 1 "host": one complete ("X") event per op call, nested as the calls
--     nest (an op's children are the ops it calls), autograd nodes named
--     "<op> backward", and phases: step N, forward, backward, data (the
--     loader's next_batch: time waiting for input), optimizer, sync
--     (policy after_backward: waiting for gradient reductions), grad_norm;
--     blocking collectives with their bytes and group.
--   tid 2 "device: compute stream" (CUDA): each outermost op and autograd
--     node as the GPU ran it, timed by CUDA events recorded around it on the
--     compute stream (the profiler synchronises the device at each profiled
--     step's start and end, not inside it).
--   async collectives: begin/end ("b"/"e") events of their own, from issue
--     to the moment the host saw them complete (Work:wait or a true
--     Work:test), so their overlap with the backward's ops shows as a track.
-- The table (Profiler:table) sums calls per name: calls, total time
-- (inclusive), self time (total less the ops and phases inside), device
-- time, sorted by total.
local gl = require 'gptlua'
local A = require 'gptlua.autograd'
local Tensor = require 'gptlua.tensor'
local now = require('gptlua.cli').now

local M = {}
local Profiler = {}
Profiler.__index = Profiler

-- ---------------------------------------------------------- step ranges
-- "N" -> steps 2..N+1 (N steps after the first, which allocates and warms
-- up); "A:B" -> steps A..B.  Steps are numbered as the log prints them
-- (the first step is 1).  Returns first, last.
function M.parse_steps(spec)
  local s = tostring(spec)
  local n = s:match('^%s*(%d+)%s*$')
  if n and tonumber(n) >= 1 then return 2, tonumber(n) + 1 end
  local a, b = s:match('^%s*(%d+)%s*:%s*(%d+)%s*$')
  a, b = tonumber(a), tonumber(b)
  if a and b and a >= 1 and b >= a then return a, b end
  error(("config: profile expected N (profile N steps after the first) or A:B (steps A to B, 1 <= A <= B), "
    .. "got '%s'"):format(s), 0)
end

-- ------------------------------------------------------------- spans
-- The span stack: every open span (op, node, phase, collective) has a
-- start time and the time of the spans inside it (for self time).
function M.new(o)
  o = o or {}
  local self = setmetatable({
    rank = o.rank or 0, device = o.device or 'cpu', events = {}, stats = {}, order = {},
    stack_name = {}, stack_t = {}, stack_child = {}, depth = 0, op_depth = 0,
    saved = {}, active = false, pending = {}, pool = {}, npool = 0, async_id = 0,
  }, Profiler)
  self.cuda = self.device ~= 'cpu' and gl.cuda_available()
  return self
end

function Profiler:us(t) return (t - self.t0) * 1e6 end

local function stat(self, name, cat)
  local s = self.stats[name]
  if not s then
    s = { name = name, cat = cat, calls = 0, total = 0, self = 0, device = 0 }
    self.stats[name] = s
    self.order[#self.order + 1] = s
  end
  return s
end

-- opens a span; returns its start time
function Profiler:enter(name)
  local d = self.depth + 1
  self.depth = d
  local t = now()
  self.stack_name[d], self.stack_t[d], self.stack_child[d] = name, t, 0
  return t
end

-- closes the innermost span as a trace event of category cat (args: a
-- table for the trace, or nil); counted in the table unless cat is 'step'
function Profiler:leave(cat, args)
  local t1 = now()
  local d = self.depth
  if d < 1 then return end
  local name, t0, child = self.stack_name[d], self.stack_t[d], self.stack_child[d]
  self.depth = d - 1
  local dur = t1 - t0
  if d > 1 then self.stack_child[d - 1] = self.stack_child[d - 1] + dur end
  self.events[#self.events + 1] = { name = name, cat = cat, ph = 'X', ts = self:us(t0), dur = dur * 1e6,
    pid = self.rank, tid = 1, args = args }
  if cat ~= 'step' and cat ~= 'phase' then
    local s = stat(self, name, cat)
    s.calls, s.total, s.self = s.calls + 1, s.total + dur, s.self + dur - child
  end
end

-- a CUDA timing event from the pool (reused step after step)
function Profiler:cuda_event()
  local n = self.npool + 1
  self.npool = n
  local e = self.pool[n]
  if not e then
    e = require('gptlua.cuda').Event(self.device)
    self.pool[n] = e
  end
  return e
end

-- runs f(...) as a span; ops (kind 'op' or 'node') at the outermost op
-- level are also timed on the device
local function run_span(self, name, cat, is_op, f, ...)
  if not self.recording then return f(...) end  -- between profiled steps (eval, checkpoints)
  local dev0
  if is_op then
    if self.cuda and self.op_depth == 0 then dev0 = self:cuda_event():record() end
    self.op_depth = self.op_depth + 1
  end
  self:enter(name)
  local r = { f(...) }
  if is_op then self.op_depth = self.op_depth - 1 end
  if dev0 then
    local dev1 = self:cuda_event():record()
    self.pending[#self.pending + 1] = { name, cat, dev0, dev1 }
  end
  self:leave(cat)
  return unpack(r, 1, table.maxn(r))
end

-- f wrapped as a span of category cat
function Profiler:wrap(name, cat, f, is_op)
  local prof = self
  return function(...) return run_span(prof, name, cat, is_op, f, ...) end
end

-- replaces tbl[key] by v until stop() (restored as it was: an instance's
-- own field, or none so that its class's shows again)
function Profiler:replace(tbl, key, v)
  self.saved[#self.saved + 1] = { tbl, key, rawget(tbl, key) }
  rawset(tbl, key, v)
end

-- ------------------------------------------------------------ ops
-- Functions of gl.signatures that are not ops: shape arithmetic, argument
-- helpers, accessors, RNG state, hooks; backward is a phase.
local NOT_OPS = {
  broadcast_shape = true, same_shape = true, norm_dim = true, shape_of = true, drop_view = true,
  manual_seed = true, set_rng_state = true, rng_take = true, register_hook = true, requires_grad_ = true,
  backward = true, keep = true, stride = true, storage_offset = true, is_contiguous = true, numel = true,
  dim = true, size = true, is_floating = true, data_ptr = true, is_freed = true, free = true,
}

local OPERATORS = { __add = 'add', __sub = 'sub', __mul = 'mul', __div = 'div', __pow = 'pow', __mod = 'mod',
  __unm = 'neg' }

-- wraps every op where it is reachable: gl.*, the ops module, Tensor
-- methods and operators (one wrapper per function, found by identity)
function Profiler:wrap_ops()
  local O = require 'gptlua.ops'
  local names = {}
  for k in pairs(gl.signatures.ops) do
    if not NOT_OPS[k] and type(gl[k]) == 'function' then names[gl[k]] = k end
  end
  for k in pairs(gl.signatures.methods) do
    local f = rawget(Tensor, k)
    if not NOT_OPS[k] and type(f) == 'function' and not names[f] then names[f] = k end
  end
  -- operators: tensor.lua keeps its own operand-checking closure under each
  for k, op in pairs(OPERATORS) do
    local f = rawget(Tensor, k)
    if type(f) == 'function' and not names[f] then names[f] = op end
  end
  local wrappers = {}
  for f, k in pairs(names) do wrappers[f] = self:wrap(k, 'op', f, true) end
  for _, tbl in ipairs({ gl, O, Tensor }) do
    local keys = {}
    for k, v in pairs(tbl) do if wrappers[v] then keys[#keys + 1] = k end end
    for _, k in ipairs(keys) do self:replace(tbl, k, wrappers[tbl[k]]) end
  end
  -- autograd nodes: each node's backward (gptlua.autograd's hook)
  local prof = self
  A.profile_node = function(fn, g)
    return run_span(prof, (fn.name or 'op') .. ' backward', 'node', true, fn.backward, fn.saved, g, fn)
  end
  self:replace(Tensor, 'backward', self:wrap('backward', 'phase', Tensor.backward))
end

-- ------------------------------------------------------------ collectives
local function tensor_bytes(t) return t:numel() * gl.lib.gl_dtype_size((Tensor.dtype_id(t.dtype))) end
local function nbytes(x)
  if getmetatable(x) == Tensor then return tensor_bytes(x) end
  if type(x) == 'table' then
    local n = 0
    for _, t in ipairs(x) do if getmetatable(t) == Tensor then n = n + tensor_bytes(t) end end
    return n
  end
  return 0
end

-- bytes a collective moves per rank: the largest tensor argument (the
-- whole buffer of an all-reduce, the gathered side of an all-gather)
local function coll_bytes(...)
  local n = 0
  for i = 1, select('#', ...) do n = math.max(n, nbytes((select(i, ...)))) end
  return n
end

function Profiler:wrap_collectives()
  local dist = package.loaded['gptlua.dist']
  if not dist then return end
  local prof = self
  local names = {}
  for k, v in pairs(dist.Comm) do
    if type(v) == 'function' and (k:match('^all_') or k:match('^reduce') or k:match('^broadcast')
        or k:match('^gather') or k:match('^scatter') or k:match('^barrier') or k:match('^send')
        or k:match('^recv')) and k ~= 'all_reduce_number' then
      names[#names + 1] = k
    end
  end
  for _, k in ipairs(names) do
    local f = dist.Comm[k]
    local base = k:gsub('_async$', '')
    self:replace(dist.Comm, k, function(comm, ...)
      if not prof.recording then return f(comm, ...) end
      local args = { group = comm.name, ranks = comm.size, bytes = coll_bytes(...) }
      local nargs = select('#', ...)
      local opts = nargs > 0 and select(nargs, ...) or nil
      local async = k:match('_async$') or (type(opts) == 'table' and getmetatable(opts) ~= Tensor and opts.async)
      if not async then
        prof:enter(base)
        local r = f(comm, ...)
        prof:leave('collective', args)
        return r
      end
      -- async: a begin event now, the end when the host sees it complete
      prof.async_id = prof.async_id + 1
      local t0 = now()
      local work = f(comm, ...)
      local rec = { name = base .. ' (async)', id = prof.async_id, t0 = t0, args = args }
      prof.events[#prof.events + 1] = { name = rec.name, cat = 'collective', ph = 'b', id = rec.id,
        ts = prof:us(t0), pid = prof.rank, tid = 3, args = args }
      rawset(work, '_prof', rec)
      if work.done then prof:async_done(work) end
      return work
    end)
  end
  for _, k in ipairs({ 'wait', 'test' }) do
    local f = dist.Work[k]
    self:replace(dist.Work, k, function(work, ...)
      local r = f(work, ...)
      if work.done and rawget(work, '_prof') then prof:async_done(work) end
      return r
    end)
  end
end

function Profiler:async_done(work)
  local rec = work._prof
  work._prof = nil
  local t1 = now()
  self.events[#self.events + 1] = { name = rec.name, cat = 'collective', ph = 'e', id = rec.id,
    ts = self:us(t1), pid = self.rank, tid = 3 }
  -- in flight, not host time: a total without self time (it overlaps the spans the host ran meanwhile)
  local s = stat(self, rec.name, 'collective')
  s.calls, s.total = s.calls + 1, s.total + (t1 - rec.t0)
end

-- ------------------------------------------------------------ session
-- the device's clock against the host's: waits for the device, then
-- records a base event (a dedicated one, never reused by the pool) whose
-- host time is known; device events are placed relative to it
function Profiler:mark_base()
  if not self.cuda then return end
  local cuda = require 'gptlua.cuda'
  cuda.synchronize(self.device)
  self.base_event = self.base_event or cuda.Event(self.device)
  self.base_event:record()
  self.base_us = self:us(now())
end

function Profiler:start()
  if self.active then return end
  self.active, self.recording = true, true
  self.t0 = self.t0 or now()
  self:mark_base()
  self:wrap_ops()
  self:wrap_collectives()
end

function Profiler:stop()
  if not self.active then return end
  self:flush_device()
  for i = #self.saved, 1, -1 do
    local s = self.saved[i]
    rawset(s[1], s[2], s[3])
  end
  self.saved = {}
  A.profile_node = nil
  self.active, self.recording = false, false
end

-- Device times of the ops since the last flush: waits for the device, then
-- reads each op's pair of events, placed against the base event (mark_base).
function Profiler:flush_device()
  if not self.cuda or #self.pending == 0 then self.pending = {}; self.npool = 0; return end
  require('gptlua.cuda').synchronize(self.device)
  local base, base_us = self.base_event, self.base_us
  for _, p in ipairs(self.pending) do
    local name, cat, e0, e1 = p[1], p[2], p[3], p[4]
    local ms = e0:elapsed_time(e1)
    local start_ms = base:elapsed_time(e0)
    self.events[#self.events + 1] = { name = name, cat = 'device', ph = 'X', ts = base_us + start_ms * 1000,
      dur = ms * 1000, pid = self.rank, tid = 2, args = { kind = cat } }
    local s = stat(self, name, cat)
    s.device = s.device + ms / 1000
  end
  self.pending, self.npool = {}, 0
end

-- a profiled step's boundaries: the device is idle at both, so device
-- times line up with the host clock
function Profiler:step_begin(step)
  self:flush_device()
  self:mark_base()
  self.depth, self.op_depth, self.recording = 0, 0, true
  self:enter('step ' .. step)
  self.steps = (self.steps or 0) + 1
  self.first_step = self.first_step or step
  self.last_step = step
end

function Profiler:step_end()
  if self.cuda then require('gptlua.cuda').synchronize(self.device) end
  while self.depth > 1 do self:leave('op') end  -- spans an error left open
  self:leave('step')
  self.recording = false
  self:flush_device()
end

-- ------------------------------------------------------------ output
-- the trace as a Chrome trace-event table
function Profiler:trace()
  local meta = {
    { name = 'process_name', ph = 'M', pid = self.rank, tid = 0, args = { name = 'rank ' .. self.rank } },
    { name = 'process_sort_index', ph = 'M', pid = self.rank, tid = 0, args = { sort_index = self.rank } },
    { name = 'thread_name', ph = 'M', pid = self.rank, tid = 1, args = { name = 'host' } },
    { name = 'thread_name', ph = 'M', pid = self.rank, tid = 2, args = { name = 'device: compute stream' } },
    { name = 'thread_name', ph = 'M', pid = self.rank, tid = 3, args = { name = 'collectives (async)' } },
  }
  local ev = {}
  for _, e in ipairs(meta) do ev[#ev + 1] = e end
  for _, e in ipairs(self.events) do ev[#ev + 1] = e end
  return { traceEvents = ev, displayTimeUnit = 'ms',
           otherData = { rank = self.rank, device = self.device, steps = self.steps,
                         first_step = self.first_step, last_step = self.last_step } }
end

-- writes the trace (JSON) to path atomically (a temp file renamed)
function Profiler:write(path)
  local cjson = require 'cjson'
  local dir = path:match('^(.*)/[^/]*$')
  if dir then require('gptlua.checkpoint').mkdir_p(dir) end
  local tmp = path .. '.tmp'
  local f, err = io.open(tmp, 'wb')
  if not f then error(('profile: cannot write %s (%s)'):format(tmp, tostring(err)), 0) end
  local ok, werr = f:write(cjson.encode(self:trace()))
  f:close()
  if not ok then os.remove(tmp); error(('profile: cannot write %s (%s)'):format(tmp, tostring(werr)), 0) end
  local rok, rerr = os.rename(tmp, path)
  if not rok then os.remove(tmp); error(('profile: cannot rename %s to %s (%s)'):format(tmp, path, tostring(rerr)), 0) end
  return path
end

-- the rows of the table: name, cat, calls, total, self, device (seconds),
-- sorted by total time, largest first
function Profiler:key_averages()
  local rows = {}
  for _, s in ipairs(self.order) do rows[#rows + 1] = s end
  table.sort(rows, function(a, b)
    if a.total ~= b.total then return a.total > b.total end
    return a.name < b.name
  end)
  return rows
end

-- the top n rows (default 20) as text
function Profiler:table(n)
  n = n or 20
  local rows = self:key_averages()
  local all_self = 0
  for _, r in ipairs(rows) do all_self = all_self + r.self end
  local out = {}
  local hdr = ('%-32s %-10s %7s %11s %11s %8s %10s'):format('name', 'kind', 'calls', 'total ms', 'self ms',
    'self %', 'avg us')
  if self.cuda then hdr = hdr .. ('  %11s'):format('device ms') end
  out[1] = hdr
  out[2] = ('-'):rep(#hdr)
  for i = 1, math.min(n, #rows) do
    local r = rows[i]
    local line = ('%-32s %-10s %7d %11.3f %11.3f %7.1f%% %10.1f'):format(r.name:sub(1, 32), r.cat, r.calls,
      r.total * 1e3, r.self * 1e3, all_self > 0 and 100 * r.self / all_self or 0, r.total * 1e6 / r.calls)
    if self.cuda then line = line .. ('  %11.3f'):format(r.device * 1e3) end
    out[#out + 1] = line
  end
  return table.concat(out, '\n')
end

-- ------------------------------------------------------------ trainer
-- The trainer's profiler (cfg.profile, '' = off): wraps this trainer's
-- train_step, so the steps in range run profiled with their data loader,
-- forward, policy and optimizer as phases; after the last one (or the
-- run's last step) it writes <run_dir>/profile/trace.rank<R>.json and rank
-- 0 prints the table.  Returns nil when the config asks for no profile.
function M.for_trainer(tr)
  local spec = tr.cfg.profile
  if spec == nil or spec == '' or spec == false then return nil end
  local first, last = M.parse_steps(spec)
  if first > tr.cfg.max_iters then
    error(('config: profile starts at step %d, after the run\'s last step (max_iters = %d)'):format(first,
      tr.cfg.max_iters), 0)
  end
  local prof = M.new({ rank = tr.rank, device = tr.cfg.device })
  local inner = tr.train_step
  local function phases()
    prof:replace(tr.data.train, 'next_batch', prof:wrap('data', 'data', tr.data.train.next_batch))
    prof:replace(tr.model, 'forward', prof:wrap('forward', 'phase', tr.model.forward))
    local pol = tr.policy
    prof:replace(pol, 'step', prof:wrap('optimizer', 'optimizer', pol.step))
    prof:replace(pol, 'after_backward', prof:wrap('sync', 'sync', pol.after_backward))
    prof:replace(pol, 'grad_norm', prof:wrap('grad_norm', 'phase', pol.grad_norm))
  end
  tr.train_step = function(self)
    local step = self.step + 1
    if step < first or step > last then return inner(self) end
    if not prof.active then prof:start(); phases() end
    prof:step_begin(step)
    local r = { inner(self) }
    prof:step_end()
    if step == last or step >= self.cfg.max_iters then
      prof:stop()
      local path = prof:write(('%s/profile/trace.rank%d.json'):format(self.run_dir, self.rank))
      self:print(('profile: steps %d-%d, trace %s (chrome://tracing or ui.perfetto.dev)'):format(
        prof.first_step, prof.last_step, path))
      self:print(prof:table())
      -- the window is what was asked for: the run stops here (saving a checkpoint, as Ctrl-C does)
      -- unless --profile_continue; every rank decides at the same step, so no vote is needed
      if not self.cfg.profile_continue and step < self.cfg.max_iters then
        self.stop_signal, self.stop_agreed, self.stop_reason = true, true, 'profile'
        self:print(('profile: done; the run stops after step %d (--profile_continue trains on)'):format(step))
      end
    end
    return unpack(r, 1, table.maxn(r))
  end
  return prof
end

return M
