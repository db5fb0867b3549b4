-- gptlua.dist.policies.zero — ZeRO-1/2: optimizer state sharded over ranks,
-- for AdamW and Muon (alone, or in optim.Combined as nanochat's split).
--
-- Parameters are laid out in flat buffers (each parameter becomes a view
-- into its bucket's buffer) whose length is padded to a multiple of the
-- ranks N, so rank r owns the contiguous slice [r*c, (r+1)*c), c = len/N:
--   sharded AdamW  parameters of >= MIN_SHARD elements, bucketed in reverse
--                  order; a slice may cut parameters anywhere: the update
--                  runs the C kernel on each parameter's part of the slice
--                  (start, len), with that parameter's group settings, and
--                  keeps m and v for the slice only;
--   Muon stacks    the K matrices of one shape that Muon updates, stacked
--                  and padded with zero matrices to N*ceil(K/N): rank r owns
--                  whole matrices, runs momentum + Newton–Schulz (and the
--                  variant's steps: optim.Muon.update_direction) on them
--                  only and keeps their momentum buffers (and NorMuon's
--                  second moments) only;
--   replicated     AdamW parameters under MIN_SHARD elements: all-reduced
--                  and updated on every rank (not worth a collective each).
-- Gradients reach the owner by reduce-scatter (average).  zero1 keeps full
-- gradient buffers (accumulation is local; reduce-scatter on the last
-- micro-step, from the gradient-ready hooks).  zero2 keeps only the
-- averaged shard: on every micro-step each gradient moves into its bucket's
-- transient send buffer as soon as it is final (and is freed), the full
-- bucket is reduce-scattered into the shard, and the buffer goes.
-- The step runs nanochat's three phases: reductions were launched during
-- backward (after_backward waits, so clipping can use the global norm over
-- shards); per bucket: update own slice -> launch the all-gather of the
-- parameters; then wait for every gather.
--
-- Mixed precision.  A bucket whose parameters are bfloat16 (or float16:
-- optim.needs_master) also keeps an fp32 master of this rank's slice,
-- b.master (c elements, as FSDP's master shards), the way the single-
-- process optimizers keep an fp32 master per parameter.  AdamW and Muon
-- update the master; after the update the slice is rounded into pshard,
-- which is what the all-gather spreads, so gathers and gradients stay in
-- the parameters' dtype.  Replicated parameters keep a whole master each
-- (state key 'master' beside m and v, as optim.AdamW does).  Master bytes
-- per rank: 4 * (sum over low-precision flat buckets of c + the elements
-- of the low-precision replicated parameters); state_bytes().master.
-- Checkpoints name the masters "<prefix><name>.master" like the single-
-- process optimizers' state (pieces "...master@<offset>"), so they re-cut
-- for any number of ranks and load into or from unsharded runs; a master
-- the checkpoint lacks (a float32 run's) starts from the loaded weights.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local optim = require 'gptlua.optim'
local B = require 'gptlua.dist.policies.base'
local G = require 'gptlua.ffi'
local ffi, lib, Tensor = G.ffi, G.lib, gl.Tensor

local Zero = setmetatable({}, { __index = B.Base })
Zero.__index = Zero
Zero.MIN_SHARD = 1024



local function zeros32(shape, device) return gl.zeros(shape, { dtype = 'float32', device = device }):keep() end

function Zero.new(name, o)
  local self = setmetatable({}, Zero)
  B.Base.init(self, name, o)
  self.stage = name == 'zero2' and 2 or 1
  self.reduce_every_micro_step = self.stage == 2
  self.N, self.r = self.comm.size, self.comm.rank
  self.own = B.owners(self.optimizer, name)
  self.pending = {}     -- zero2: reduce-scatters in flight, oldest first
  B.broadcast_params(self.comm, self.params)

  local order, small, large = {}, {}, {}
  self.unowned = {}
  for i = #self.params, 1, -1 do
    local p = self.params[i]
    local w = self.own[p]
    if not w then self.unowned[#self.unowned + 1] = p
    else
      order[#order + 1] = p
      if w.kind == 'adamw' then
        if p:numel() < Zero.MIN_SHARD then small[#small + 1] = p else large[#large + 1] = p end
      end
    end
  end
  for _, list in ipairs(B.plan(small, self.cap_bytes)) do self:_add_replicated(list) end
  for _, list in ipairs(B.plan(large, self.cap_bytes)) do self:_add_flat('sharded', list) end
  -- Muon matrices: one stack per shape, in model order
  local stacks, keys = {}, {}
  for _, p in ipairs(self.params) do
    local w = self.own[p]
    if w and w.kind == 'muon' then
      local k = table.concat(p.shape, 'x') .. ' ' .. p.dtype .. ' ' .. p.device
      if not stacks[k] then stacks[k] = {}; keys[#keys + 1] = k end
      local s = stacks[k]
      s[#s + 1] = p
    end
  end
  for _, k in ipairs(keys) do self:_add_flat('stack', stacks[k]) end
  self:_order_buckets(order)
  self:_install_hooks()
  return self
end

-- small AdamW parameters: gradients are views of one all-reduced buffer
function Zero:_add_replicated(list)
  local n = 0
  for _, p in ipairs(list) do n = n + p:numel() end
  local b = { kind = 'replicated', params = {}, grad = B.flat(n, list.dtype, list.device), state = {} }
  local off = 0
  for _, p in ipairs(list) do
    local v = B.view(b.grad, off, p.shape)
    if p.grad then v:copy_(p.grad) end
    p.grad = v
    b.params[#b.params + 1] = p
    b.state[p] = { m = zeros32(p.shape, p.device), v = zeros32(p.shape, p.device) }
    if optim.needs_master(p) then b.state[p].master = p:to('float32'):detach():keep() end
    off = off + p:numel()
  end
  self.buckets[#self.buckets + 1] = b
end

-- a sharded AdamW bucket or a Muon stack: parameters move into a padded
-- flat buffer (each parameter's tensor becomes a view of it)
function Zero:_add_flat(kind, list)
  local N, r = self.N, self.r
  local dtype, device = list[1].dtype, list[1].device
  local b = { kind = kind, params = {}, offs = {}, index_of = {} }
  local n = 0
  for i, p in ipairs(list) do b.params[i] = p; b.offs[i] = n; b.index_of[p] = i; n = n + p:numel() end
  b.numel = n
  if kind == 'stack' then
    local mn = list[1]:numel()
    b.per_rank = math.ceil(#list / N)            -- whole matrices per rank
    b.c = b.per_rank * mn
  else
    b.c = math.ceil(n / N)
  end
  b.padded = N * b.c
  b.pflat = B.flat(b.padded, dtype, device)
  for i, p in ipairs(list) do
    local v = B.view(b.pflat, b.offs[i], p.shape)
    v:copy_(p)
    -- the parameter now lives in the flat buffer; its own storage goes now,
    -- not at the next GC
    Tensor.rebind(p, v.c)
  end
  b.pshard = B.view(b.pflat, r * b.c, { b.c })
  -- mixed precision: the fp32 master of this rank's slice (see the top)
  if optim.needs_master(list[1]) then
    b.master = zeros32({ b.c }, device)
    G.check(lib.gl_copy(b.master.c, b.pshard.c), 2)
  end
  b.gshard = B.flat(b.c, dtype, device)
  if self.stage == 1 then
    b.grad = B.flat(b.padded, dtype, device)
    for i, p in ipairs(list) do
      local v = B.view(b.grad, b.offs[i], p.shape)
      if p.grad then v:copy_(p.grad) end
      p.grad = v
    end
  else
    for _, p in ipairs(list) do if p.grad then p.grad:free(); p.grad = nil end end
  end
  if kind == 'sharded' then
    -- this rank's part of each parameter: [start, start+len) of the slice
    -- is [poff, poff+len) of the parameter
    b.segs = {}
    local lo_r, hi_r = r * b.c, (r + 1) * b.c
    for i, p in ipairs(list) do
      local lo, hi = math.max(b.offs[i], lo_r), math.min(b.offs[i] + p:numel(), hi_r)
      if hi > lo then
        b.segs[#b.segs + 1] = { p = p, w = self.own[p], start = lo - lo_r, len = hi - lo, poff = lo - b.offs[i] }
      end
    end
    b.m, b.v = zeros32({ b.c }, device), zeros32({ b.c }, device)
  else
    b.owned = {}
    local first = r * b.per_rank
    for j = first + 1, math.min(#list, first + b.per_rank) do
      local p = list[j]
      local w = self.own[p]
      b.owned[#b.owned + 1] = { p = p, w = w, grad = B.view(b.gshard, b.offs[j] - r * b.c, p.shape),
                                buf = zeros32(p.shape, p.device),
                                -- NorMuon's second moment (muon_variant 'current')
                                vbuf = w.group.normuon_beta2 > 0 and zeros32(optim.Muon.second_moment_shape(p.shape), p.device) or nil,
                                master = b.master and B.view(b.master, b.offs[j] - r * b.c, p.shape) }
    end
  end
  self.buckets[#self.buckets + 1] = b
end

-- ------------------------------------------------------- communication --
function Zero:_launch(b)
  local comm = self.comm
  if b.kind == 'replicated' then
    if self.final then b.work = comm:all_reduce_async(b.grad, 'avg') end
  elseif self.stage == 1 then
    if self.final then b.work = comm:reduce_scatter_async(b.gshard, b.grad, 'avg') end
  else
    -- the gathered gradients (see _take_grad; gradients not taken yet
    -- are added now) go to the shard: the first reduction after zero_grad
    -- writes it, later ones add
    local send = self:_send_buffer(b)
    for _, p in ipairs(b.params) do self:_take_grad(b, p) end
    b.send = nil
    local recv = b.received and gl.empty({ b.c }, { dtype = send.dtype, device = send.device }):keep() or b.gshard
    b.received = true
    self.pending[#self.pending + 1] = { b = b, send = send, recv = recv,
      work = comm:reduce_scatter_async(recv, send, 'avg') }
  end
end

-- zero2: the bucket's transient send buffer, zero-filled (parameters that
-- get no gradient and the padding send zeros)
function Zero:_send_buffer(b)
  if not b.send then
    b.send = gl.zeros({ b.padded }, { dtype = b.pflat.dtype, device = b.pflat.device }):keep()
  end
  return b.send
end

-- zero2: a parameter's gradient is final: add it into the bucket's send
-- buffer and free it, so full gradients live only until their bucket
-- reduces.  Adding (not copying) keeps every contribution when a bucket
-- that could not start on an earlier micro-step (a parameter without a
-- gradient holds it back) collects gradients of several micro-steps.
function Zero:_take_grad(b, p)
  if self.stage ~= 2 or b.kind == 'replicated' or not p.grad then return end
  local v = B.view(self:_send_buffer(b), b.offs[b.index_of[p]], p.shape, false)
  v:add_(p.grad)
  v:free()  -- a view holds the send buffer's storage: drop it now, not at scope end
  p.grad:free()
  p.grad = nil
end

local function complete(e)
  if e.recv ~= e.b.gshard then e.b.gshard:add_(e.recv); e.recv:free() end
  e.send:free()
end

-- zero2: completes finished reduce-scatters, oldest first, so buffers of
-- earlier buckets go while backward still runs
function Zero:_poll()
  local q = self.pending
  while q[1] and q[1].work:test() do complete(table.remove(q, 1)) end
end

function Zero:_finish()
  local q = self.pending
  while q[1] do
    local e = table.remove(q, 1)
    e.work:wait()
    complete(e)
  end
  for _, b in ipairs(self.buckets) do
    if b.work then b.work:wait(); b.work = nil end
  end
end

-- --------------------------------------------------- the policy interface --
function Zero:zero_grad()
  for _, b in ipairs(self.buckets) do
    if b.grad then b.grad:zero_() end
    b.received = false
    if self.stage == 2 and b.kind ~= 'replicated' then
      for _, p in ipairs(b.params) do if p.grad then p.grad:free(); p.grad = nil end end
      if b.send then b.send:free(); b.send = nil end
    end
  end
  for _, p in ipairs(self.unowned) do if p.grad then p.grad:zero_() end end
end

-- L2 norm of the averaged gradient: the shards' squares summed over ranks
-- (padding is zero), the replicated gradients counted once
function Zero:grad_norm()
  local pieces = {}
  for _, b in ipairs(self.buckets) do
    if b.kind == 'replicated' then
      if self.r == 0 then pieces[#pieces + 1] = b.grad end
    else
      pieces[#pieces + 1] = b.gshard
    end
  end
  return math.sqrt(self.comm:all_reduce_number(B.sumsq_list(pieces), 'sum'))
end

-- Calls f(p, grad, counted) for every piece of the step's averaged
-- gradient this rank holds once after_backward is done: its slices of the
-- sharded buckets, its Muon matrices, and the replicated gradients, which
-- every rank holds and rank 0 counts (counted pieces over all ranks make
-- the whole once).  Tensor parallelism weighs and sums them over tp.
function Zero:each_grad(f)
  for _, b in ipairs(self.buckets) do
    if b.kind == 'replicated' then
      for _, p in ipairs(b.params) do f(p, p.grad, self.r == 0) end
    elseif b.kind == 'sharded' then
      for _, sg in ipairs(b.segs) do f(sg.p, B.view(b.gshard, sg.start, { sg.len }, false), true) end
    else
      for _, e in ipairs(b.owned) do f(e.p, e.grad, true) end
    end
  end
end

function Zero:scale_grads(s)
  for _, b in ipairs(self.buckets) do (b.kind == 'replicated' and b.grad or b.gshard):mul_(s) end
end

local function adamw(p, grad, m, v, start, len, w)
  optim.AdamW.update_slice(p, grad, m, v, start, len, w.group, w.opt.t)
end

-- Group settings (lr schedules, Muon momentum) are read from the wrapped
-- optimizer's groups here, so set_lr_mult / set_momentum apply.  The
-- updates run on the fp32 masters where there are some, then round into
-- the parameters (replicated) or the shard the all-gather spreads.
function Zero:step()
  for _, o in ipairs(self.optimizer.optimizers or { self.optimizer }) do o.t = o.t + 1 end
  gl.no_grad(function()
    local gathers = {}
    for _, b in ipairs(self.buckets) do
      if b.kind == 'replicated' then
        for _, p in ipairs(b.params) do
          local st = b.state[p]
          adamw(st.master or p, p.grad, st.m, st.v, 0, p:numel(), self.own[p])
          if st.master then G.check(lib.gl_copy(p.c, st.master.c), 2) end
        end
      else
        if b.kind == 'sharded' then
          for _, s in ipairs(b.segs) do adamw(b.master or b.pshard, b.gshard, b.m, b.v, s.start, s.len, s.w) end
        else
          for _, e in ipairs(b.owned) do
            local g, p = e.w.group, e.p
            -- (tensor parallel sets update_direction and matrix_shape on the
            -- optimizer: the whole matrix's direction, cut to this shard)
            local o = e.w.opt
            local X = (optim.Muon.tp_direction(o, g) or optim.Muon.update_direction)(p, e.grad, e.buf, g, e.vbuf)
            local shape = o.matrix_shape and o.matrix_shape(p) or p.shape
            optim.muon_apply(e.master or p, X, optim.Muon.scaled_lr(g, shape), g)
            Tensor.release(X)   -- one matrix's temporaries at a time
          end
        end
        if b.master then G.check(lib.gl_copy(b.pshard.c, b.master.c), 2) end
        gathers[#gathers + 1] = self.comm:all_gather_async(b.pflat, b.pshard)
      end
      dist.progress()
    end
    for _, w in ipairs(gathers) do w:wait() end
  end)
end

-- --------------------------------------------------------------- state --
-- Bytes this rank holds persistently besides the parameters: optimizer
-- state (AdamW m and v, Muon momentum) and fp32 masters (0 unless the
-- parameters are low precision).
function Zero:state_bytes()
  local r = { optimizer = 0, master = 0 }
  for _, b in ipairs(self.buckets) do
    if b.kind == 'replicated' then
      for _, st in pairs(b.state) do
        r.optimizer = r.optimizer + B.bytes(st.m) + B.bytes(st.v)
        if st.master then r.master = r.master + B.bytes(st.master) end
      end
    else
      if b.kind == 'sharded' then r.optimizer = r.optimizer + B.bytes(b.m) + B.bytes(b.v)
      else
        for _, e in ipairs(b.owned) do r.optimizer = r.optimizer + B.bytes(e.buf) + (e.vbuf and B.bytes(e.vbuf) or 0) end
      end
      if b.master then r.master = r.master + B.bytes(b.master) end
    end
  end
  return r
end

function Zero:optimizer_state_bytes() return self:state_bytes().optimizer end

local function key(w, k) return w.opt.prefix .. w.name .. '.' .. k end

-- Calls f(key, tensor, offset, replicated, kind) for every piece of state
-- this rank holds (replicated: true for the pieces every rank holds alike;
-- kind: 'state' for m, v and momentum, 'master' for fp32 masters).
function Zero:each_state(f)
  for _, b in ipairs(self.buckets) do
    if b.kind == 'replicated' then
      for _, p in ipairs(b.params) do
        local st, w = b.state[p], self.own[p]
        f(key(w, 'm'), st.m, 0, true, 'state'); f(key(w, 'v'), st.v, 0, true, 'state')
        if st.master then f(key(w, 'master'), st.master, 0, true, 'master') end
      end
    elseif b.kind == 'sharded' then
      for _, s in ipairs(b.segs) do
        f(key(s.w, 'm'), B.view(b.m, s.start, { s.len }, false), s.poff, false, 'state')
        f(key(s.w, 'v'), B.view(b.v, s.start, { s.len }, false), s.poff, false, 'state')
        if b.master then f(key(s.w, 'master'), B.view(b.master, s.start, { s.len }, false), s.poff, false, 'master') end
      end
    else
      for _, e in ipairs(b.owned) do
        f(key(e.w, 'momentum_buffer'), e.buf, 0, false, 'state')
        if e.vbuf then f(key(e.w, 'second_momentum_buffer'), e.vbuf, 0, false, 'state') end
        if e.master then f(key(e.w, 'master'), e.master, 0, false, 'master') end
      end
    end
  end
end

-- key -> shape of every tensor of the whole (unsharded) optimizer state,
-- masters included (as the single-process optimizers name them)
function Zero:state_layout()
  local out = {}
  for p, w in pairs(self.own) do
    for _, e in ipairs(w.opt:param_state(p, w.group)) do out[key(w, e[1])] = e[2] end
    if optim.needs_master(p) then out[key(w, 'master')] = p.shape end
  end
  return out
end

-- Sets every fp32 master from the current (low-precision) parameters:
-- after weights were loaded into them from outside the optimizer.
function Zero:reset_masters()
  for _, b in ipairs(self.buckets) do
    if b.kind == 'replicated' then
      for _, p in ipairs(b.params) do
        local st = b.state[p]
        if st.master then G.check(lib.gl_copy(st.master.c, p.c), 2) end
      end
    elseif b.master then
      G.check(lib.gl_copy(b.master.c, b.pshard.c), 2)
    end
  end
end

function Zero:save_checkpoint(trainer, model_sd, opt_sd, state)
  return require('gptlua.dist.policies.shards').save(trainer, self, model_sd, state)
end

-- The weights are in (the trainer's model:load_state_dict wrote them into
-- the flat buffers); the masters start from them and are replaced by the
-- checkpoint's masters where it has them (a float32 run's has none).
function Zero:load_checkpoint(trainer, c, path)
  local shards = require 'gptlua.dist.policies.shards'
  local index = shards.index(path, c)
  self:reset_masters()
  self:each_state(function(k, t, off, _, kind)
    if kind == 'state' or index[k] then shards.fill(index, k, off, t, path) end
  end)
  shards.set_steps(self.optimizer, c.state)
end

return Zero
