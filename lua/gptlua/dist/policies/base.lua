-- gptlua.dist.policies.base — what the data-parallel policies share.
--
-- Gradients travel in buckets: flat buffers holding several parameters'
-- gradients, planned in reverse order of the parameter list (the order in
-- which backward finishes them, roughly: last layer first).  Every
-- parameter gets a gradient-ready hook (autograd fires it once per backward
-- when the leaf's .grad is final); when a bucket's last parameter reports,
-- the policy starts that bucket's collective asynchronously, so it overlaps
-- the rest of backward.  Buckets start strictly in bucket order, which is
-- the same on every rank, so the ranks issue their collectives in the same
-- order whatever order the hooks fire in.  MPI moves data only inside MPI
-- calls, so every hook also calls dist.progress().
--
-- A policy built on Base provides _launch(bucket) (start the bucket's
-- collective, or do nothing on a micro-step that does not communicate) and
-- _finish() (wait for what was started), optionally _take_grad(bucket, p)
-- (a final gradient, as it arrives); Base drives them from the hooks and
-- from after_backward.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local G = require 'gptlua.ffi'
local Tensor = gl.Tensor
local ffi, lib = G.ffi, G.lib
local optim = require 'gptlua.optim'

local B = {}

-- ------------------------------------------------------------- buffers --
-- A flat zero-filled buffer of n elements (kept: outlives the trainer's
-- per-step tensor scopes).
function B.flat(n, dtype, device)
  return gl.zeros({ n }, { dtype = dtype, device = device }):keep()
end

-- A contiguous view of `shape` at element `off` of the contiguous buffer
-- buf, outside autograd.  keep: the view outlives tensor scopes.
function B.view(buf, off, shape, keep)
  local v = buf:_as_strided(shape, Tensor.contiguous_strides(shape), buf:storage_offset() + off)
  if keep ~= false then v:keep() end
  return v
end

-- param -> {opt, group, name, kind} for every parameter the optimizer updates
-- (the sharded policies zero1/zero2/fsdp/hsdp update these two kinds only)
function B.owners(optimizer, name)
  local own = {}
  for _, o in ipairs(optimizer.optimizers or { optimizer }) do
    local mt = getmetatable(o)
    local kind = (mt == optim.AdamW and 'adamw') or (mt == optim.Muon and 'muon') or nil
    if not kind then
      error(("dist.policy: %s shards optim.AdamW and optim.Muon (alone or in optim.Combined), "
        .. "got another optimizer; use dist = 'ddp' for it"):format(name), 4)
    end
    for _, g in ipairs(o.groups) do
      for i, p in ipairs(g.params) do own[p] = { opt = o, group = g, name = g.names[i], kind = kind } end
    end
  end
  return own
end

-- A wrapping policy (tp's, pp's) passes these calls to the policy it wraps
-- (self.inner) unchanged: one definition for both.
function B.delegate_to_inner(P)
  function P:average_number(x) return self.inner:average_number(x) end
  function P:scale_grads(s) return self.inner:scale_grads(s) end
  function P:step() return self.inner:step() end
  function P:detach() if self.inner.detach then self.inner:detach() end end
  function P:optimizer_state_bytes()
    return self.inner.optimizer_state_bytes and self.inner:optimizer_state_bytes() or 0
  end
end

function B.bytes(t) return t:numel() * lib.gl_dtype_size(t.c.dtype) end

-- bytes of an optimizer's state held on this rank (every tensor of every
-- parameter's state; a combined optimizer's parts summed)
function B.optimizer_state_bytes(optimizer)
  local n = 0
  for _, o in ipairs(optimizer.optimizers or { optimizer }) do
    for _, st in pairs(o.state or {}) do for _, t in pairs(st) do n = n + B.bytes(t) end end
  end
  return n
end

-- sum of squares of a tensor's elements, in double
local sumsq_buf = ffi.new('double[1]')
function B.sumsq(t)
  G.check(lib.gl_sumsq(t.c, sumsq_buf), 2)
  return sumsq_buf[0]
end

-- The float64 sum of squares of every tensor of list (gl.global_norm
-- without the root): one gl_sumsq_multi per device.
B.sumsq_list = require('gptlua.ops').sumsq_list

-- Makes every rank's parameters equal rank 0's: one broadcast per dtype
-- and device through a temporary flat buffer.
function B.broadcast_params(comm, params)
  if comm.size == 1 then return end
  local groups, order = {}, {}
  for _, p in ipairs(params) do
    local k = p.dtype .. '@' .. p.device
    if not groups[k] then groups[k] = {}; order[#order + 1] = k end
    local g = groups[k]
    g[#g + 1] = p
  end
  for _, k in ipairs(order) do
    local list, n = groups[k], 0
    for _, p in ipairs(list) do n = n + p:numel() end
    local buf = gl.empty({ n }, { dtype = list[1].dtype, device = list[1].device })
    local off = 0
    for _, p in ipairs(list) do
      G.check(lib.gl_copy(B.view(buf, off, p.shape, false).c, p.c)); off = off + p:numel()
    end
    comm:broadcast(buf, 0)
    off = 0
    for _, p in ipairs(list) do
      G.check(lib.gl_copy(p.c, B.view(buf, off, p.shape, false).c)); off = off + p:numel()
    end
    buf:free()
  end
end

-- Splits a list of parameters (in completion order) into consecutive runs
-- of one dtype and device of at most cap_bytes each (a larger parameter
-- forms a bucket alone).  Returns a list of lists.
function B.plan(params, cap_bytes)
  local out, cur, bytes = {}, nil, 0
  for _, p in ipairs(params) do
    local nb = B.bytes(p)
    if cur == nil or cur.dtype ~= p.dtype or cur.device ~= p.device or (#cur > 0 and bytes + nb > cap_bytes) then
      cur = { dtype = p.dtype, device = p.device }
      out[#out + 1] = cur
      bytes = 0
    end
    cur[#cur + 1] = p
    bytes = bytes + nb
  end
  return out
end

-- The parameters that take part, in order: requires_grad ones, each once.
function B.trainable(params)
  local out, seen = {}, {}
  for _, p in ipairs(params) do
    if p.requires_grad and not seen[p] then seen[p] = true; out[#out + 1] = p end
  end
  return out
end

-- ---------------------------------------------------------------- Base --
local Base = {}
Base.__index = Base
B.Base = Base

local function check_opts(name, o)
  if type(o) ~= 'table' then error(('dist.policy: %s expected an options table, got %s'):format(name, type(o)), 5) end
  if type(o.params) ~= 'table' or #o.params == 0 then
    error(('dist.policy: %s expected opts.params, a non-empty list of parameters'):format(name), 5)
  end
  for i, p in ipairs(o.params) do
    if not gl.is_tensor(p) then
      error(('dist.policy: %s expected opts.params[%d] to be a tensor, got %s'):format(name, i, type(p)), 5)
    end
  end
  if type(o.optimizer) ~= 'table' or type(o.optimizer.step) ~= 'function' then
    error(('dist.policy: %s expected opts.optimizer, an optimizer with step()'):format(name), 5)
  end
  local mb = o.bucket_mb or 25
  if type(mb) ~= 'number' or not (mb > 0) then
    error(('dist.policy: %s expected bucket_mb > 0, got %s'):format(name, tostring(o.bucket_mb)), 5)
  end
end

-- Common fields: comm (default: the world), params, optimizer, the bucket
-- cap in bytes, and the hook state.
function Base.init(self, name, o)
  check_opts(name, o)
  self.name = name
  self.comm = o.comm or dist.init()
  self.params = B.trainable(o.params)
  self.optimizer = o.optimizer
  self.cap_bytes = math.floor((o.bucket_mb or 25) * 2 ^ 20)
  self.buckets, self.bucket_of = {}, {}
  self.sync = true          -- does this backward communicate (DDP no_sync)
  self.final = true         -- is it the step's last micro-step
  self.next_launch = 1      -- the next bucket to start, in bucket order
  self.hooks = {}
  -- overlap = false starts every collective after backward instead of from
  -- the hooks (recipes/tools/bench_ddp_overlap.lua measures what overlapping hides)
  self.overlap = o.overlap ~= false
  return self
end

-- Orders the buckets by when backward completes them: a bucket is full once
-- its latest parameter (in completion order `order`) reports.
function Base:_order_buckets(order)
  local pos = {}
  for i, p in ipairs(order) do pos[p] = i end
  for i, b in ipairs(self.buckets) do
    b.index0 = i
    b.done_at = 0
    for _, p in ipairs(b.params) do b.done_at = math.max(b.done_at, pos[p]) end
  end
  table.sort(self.buckets, function(x, y)
    if x.done_at ~= y.done_at then return x.done_at < y.done_at end
    return x.index0 < y.index0
  end)
  for i, b in ipairs(self.buckets) do
    b.id, b.ready = i, 0
    for _, p in ipairs(b.params) do self.bucket_of[p] = b end
  end
end

function Base:_install_hooks()
  for _, p in ipairs(self.params) do
    local fn = function(t) self:_grad_ready(t) end
    p:register_hook(fn)
    self.hooks[#self.hooks + 1] = { p, fn }
  end
end

-- Removes this policy's hooks from the parameters (a model wrapped again).
function Base:detach()
  for _, h in ipairs(self.hooks) do
    local list = h[1]._hooks
    for i = #list, 1, -1 do if list[i] == h[2] then table.remove(list, i) end end
  end
  self.hooks = {}
end

function Base:_grad_ready(p)
  local b = self.bucket_of[p]
  if b and self.sync and self.overlap then
    if self._take_grad then self:_take_grad(b, p) end
    b.ready = b.ready + 1
    if b.ready == #b.params then self:_launch_full() end
  end
  self:_poll()
  dist.progress()
end

-- starts the full buckets at the front of the order
function Base:_launch_full()
  local bs = self.buckets
  while self.next_launch <= #bs and bs[self.next_launch].ready == #bs[self.next_launch].params do
    self:_launch(bs[self.next_launch])
    self.next_launch = self.next_launch + 1
  end
end

-- starts every bucket not started yet (parameters that got no gradient
-- never report)
function Base:_launch_rest()
  local bs = self.buckets
  while self.next_launch <= #bs do
    self:_launch(bs[self.next_launch])
    self.next_launch = self.next_launch + 1
  end
end

function Base:_reset_hooks()
  for _, b in ipairs(self.buckets) do b.ready = 0 end
  self.next_launch = 1
end

-- completes finished collectives without blocking (policies that overlap
-- work across micro-steps override it)
function Base:_poll() end

-- ------------------------------------------------- the policy interface --
-- On micro-steps before the last, gradients accumulate locally (DDP's
-- no_sync) unless the policy reduces every micro-step (ZeRO-2).
function Base:before_micro_step(micro, accum)
  self.final = micro == accum
  self.sync = self.final or self.reduce_every_micro_step == true
  self:_reset_hooks()
end

-- Launches what backward did not, waits for every reduction.
function Base:after_backward()
  self.final, self.sync = true, true
  self:_launch_rest()
  self:_finish()
  self:_reset_hooks()
end

function Base:average_number(x) return self.comm:all_reduce_number(x, 'avg') end

return B
