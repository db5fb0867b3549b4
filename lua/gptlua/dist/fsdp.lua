-- gptlua.dist.fsdp — fully sharded data parallel (ZeRO-3, dist = 'fsdp')
-- and hybrid sharding (dist = 'hsdp'), for the trainer's policy interface.
--
--   local fsdp = require 'gptlua.dist.fsdp'
--   local policy = fsdp.new('fsdp', {comm = world, model = model, optimizer = opt,
--                                    params = model:parameters(), cfg = cfg})
--   local policy = fsdp.new('hsdp', {..., shard_size = 2})
--
-- Units.  The model's parameters are cut into wrapping units (default: each
-- block model.transformer.h[i]; the embeddings wte/wpe; everything left —
-- head, final norm — as one more unit; opts.units(model) may return its
-- own list).  A unit's parameters live in one flat buffer padded to a
-- multiple of the shard group size S and split evenly: rank s of the group
-- keeps elements [s*c, (s+1)*c), c = padded/S, of the parameters (pshard),
-- of the averaged gradient (gshard) and of the optimizer state (for a
-- bfloat16 model with an fp32 master of pshard: see Mixed precision), and
-- nothing else.  Between uses a parameter tensor has no storage (t:is_freed());
-- while its unit is gathered it is a view into the unit's full buffer.
--
-- Two kinds of units:
--   block units (the default for modules with a forward of their own): the
--     module's forward is wrapped.  Before it runs the unit is all-gathered
--     (the next unit's gather is started first, so it overlaps this unit's
--     compute: prefetch), the forward runs without recording inside a
--     tensor scope, and the full buffer is released (reshard_after_forward;
--     the last block stays gathered for backward, which starts with it).
--     The unit's output is recorded as one autograd node whose backward
--     re-gathers the unit (prefetching the previous one), re-runs its
--     forward with recording under the forward's RNG state and back-
--     propagates through it inside a tensor scope: autograd sees full
--     weights, nothing of the unit outlives its backward, and no full
--     parameter stays alive between forward and backward.  This is
--     activation checkpointing at unit granularity, with the memory
--     actually released (the scopes), at the cost of one more forward.
--     The unit's gradients are final when that node's backward ends.
--   root units (the embeddings and the head, and any unit given root = true):
--     the model's code uses these weights directly (the tied lm_head of
--     GPT-2, nanochat's lm_head.weight), so they are gathered when the
--     model's forward starts and stay gathered until their gradients are
--     final, which the gradient-ready hooks report (the embedding: at the
--     end of backward).
-- With reshard_after_forward = false, blocks behave like root units: kept
-- gathered from their forward until their gradients are final (no
-- recompute).  A block called with recording outside the model's forward
-- (the model's own activation checkpointing recomputing it in backward)
-- is treated the same way, so gl.checkpoint around a block costs no third
-- forward.
--
-- Gradients.  Once a unit's gradients are final (parameter .grad tensors are
-- views into one zeroed full buffer, so autograd accumulates in place),
-- the buffer is reduce-scattered (average; in opts.reduce_dtype, float32
-- or bfloat16) asynchronously into the gradient shard and freed when the
-- collective completes; the parameters are released.  With gradient
-- accumulation the default (accumulate = 'sharded') reduce-scatters every
-- micro-step and adds into the shard; accumulate = 'unsharded' keeps every
-- unit gathered and its full gradient from the first micro-step to the
-- last (DDP-like memory during the step) and communicates once.  HSDP
-- reduce-scatters inside the shard group, then all-reduces (average) the
-- shard over the replica group (the ranks holding the same shard).
-- after_backward waits for all of it, so clipping sees the global norm
-- (the shards' squares summed over the shard group).
--
-- Optimizer.  AdamW runs the C kernel on each parameter's part of the rank's
-- shard, with that parameter's group settings (state for those parts only).
-- Muon needs whole matrices: each Muon matrix has an owner rank in the
-- shard group (greedy by size, ties to the rank holding most of it).  At
-- step, one all-to-all sends every rank's pieces of the averaged gradients
-- to the owners (it overlaps the AdamW updates); each owner runs momentum
-- and Newton–Schulz on its whole matrices and keeps their momentum; a
-- second all-to-all returns each rank the orthogonalised update for its
-- pieces, applied to the shard as p += -lr * sqrt(max(1, rows/cols)) * X.
-- Parameters are not gathered at step: the next forward gathers them.
--
-- Mixed precision.  A unit whose parameters are bfloat16 (or float16:
-- optim.needs_master) also keeps an fp32 master shard u.master, the same c
-- elements as pshard, as the single-process optimizers keep a master per
-- parameter.  AdamW and the Muon updates run on the master; after the
-- step each master shard is rounded into pshard (one copy per unit), and
-- pshard, in the parameters' dtype, is what the forward gathers.  So the
-- gathers, the gradients (full and shard) and the Muon gradient pieces
-- stay in the parameters' dtype, while Muon's updates travel back to the
-- pieces' ranks in fp32 (the master's dtype, so an update is applied as
-- the single-process Muon applies it).  Loading weights
-- (model:load_state_dict) sets the loaded pieces' masters from them.
--
-- Communication per optimizer step and rank (P parameter elements, M of
-- them Muon matrices, S ranks per shard group, R = N/S replicas, A
-- micro-steps; an all-gather or reduce-scatter of P moves (S-1)/S * P):
--   forward      all-gather every unit                      A * (S-1)/S * P
--   backward     all-gather every block again (not the last
--                block, not the root units)                 A * (S-1)/S * P_blocks
--   gradients    reduce-scatter every unit                  A * (S-1)/S * P
--                (accumulate = 'unsharded': one all-gather and one
--                reduce-scatter per unit and step, no backward gathers)
--   HSDP         all-reduce of the shard over replicas      2 (R-1)/R * P/S
--   FP8 layers   (--fp8) their weights gather as float8 codes: 1 byte per
--                element, not the dtype's 2 or 4 (rowwise: 2 in backward,
--                the column-scaled codes too), plus one all-reduce (max)
--                of their amax per gather (gptlua.dist.fsdp_fp8)
--   Muon         gradient pieces to owners + updates back   2 * about (S-1)/S^2 * M
--                (elements; with fp32 masters the updates move as fp32,
--                so a bfloat16 model moves 2 + 4 bytes per such element)
-- So FSDP moves about 3 P per micro-step where DDP moves 2 P (all-reduce);
-- Muon adds about 2/S of its matrices per step.  Every collective is issued
-- in the same order on every rank of its communicator (units in a fixed
-- order, completions processed oldest first), and during backward a rank
-- blocks only on shard-group collectives (replica all-reduces are waited
-- for in after_backward), so the two groups' collectives interleave
-- without deadlock.
--
-- Memory per rank: 1/S of the parameters, gradients and optimizer state
-- between steps (gl.memory_stats shows it), and for a bfloat16 model the
-- master shards: 4 bytes * sum over units of ceil(unit/S) (state_bytes()
-- .master); during the step in addition
-- the root units, at most two gathered blocks (the current one and the
-- prefetched one; stats.peak_live counts them), one unit's full gradient,
-- the gradients whose reduce-scatter is in flight, and the block-boundary
-- activations plus one block's recomputation.
--
-- Checkpoints: every rank writes its pieces of the parameters
-- ("param.<name>@<offset>") and of the optimizer state (the optimizer's own
-- key names, "<key>@<offset>", the masters as "<prefix><name>.master" like
-- the single-process optimizers' state) in the format of
-- gptlua.dist.policies.shards; in HSDP the first replica writes them.
-- Rank 0 also writes the whole model.safetensors (gathered unit by unit),
-- so sampling, any other policy or a single process can start from it.
-- Loading re-cuts the pieces for the current ranks and shard size; a
-- master the checkpoint lacks (one written by a float32 run) starts from
-- the loaded parameter pieces.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local optim = require 'gptlua.optim'
local A = require 'gptlua.autograd'
local B = require 'gptlua.dist.policies.base'
local G = require 'gptlua.ffi'
local now = require('gptlua.cli').now
local F8 = require 'gptlua.dist.fsdp_fp8'
local Tensor = gl.Tensor
local ffi, lib = G.ffi, G.lib

local M = {}

-- Options (opts.<key>, else cfg.fsdp.<key>, else these).
M.defaults = {
  reshard_after_forward = true,  -- free a block's gathered parameters after its forward (recompute in backward)
  prefetch = true,               -- start the next unit's all-gather before this one computes
  accumulate = 'sharded',        -- 'sharded': reduce-scatter every micro-step; 'unsharded': once per step
  reduce_dtype = 'float32',      -- dtype of the gradient reduce-scatter: 'float32' or 'bfloat16'
  fp8_all_gather = true,         -- with FP8 layers: gather their weights as float8 codes (gptlua.dist.fsdp_fp8)
}

-- reduce-scatters in flight at most (each holds a unit's full gradient);
-- the oldest is waited for beyond it
M.MAX_IN_FLIGHT = 2

local function is_tensor(x) return getmetatable(x) == Tensor end
local function fail(msg, level) error('dist.policy: ' .. msg, (level or 1) + 1) end

-- contiguous 1-D (or shaped) view at element off of a flat buffer; never
-- released by tensor scopes (B.view keeps it)
local function view(buf, off, shape) return B.view(buf, off, shape) end
local function tmp_view(buf, off, n) return B.view(buf, off, { n }, false) end
local function shaped(buf, off, shape) return B.view(buf, off, shape, false) end

-- ------------------------------------------------------------------ units --
-- The default units: every block of model.transformer.h, the embeddings
-- (wte, wpe) as a root unit; what no unit claims becomes the root unit
-- 'head' (lm_head, ln_f, ...).
function M.default_units(model)
  local tr, units = model.transformer, {}
  if type(tr) == 'table' and type(tr.h) == 'table' and type(tr.h.n) == 'number' then
    for i = 1, tr.h.n do units[#units + 1] = { name = 'transformer.h.' .. (i - 1), module = tr.h[i] } end
    local emb = {}
    for _, k in ipairs({ 'wte', 'wpe' }) do if type(tr[k]) == 'table' then emb[#emb + 1] = tr[k] end end
    if #emb > 0 then units[#units + 1] = { name = 'embeddings', modules = emb, root = true } end
  end
  return units
end

local function is_module(x) return type(x) == 'table' and type(x.named_parameters) == 'function' end

-- Normalises the unit list: entries are modules or {name=, module=,
-- modules=, params=, root=}; returns {name, module, root, params} with
-- each parameter in exactly one unit, and the leftover root unit 'head'.
local function plan_units(list, model, trainable, name_of)
  local claimed, out = {}, {}
  for i, e in ipairs(list) do
    if is_module(e) then e = { module = e } end
    if type(e) ~= 'table' then fail(('fsdp unit %d expected a module or a table, got %s'):format(i, type(e)), 4) end
    local u = { name = e.name or ('unit' .. i), module = e.module, root = e.root == true, params = {} }
    local mods = e.modules or (e.module and { e.module }) or {}
    local ps = {}
    for _, m in ipairs(mods) do
      if not is_module(m) then fail(('fsdp unit %s: modules expected nn modules'):format(u.name), 4) end
      for _, p in ipairs(m:parameters()) do ps[#ps + 1] = p end
    end
    for _, p in ipairs(e.params or {}) do ps[#ps + 1] = p end
    for _, p in ipairs(ps) do
      if trainable[p] then
        if claimed[p] and claimed[p] ~= u then
          fail(('fsdp: parameter %s is in units %s and %s'):format(name_of[p], claimed[p].name, u.name), 4)
        end
        if not claimed[p] then claimed[p] = u; u.params[#u.params + 1] = p end
      end
    end
    if u.module and not u.root and rawget(u.module, '_fsdp_unit') then
      fail(('fsdp: module of unit %s is wrapped twice'):format(u.name), 4)
    end
    if #u.params > 0 then out[#out + 1] = u end
  end
  local rest = { name = 'head', root = true, params = {} }
  for _, np in ipairs(model:named_parameters()) do
    local p = np[2]
    if trainable[p] and not claimed[p] then rest.params[#rest.params + 1] = p; claimed[p] = rest end
  end
  if #rest.params > 0 then out[#out + 1] = rest end
  return out
end


local function option(o, key)
  local v = o[key]
  if v == nil and type(o.cfg) == 'table' and type(o.cfg.fsdp) == 'table' then v = o.cfg.fsdp[key] end
  if v == nil then v = M.defaults[key] end
  local want = M.defaults[key]
  if type(v) ~= type(want) then
    fail(('fsdp option %s expected a %s, got %s %s'):format(key, type(want), type(v), tostring(v)), 4)
  end
  return v
end

-- --------------------------------------------------------------- the policy --
local FSDP = {}
FSDP.__index = FSDP
M.FSDP = FSDP

-- new(name, opts) with name 'fsdp' or 'hsdp' (or new(opts), name from
-- opts.name or opts.cfg.dist).  opts: comm (default: the world), model,
-- optimizer, params, cfg, shard_size (hsdp: ranks per shard group, dividing
-- the world; fsdp: the world), units (function(model) -> list, or a list),
-- and the options of M.defaults.
function M.new(name, o)
  if type(name) == 'table' then
    o = name
    name = o.name or (type(o.cfg) == 'table' and o.cfg.dist) or 'fsdp'
  end
  if name ~= 'fsdp' and name ~= 'hsdp' then fail(("fsdp.new: name expected 'fsdp' or 'hsdp', got %s"):format(tostring(name))) end
  if type(o) ~= 'table' then fail(('%s expected an options table, got %s'):format(name, type(o))) end
  if not is_module(o.model) then fail(('%s expected opts.model, the nn module to shard'):format(name)) end
  if type(o.optimizer) ~= 'table' or type(o.optimizer.step) ~= 'function' then
    fail(('%s expected opts.optimizer, an optimizer with step()'):format(name))
  end
  -- collective_forward: every forward of the model (evaluation, sampling)
  -- gathers, so every rank must run it
  local self = setmetatable({ name = name, model = o.model, optimizer = o.optimizer, collective_forward = true }, FSDP)
  self.comm = o.comm or dist.init()
  local N = self.comm.size
  local S = N
  if name == 'hsdp' then
    S = o.shard_size
    if type(S) ~= 'number' or S < 1 or S ~= math.floor(S) or N % S ~= 0 then
      fail(('hsdp needs shard_size dividing the world size %d (ranks per shard group), got %s'):format(N, tostring(S)))
    end
  end
  for k in pairs(M.defaults) do self[k] = option(o, k) end
  if self.accumulate ~= 'sharded' and self.accumulate ~= 'unsharded' then
    fail(("fsdp option accumulate expected 'sharded' or 'unsharded', got %s"):format(self.accumulate))
  end
  if self.reduce_dtype ~= 'float32' and self.reduce_dtype ~= 'bfloat16' then
    fail(("fsdp option reduce_dtype expected 'float32' or 'bfloat16', got %s"):format(self.reduce_dtype))
  end
  -- shard group: consecutive ranks; replica group: the ranks holding the same shard
  local r = self.comm.rank
  self.shard = self.comm:split(math.floor(r / S), r, { size = S, rank = r % S })
  self.replica = self.comm:split(r % S, r, { size = N / S, rank = math.floor(r / S) })
  self.S, self.s, self.replica_rank = S, self.shard.rank, self.replica.rank

  local name_of, trainable = {}, {}
  for _, np in ipairs(self.model:named_parameters()) do name_of[np[2]] = np[1] end
  for _, p in ipairs(B.trainable(o.params or self.model:parameters())) do
    if not name_of[p] then fail(('%s: a parameter in opts.params is not a parameter of opts.model'):format(name)) end
    trainable[p] = true
  end
  self.name_of = name_of
  self.own = B.owners(self.optimizer, name)
  local list = o.units or M.default_units
  if type(list) == 'function' then list = list(self.model) end
  if type(list) ~= 'table' then fail(('%s: opts.units expected a list or a function returning one'):format(name)) end

  self.units, self.wrap, self.roots, self.unit_of = {}, {}, {}, {}
  self.pending, self.syncs, self.hooks = {}, {}, {}
  -- gathers started, seconds spent waiting for them, reduce-scatters
  -- started, bytes of gathered parameters now and at most
  self.stats = { gathers = 0, gather_wait = 0, reduces = 0, live = 0, peak_live = 0 }
  self.phase, self.final = 'idle', true
  self.fp8_chosen = self.fp8_all_gather and F8.chosen(self.model) or {}
  for _, spec in ipairs(plan_units(list, self.model, trainable, name_of)) do self:_add_unit(spec) end
  self:_plan_muon()
  self:_install()
  return self
end

-- The unit's flat layout, its shards (from rank 0's values, so every rank
-- and replica starts equal) and optimizer state; the parameters' own
-- storage is released.
function FSDP:_add_unit(u)
  local S, s = self.S, self.s
  u.offs, u.names = {}, {}
  local n = 0
  for i, p in ipairs(u.params) do
    if p.dtype ~= u.params[1].dtype or p.device ~= u.params[1].device then
      fail(('fsdp unit %s mixes %s@%s and %s@%s parameters'):format(u.name, p.dtype, p.device,
        u.params[1].dtype, u.params[1].device), 3)
    end
    u.offs[i], u.names[i] = n, self.name_of[p]
    n = n + p:numel()
    self.unit_of[p] = u
  end
  u.dtype, u.device = u.params[1].dtype, u.params[1].device
  u.numel, u.c = n, math.ceil(n / S)
  u.padded = S * u.c
  local full = gl.zeros({ u.padded }, { dtype = u.dtype, device = u.device })
  for i, p in ipairs(u.params) do G.check(lib.gl_copy(shaped(full, u.offs[i], p.shape).c, p.c), 2) end
  self.comm:broadcast(full, 0)
  u.pshard = B.flat(u.c, u.dtype, u.device)
  G.check(lib.gl_copy(u.pshard.c, tmp_view(full, s * u.c, u.c).c), 2)
  full:free()
  -- mixed precision: the fp32 master of the shard, which the optimizer updates
  if optim.needs_master(u.params[1]) then
    u.master = B.flat(u.c, 'float32', u.device)
    G.check(lib.gl_copy(u.master.c, u.pshard.c), 2)
  end
  for _, p in ipairs(u.params) do
    if p.grad then p.grad:free(); p.grad = nil end
    Tensor.release(p)
  end
  u.gshard = B.flat(u.c, u.dtype, u.device)
  -- this rank's piece of each parameter: [start, start+len) of the shard
  -- is [poff, poff+len) of the parameter
  u.pieces, u.adam = {}, {}
  local lo_r, hi_r, nadam = s * u.c, (s + 1) * u.c, 0
  for i, p in ipairs(u.params) do
    local lo, hi = math.max(u.offs[i], lo_r), math.min(u.offs[i] + p:numel(), hi_r)
    if hi > lo then
      local pc = { i = i, p = p, name = u.names[i], w = self.own[p], start = lo - lo_r, len = hi - lo,
                   poff = lo - u.offs[i] }
      u.pieces[#u.pieces + 1] = pc
      if pc.w and pc.w.kind == 'adamw' then
        pc.moff = nadam
        nadam = nadam + pc.len
        u.adam[#u.adam + 1] = pc
      end
    end
  end
  if nadam > 0 then
    u.m, u.v = B.flat(nadam, 'float32', u.device), B.flat(nadam, 'float32', u.device)
    for _, pc in ipairs(u.adam) do
      -- the update target: the master where there is one, else the shard itself
      pc.pv, pc.gv = view(u.master or u.pshard, pc.start, { pc.len }), view(u.gshard, pc.start, { pc.len })
      pc.mv, pc.vv = view(u.m, pc.moff, { pc.len }), view(u.v, pc.moff, { pc.len })
    end
  end
  u.fp8 = F8.plan(u, self.fp8_chosen, S)
  u.state, u.pending_calls, u.ready = 'sharded', 0, 0
  self.units[#self.units + 1] = u
  if u.root or not u.module then
    u.root = true
    self.roots[#self.roots + 1] = u
  else
    self.wrap[#self.wrap + 1] = u
    u.index = #self.wrap
  end
end

-- Wraps the model's forward and each block's forward, replaces
-- load_state_dict, registers the gradient-ready hooks.
function FSDP:_install()
  local model = self.model
  self.saved = { forward = rawget(model, 'forward'), load_state_dict = rawget(model, 'load_state_dict') }
  local root_forward = model.forward
  model.forward = function(m, ...) return self:_root_forward(root_forward, m, ...) end
  local orig_load = model.load_state_dict
  model.load_state_dict = function(m, sd, opts) return self:_load_full(orig_load, m, sd, opts) end
  for _, u in ipairs(self.wrap) do
    local mod = u.module
    u.saved_forward = rawget(mod, 'forward')
    u.orig = mod.forward
    mod._fsdp_unit = u
    mod.forward = function(m, ...) return self:_unit_forward(u, m, ...) end
  end
  for _, u in ipairs(self.units) do
    for _, p in ipairs(u.params) do
      local fn = function(t) self:_grad_ready(t) end
      p:register_hook(fn)
      self.hooks[#self.hooks + 1] = { p, fn }
    end
  end
end

-- --------------------------------------------------- gather and release --
-- exact: gather every parameter in its own dtype (checkpoints, detach),
-- never as FP8 codes
function FSDP:_start_gather(u, exact)
  if u.fp8 and not exact then
    -- the column form of rowwise FP8 weights wherever a backward may read it:
    -- not without gradients, not for a forward that reshards (backward re-gathers)
    local cols = self.phase == 'backward'
      or (A.is_grad_enabled() and not (self.phase == 'forward' and not self:_keep_after_forward(u)))
    F8.start(self, u, u.fp8, cols)
  else
    u.full = gl.empty({ u.padded }, { dtype = u.dtype, device = u.device }):keep()
    u.work = self.shard:all_gather_async(u.full, u.pshard)
  end
  u.state = 'gathering'
  local st = self.stats
  st.gathers = st.gathers + 1
  st.live = st.live + (u.works and F8.bytes(u) or B.bytes(u.full))
  if st.live > st.peak_live then st.peak_live = st.live end
end

function FSDP:_wait_gather(u)
  local t0 = now()
  if u.works then
    F8.finish(self, u, u.fp8)
    u.f8_gathered = true
  else
    u.work:wait()
    u.work = nil
    for i, p in ipairs(u.params) do Tensor.rebind(p, view(u.full, u.offs[i], p.shape).c) end
  end
  self.stats.gather_wait = self.stats.gather_wait + (now() - t0)
  u.state = 'gathered'
end

-- frees the gathered parameters (the unit is sharded again)
function FSDP:_release(u)
  if u.state == 'gathering' then self:_wait_gather(u) end
  if u.state == 'gathered' then
    for _, p in ipairs(u.params) do Tensor.release(p) end
    if u.f8_gathered then
      self.stats.live = self.stats.live - F8.bytes(u)
      F8.release(u)
      u.f8_gathered = nil
    else
      self.stats.live = self.stats.live - B.bytes(u.full)
    end
    u.full:free()
    u.full, u.state = nil, 'sharded'
  end
end

function FSDP:_neighbour(u)
  if u.root then return nil end
  return self.wrap[u.index + (self.phase == 'forward' and 1 or -1)]
end

-- u gathered on return; the unit after it (forward) or before it
-- (backward) is being gathered
function FSDP:_acquire(u)
  if u.state == 'sharded' then self:_start_gather(u) end
  local v = self.prefetch and self:_neighbour(u)
  if v and v.state == 'sharded' then self:_start_gather(v) end
  if u.state == 'gathering' then self:_wait_gather(u) end
end

-- After a block's forward: keep it gathered when backward will need it at
-- once (the last block), when blocks do not reshard, or through the
-- micro-steps of an unsharded accumulation.
function FSDP:_keep_after_forward(u)
  return self.fwd_grad and self.phase == 'forward'
    and (not self.reshard_after_forward or u == self.wrap[#self.wrap] or self.accumulate == 'unsharded')
end

-- ------------------------------------------------------------- forwards --
function FSDP:_root_forward(orig, m, ...)
  local grad = A.is_grad_enabled()
  self.fwd_grad, self.phase = grad, 'forward'
  for _, u in ipairs(self.roots) do if u.state == 'sharded' then self:_start_gather(u) end end
  local first = self.wrap[1]
  if self.prefetch and first and first.state == 'sharded' then self:_start_gather(first) end
  for _, u in ipairs(self.roots) do
    if u.state == 'gathering' then self:_wait_gather(u) end
    if grad then self:_expect_hooks(u) end
  end
  local res = { pcall(orig, m, ...) }
  self.phase = grad and 'backward' or 'idle'
  if not grad then for _, u in ipairs(self.units) do self:_release(u) end end
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

function FSDP:_unit_forward(u, m, ...)
  if not A.is_grad_enabled() then return self:_plain_call(u, m, ...) end
  if self.phase == 'forward' and self.reshard_after_forward then return self:_recompute_call(u, m, ...) end
  -- kept gathered until the hooks report its gradients final
  self:_acquire(u)
  self:_expect_hooks(u)
  local r = { u.orig(m, ...) }
  return unpack(r, 1, table.maxn(r))
end

-- without recording: gather, run (its temporaries go with a scope), release
function FSDP:_plain_call(u, m, ...)
  self:_acquire(u)
  local r = { gl.scope(u.orig, m, ...) }
  if not self:_keep_after_forward(u) then self:_release(u) end
  self:_poll()
  return unpack(r, 1, table.maxn(r))
end

-- forward without recording, backward by recomputation (see the top):
-- autograd's recomputation, with the unit gathered around each half
function FSDP:_recompute_call(u, m, ...)
  self:_acquire(u)
  u.pending_calls = u.pending_calls + 1
  return A.recompute(u.orig, { n = select('#', ...) + 1, m, ... }, {
    inputs = u.params,
    name = 'fsdp ' .. u.name,
    after_forward = function(res)
      if not self:_keep_after_forward(u) then self:_release(u) end
      self:_poll()
      if not is_tensor(res[1]) or table.maxn(res) > 1 then
        u.pending_calls = u.pending_calls - 1
        error(('fsdp: unit %s returned %s; a unit that reshards after forward must return one tensor '
          .. '(give it root = true)'):format(u.name, table.maxn(res) > 1 and (table.maxn(res) .. ' values') or type(res[1])), 0)
      end
    end,
    before_backward = function()
      self:_acquire(u)
      self:_grad_buffers(u)
    end,
    after_backward = function()
      u.pending_calls = u.pending_calls - 1
      if u.pending_calls <= 0 then
        u.pending_calls = 0
        self:_finalize(u)
      end
      dist.progress()
    end,
  })
end

-- ------------------------------------------------------------ gradients --
-- parameter gradients become views into one zeroed full buffer
function FSDP:_grad_buffers(u)
  if u.gfull then return end
  u.gfull = gl.zeros({ u.padded }, { dtype = u.dtype, device = u.device }):keep()
  for i, p in ipairs(u.params) do p.grad = view(u.gfull, u.offs[i], p.shape) end
end

-- a gathered unit whose gradients the hooks will report
function FSDP:_expect_hooks(u)
  self:_grad_buffers(u)
  if not u.expecting then u.expecting, u.ready, u.seen = true, 0, {} end
end

function FSDP:_grad_ready(p)
  local u = self.unit_of[p]
  if u and u.expecting and not u.seen[p] then
    u.seen[p] = true
    u.ready = u.ready + 1
    if u.ready == #u.params then self:_finalize(u) end
  end
  self:_poll()
  dist.progress()
end

-- The unit's gradients are final for this micro-step: reduce-scatter them
-- and release the unit (or keep both through an unsharded accumulation).
function FSDP:_finalize(u, force)
  if not u.gfull then return end
  u.expecting = false
  if self.accumulate == 'unsharded' and not self.final and not force then return end
  for _, p in ipairs(u.params) do
    if p.grad then Tensor.release(p.grad); p.grad = nil end
  end
  local send = u.gfull
  u.gfull = nil
  if send.dtype ~= self.reduce_dtype then
    local cast = gl.empty({ u.padded }, { dtype = self.reduce_dtype, device = u.device }):keep()
    G.check(lib.gl_copy(cast.c, send.c), 2)
    send:free()
    send = cast
  end
  local first = not u.received
  u.received = true
  local recv = (first and send.dtype == u.dtype) and u.gshard
    or gl.empty({ u.c }, { dtype = send.dtype, device = u.device }):keep()
  self.pending[#self.pending + 1] = { u = u, send = send, recv = recv, first = first, final = self.final,
    work = self.shard:reduce_scatter_async(recv, send, 'avg') }
  self.stats.reduces = self.stats.reduces + 1
  self:_release(u)
  self:_poll()
  -- each reduce-scatter in flight holds a unit's full gradient: bound them
  while #self.pending > M.MAX_IN_FLIGHT do
    local e = table.remove(self.pending, 1)
    e.work:wait()
    self:_complete(e)
  end
end

-- a finished collective: fold the received shard in, free the buffers; the
-- last reduce-scatter of a step starts the replica all-reduce (HSDP)
function FSDP:_complete(e)
  local u = e.u
  if e.recv ~= u.gshard then
    if e.first then G.check(lib.gl_copy(u.gshard.c, e.recv.c), 2)
    elseif e.recv.dtype == u.gshard.dtype then u.gshard:add_(e.recv)
    else
      local t = e.recv:to(u.gshard.dtype)
      u.gshard:add_(t)
      t:free()
    end
    e.recv:free()
  end
  e.send:free()
  if e.final and self.replica.size > 1 then
    u.synced = true
    self.syncs[#self.syncs + 1] = self.replica:all_reduce_async(u.gshard, 'avg')
  end
end

-- completes finished collectives, oldest first, without blocking
function FSDP:_poll()
  local q = self.pending
  while q[1] and q[1].work:test() do self:_complete(table.remove(q, 1)) end
end

-- Waits for every reduce-scatter, then for the replica all-reduces.  Only
-- here does a rank block on the replica group: during backward it waits
-- for shard-group collectives only, which every rank of the group issues
-- in the same order, so no wait can close a cycle across the two groups.
function FSDP:_drain()
  local q = self.pending
  while q[1] do
    local e = table.remove(q, 1)
    e.work:wait()
    self:_complete(e)
  end
  for _, w in ipairs(self.syncs) do w:wait() end
  self.syncs = {}
end

-- End of a micro-step's backward: units whose hooks did not all report
-- (parameters without a gradient) are reduced now; gathered units are
-- released unless an unsharded accumulation keeps them.
function FSDP:_end_micro(force)
  for _, u in ipairs(self.units) do
    u.pending_calls = 0
    if u.gfull then self:_finalize(u, force) end
    u.expecting = false
    if force or self.accumulate ~= 'unsharded' then self:_release(u) end
    if not u.gfull then
      for _, p in ipairs(u.params) do
        if p.grad then
          error(('fsdp: parameter %s of unit %s got a gradient after its unit was reduced; a unit\'s '
            .. 'parameters must be used by one call per forward (give the unit root = true)'):format(
            self.name_of[p], u.name), 0)
        end
      end
    end
  end
  self.phase = 'idle'
end

-- ------------------------------------------------- the policy interface --
function FSDP:zero_grad()
  self:_drain()
  for _, u in ipairs(self.units) do u.gshard:zero_(); u.received, u.synced = false, false end
end

function FSDP:before_micro_step(micro, accum)
  self:_end_micro(false)
  self.final = micro == accum
end

-- Reduces what backward left, releases every unit, waits for every
-- collective: the gradient shards are complete.  grad_norm and step call
-- it too (nothing to do after the trainer's after_backward), so a loop
-- that skips after_backward still sees complete gradients.
function FSDP:after_backward()
  self.final = true
  self:_end_micro(true)
  self:_drain()
  -- HSDP: a unit reduced on earlier micro-steps but not on the last one
  -- still needs its all-reduce over the replicas
  if self.replica.size > 1 then
    for _, u in ipairs(self.units) do
      if u.received and not u.synced then
        u.synced = true
        self.replica:all_reduce_async(u.gshard, 'avg'):wait()  -- over NCCL the device waits, not the host
      end
    end
  end
end

function FSDP:average_number(x) return self.comm:all_reduce_number(x, 'avg') end

-- L2 norm of the averaged gradient: the shards' squares over the shard
-- group (every replica holds the same shards after the all-reduce)
function FSDP:grad_norm()
  self:after_backward()
  local shards = {}
  for i, u in ipairs(self.units) do shards[i] = u.gshard end
  return math.sqrt(self.shard:all_reduce_number(B.sumsq_list(shards), 'sum'))
end

-- Calls f(p, grad, counted) for every piece of the averaged gradient this
-- rank holds (its part of each unit's shard; every replica holds the same
-- pieces, the first counts them), as Zero:each_grad: tensor parallelism
-- weighs and sums them over tp.
function FSDP:each_grad(f)
  self:after_backward()
  local counted = self.replica_rank == 0
  for _, u in ipairs(self.units) do
    for _, pc in ipairs(u.pieces) do f(pc.p, tmp_view(u.gshard, pc.start, pc.len), counted) end
  end
end

function FSDP:scale_grads(s)
  for _, u in ipairs(self.units) do u.gshard:mul_(s) end
end

-- Group settings (lr schedules, Muon momentum) are read from the wrapped
-- optimizer's groups here, so set_lr_mult / set_momentum apply.
function FSDP:step()
  self:after_backward()
  for _, o in ipairs(self.optimizer.optimizers or { self.optimizer }) do o.t = o.t + 1 end
  gl.no_grad(function()
    local exchange = self.muon and self:_muon_gather_grads()
    for _, u in ipairs(self.units) do
      for _, pc in ipairs(u.adam) do
        optim.AdamW.update_slice(pc.pv, pc.gv, pc.mv, pc.vv, 0, pc.len, pc.w.group, pc.w.opt.t)
      end
      dist.progress()
    end
    if exchange then self:_muon_update(exchange) end
    -- mixed precision: the updated masters, rounded, are the shards the forward gathers
    for _, u in ipairs(self.units) do
      if u.master then G.check(lib.gl_copy(u.pshard.c, u.master.c), 2) end
    end
  end)
end

-- Muon ownership and updates, inspection and checkpoints live beside this file.
for _, part in ipairs { 'gptlua.dist.fsdp_muon', 'gptlua.dist.fsdp_checkpoint' } do
  for name, f in pairs(require(part)) do FSDP[name] = f end
end

-- ------------------------------------------------------------------ detach --
-- Gathers every unit back into ordinary parameter tensors, restores the
-- model's and blocks' methods and removes the hooks: the model is whole
-- and unwrapped again.  Collective over the shard group.
function FSDP:detach()
  self:_drain()
  for _, u in ipairs(self.units) do
    if u.fp8 and u.state ~= 'sharded' then self:_release(u) end  -- gathered as FP8 codes: gather exactly
    if u.state == 'sharded' then self:_start_gather(u, true) end
    if u.state == 'gathering' then self:_wait_gather(u) end
    for i, p in ipairs(u.params) do
      local t = Tensor.empty(p.shape, { dtype = p.dtype, device = p.device }):keep()
      G.check(lib.gl_copy(t.c, shaped(u.full, u.offs[i], p.shape).c), 2)
      Tensor.rebind(p, t.c)
      if p.grad then p.grad = nil end
    end
    self.stats.live = self.stats.live - B.bytes(u.full)
    u.full:free()
    u.full, u.state = nil, 'detached'
  end
  self.model.forward, self.model.load_state_dict = self.saved.forward, self.saved.load_state_dict
  for _, u in ipairs(self.wrap) do
    u.module.forward = u.saved_forward
    u.module._fsdp_unit = nil
  end
  for _, h in ipairs(self.hooks) do
    local list = h[1]._hooks
    for i = #list, 1, -1 do if list[i] == h[2] then table.remove(list, i) end end
  end
  self.hooks = {}
end

return M
