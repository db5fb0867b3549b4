-- gptlua.moe — mixture-of-experts layers (as DeepSeek-V3, OLMoE, Megatron-Core
-- have them) for both model families: the trainer's `moe.*` keys, the
-- router (plain Lua a recipe replaces with its `moe_router` hook), the layer,
-- and what the trainer does with it around a step (the gradient scale of the
-- balancing losses, the auxiliary-loss-free bias update, the metrics).
--
-- A layer: router logits x W_r^T (N, E); the router picks K experts per
-- token and their weights; gl.moe_route turns the choice into per-expert
-- counts and each assignment's row in expert order (dropping past the
-- capacity); gl.moe_permute copies the token rows into that order,
-- gl.grouped_linear runs every expert's MLP over its rows (one engine call
-- per product for all experts), gl.moe_combine sums each token's expert
-- outputs with its weights; shared experts (one MLP of S x hidden) see
-- every token.  The balancing losses ride on the layer's output
-- (attach_losses): their gradient joins in backward without passing
-- through the language-model loss, so they work under activation
-- checkpointing and pipeline stages, and the reported loss stays the
-- language model's.
local gl = require 'gptlua'
local nn = require 'gptlua.nn'
local common = require 'gptlua.models.common'
local A = require 'gptlua.autograd'

local M = {}

-- ------------------------------------------------------------ configuration
-- The trainer's `moe` table (gptlua.train's defaults); experts = 0: no MoE.
M.TRAINER_DEFAULTS = { experts = 0, top_k = 2, shared = 0, every = 1, hidden = 0, capacity_factor = 0,
                       router = 'softmax', aux_loss = 0, z_loss = 0, bias_update = 0, ep_exchange = 'auto' }
function M.trainer_defaults()
  local t = {}
  for k, v in pairs(M.TRAINER_DEFAULTS) do t[k] = v end
  return t
end

local function bad(k, want, v)
  error(('moe.%s must be %s, got %s'):format(k, want, type(v) == 'string' and "'" .. v .. "'" or tostring(v)), 0)
end
local function int_in(t, k, lo, hi)
  local v = t[k]
  if type(v) ~= 'number' or v ~= math.floor(v) or v < lo or (hi and v > hi) then
    bad(k, hi and ('an integer in [%d, %d]'):format(lo, hi) or ('an integer >= %d'):format(lo), v)
  end
end
local function real_at_least(t, k, lo)
  local v = t[k]
  if type(v) ~= 'number' or v ~= v or v < lo or v == math.huge then bad(k, ('a finite number >= %s'):format(lo), v) end
end

-- The trainer's table checked, with hidden resolved (0: the dense MLP's
-- 4 n_embd); nil when experts is 0.  A bad value is one line naming moe.KEY.
function M.resolve(t, n_embd)
  t = t or {}
  for k in pairs(t) do
    if M.TRAINER_DEFAULTS[k] == nil and k ~= 'resolved' then error(('moe.%s is not a moe key'):format(tostring(k)), 0) end
  end
  local r = M.trainer_defaults()
  for k, v in pairs(t) do r[k] = v end
  int_in(r, 'experts', 0)
  if r.experts == 0 then return nil end
  int_in(r, 'top_k', 1, r.experts)
  int_in(r, 'shared', 0)
  int_in(r, 'every', 1)
  int_in(r, 'hidden', 0)
  for _, k in ipairs({ 'capacity_factor', 'aux_loss', 'z_loss', 'bias_update' }) do real_at_least(r, k, 0) end
  if r.router ~= 'softmax' and r.router ~= 'sigmoid' then bad('router', "'softmax' or 'sigmoid'", r.router) end
  if r.ep_exchange ~= 'auto' and r.ep_exchange ~= 'counts' and r.ep_exchange ~= 'fixed' then
    bad('ep_exchange', "'auto', 'counts' or 'fixed'", r.ep_exchange)
  end
  if r.hidden == 0 then r.hidden = 4 * n_embd end
  return r
end

-- a model's `moe` option: false (none), or a trainer-style table resolved
-- (false again when it has no experts)
function M.model_config(v, n_embd, what)
  if v == false or v == nil then return false end
  if type(v) ~= 'table' then
    error(('%s: moe must be false or a table of moe keys, got %s'):format(what, tostring(v)), 0)
  end
  if v.resolved then return v end
  local r = M.resolve(v, n_embd)
  if not r then return false end
  r.resolved = true
  return r
end

-- parameters a token does not use: in each MoE layer, the experts it is
-- not routed to (E - K of them); FLOPs count the active ones
function M.inactive_params(model)
  local n = 0
  for _, l in ipairs(M.layers(model)) do
    local m = l[2]
    local per = m.experts[1].c_fc.weight:numel() + m.experts[1].c_proj.weight:numel()
    n = n + (m.n_experts - m.top_k) * per
  end
  return n
end

-- whether block i (1-based) is a MoE block: every `every`-th one
function M.is_moe_block(mc, i) return type(mc) == 'table' and i % mc.every == 0 end

-- the rows each expert may keep: ceil(capacity_factor N K / E), 0 (dropless)
-- when capacity_factor is 0
function M.capacity(capacity_factor, N, K, E)
  if capacity_factor == 0 then return 0 end
  return math.max(1, math.ceil(capacity_factor * N * K / E))
end

-- ------------------------------------------------------------------ router
-- The default router.  A recipe's `moe_router(cfg)` hook returns its own
-- table with the same three methods (it may start from gptlua.moe.router
-- and replace one):
--   route(layer, logits)  -> experts (N, K) int64, weights (N, K), scores (N, E)
--   losses(layer, logits, scores, load, N) -> balancing loss, z-loss (each a
--                            scalar tensor or nil); load (E) int64 and N:
--                            the micro-batch's assignments per expert and
--                            tokens, logits and scores: this rank's rows
--                            (all of them but under a split sequence, where
--                            a mean over them is this rank's part)
--   after_step(layer, load) after the optimizer step; load (E) float, the
--                            assignments routed to each expert this step on
--                            every data-parallel rank
local Router = {}
Router.__index = Router
M.Router = Router

function M.router(mc)
  return setmetatable({ kind = mc.router, top_k = mc.top_k, aux_loss = mc.aux_loss, z_loss = mc.z_loss,
                        bias_update = mc.bias_update }, Router)
end

-- the ids 0 .. E-1 as a (1, E) int64 row on device, made once (a copy from
-- the host, which a step captured as a CUDA graph may not contain); while
-- planning (the meta device) a fresh one each time, so that no shape
-- without data outlives the plan into a run
local id_rows = {}
local function expert_ids(E, device)
  if require('gptlua.meta').active() then return gl.arange(0, E, { dtype = 'int64', device = device }):view(1, E) end
  local key = device .. '/' .. E
  if not id_rows[key] then id_rows[key] = gl.arange(0, E, { dtype = 'int64', device = device }):view(1, E):keep() end
  return id_rows[key]
end

-- the K largest entries of each row of x (N, E), as int64 ids (N, K) in
-- descending order (ties: the lower id first); no gradient
function M.top_k(x, K)
  return gl.no_grad(function()
    local E = x.shape[2]
    local ids = expert_ids(E, x.device)
    local picks, cur = {}, x
    for k = 1, K do
      local _, i = gl.max(cur, 2, true)
      picks[k] = i
      if k < K then cur = gl.where(gl.eq(ids, i), -math.huge, cur) end
    end
    return K == 1 and picks[1] or gl.cat(picks, 2)
  end)
end

-- Scores: softmax over the experts, or each expert's sigmoid (DeepSeek-V3).
-- The choice adds the layer's expert_bias to the scores (the bias only
-- steers which experts are picked, never their weights); the weights are the
-- picked scores, normalised to sum 1 when K > 1.
function Router:route(layer, logits)
  local scores = self.kind == 'sigmoid' and gl.sigmoid(logits) or gl.softmax(logits, -1)
  local pick = scores:detach()
  if self.bias_update > 0 then pick = pick + layer.expert_bias:to(pick.dtype):view(1, -1) end
  local experts = M.top_k(pick, self.top_k)
  local w = gl.gather(scores, 2, experts)
  if self.top_k > 1 then w = w / w:sum(2, true) end
  return experts, w, scores
end

-- The balancing loss of Switch/GShard, aux_loss E sum_e f_e P_e, f_e the
-- fraction of the N K assignments routed to e, P_e the mean of e's
-- (per-token normalised) scores; and the router z-loss of ST-MoE, z_loss
-- mean over tokens of logsumexp(logits)^2.
function Router:losses(layer, logits, scores, load, N)
  local aux, z
  local E, K = logits.shape[2], self.top_k
  if self.aux_loss > 0 then
    local probs = self.kind == 'sigmoid' and scores / scores:sum(2, true) or scores
    local f = load:to(probs.dtype) * (E / (N * K))
    aux = (probs:mean(1) * f):sum() * self.aux_loss
  end
  if self.z_loss > 0 then
    local m = gl.no_grad(function() return (gl.max(logits:detach(), 2, true)) end)
    local lse = gl.log(gl.exp(logits - m):sum(2, true)) + m
    z = (lse * lse):mean() * self.z_loss
  end
  return aux, z
end

-- DeepSeek-V3's auxiliary-loss-free balancing: each expert's bias moves
-- by bias_update towards the mean load, b_e += rate sign(mean - load_e).
function Router:after_step(layer, load)
  if self.bias_update <= 0 then return end
  gl.no_grad(function()
    local mean = load:mean()
    local dir = gl.lt(load, mean):to(load.dtype) - gl.gt(load, mean):to(load.dtype)
    layer.expert_bias:add_((dir * self.bias_update):to(layer.expert_bias.dtype))
  end)
end

-- ------------------------------------------------------------------- layer
-- out = x plus, in backward, the balancing losses' gradient at `scale` (the
-- factor the trainer gives the language-model loss: 1 / accumulation)
local function attach_losses(out, losses, scale)
  local inputs = { out }
  for _, l in ipairs(losses) do inputs[#inputs + 1] = l end
  local res = out:detach()
  return A.record(res, inputs, function(_, g)
    local grads = { g }
    for i, l in ipairs(losses) do grads[i + 1] = gl.full({}, scale, { dtype = l.dtype, device = l.device }) end
    return unpack(grads, 1, #inputs)
  end, nil, 'moe_losses')
end

local Expert = nn.class('MoEExpert', nn.Module)
function Expert:__init(C, H, fc_std, proj_std)
  self:add('c_fc', nn.Linear(C, H, { bias = false, std = fc_std }))
  self:add('c_proj', nn.Linear(H, C, { bias = false, std = proj_std }))
end

local MoE = nn.class('MoE', nn.Module)
M.MoE = MoE
-- mc: a resolved moe table; C: width; act: 'gelu' or 'relu2'; fc_std and
-- proj_std: the init of the experts' input and output matrices (0: zeros)
-- opts.dropout: dropout on the layer's output (gpt2's MLP has it)
function MoE:__init(mc, C, act, fc_std, proj_std, opts)
  local E = mc.experts
  self.dropout = opts and opts.dropout or 0
  self.n_experts, self.top_k, self.capacity_factor, self.act = E, mc.top_k, mc.capacity_factor, act
  self.ep_exchange = mc.ep_exchange  -- (read by gptlua.dist.expert_parallel)
  self:add('router', nn.Linear(C, E, { bias = false, std = fc_std }))
  local ex = self:add('experts', nn.ModuleList())
  for _ = 1, E do ex:append(Expert(C, mc.hidden, fc_std, proj_std)) end
  if mc.shared > 0 then self:add('shared', Expert(C, mc.shared * mc.hidden, fc_std, proj_std)) end
  self:buffer('expert_bias', gl.zeros({ E }))
  self.policy = M.router(mc)
  self.loss_scale = 1
end

-- every expert's MLP this layer holds over x (rows in expert order,
-- counts (its experts) rows each): one grouped product each way
function M.run_experts(layer, x, counts)
  local fc, proj = {}, {}
  for e = 1, layer.experts.n do fc[e], proj[e] = layer.experts[e].c_fc.weight, layer.experts[e].c_proj.weight end
  return gl.grouped_linear(gl[layer.act](gl.grouped_linear(x, fc, counts)), proj, counts)
end

-- x (..., C); residual (optional): residual + moe(x)
function MoE:forward(x, residual)
  local C = x.shape[#x.shape]
  local N = x:numel() / C
  local xf = x:reshape(N, C)
  local logits = self.router(xf)
  local experts, weights, scores = self.policy:route(self, logits)
  local E, K = self.n_experts, experts.shape[2]
  -- the sequence split over ranks (context or sequence parallelism): this
  -- rank holds N of the micro-batch's Nb tokens, and what one process
  -- computes over the micro-batch (capacity, load) is computed over all Nb
  local split = self.token_split and self.token_split.active() and self.token_split
  local Nb = split and N * split.comm.size or N
  local cap = M.capacity(self.capacity_factor, Nb, K, E)
  local slots, counts, load, kept
  if split then
    slots, counts, load, kept = M.split_route(split, experts, x.shape, E, cap)
  else
    slots, counts, load = gl.moe_route(experts, E, cap)
    kept = counts
  end
  local out, shared
  local function run_shared() return common.mlp(self.shared, xf, self.act) end
  if self.ep then  -- expert parallelism: the rows go to the ranks holding their experts (gptlua.dist.expert_parallel)
    out, shared = self.ep:forward(self, xf, slots, counts, weights:to(xf.dtype), M.run_experts,
      self.shared and run_shared)  -- (the shared experts while the rows are in flight)
  else
    local rows = cap > 0 and math.min(N * K, E * cap) or N * K
    out = gl.moe_combine(M.run_experts(self, gl.moe_permute(xf, slots, rows), counts), slots, weights:to(xf.dtype))
    shared = self.shared and run_shared()
  end
  if shared then out = out + shared end
  -- a training forward that builds a graph: once per micro-step, also
  -- under activation checkpointing (whose first pass runs without one)
  if self.training and gl.is_grad_enabled() then
    local aux, z = self.policy:losses(self, logits, scores, load, Nb)
    self:observe(load, kept, Nb * K, aux, z)
    local losses = {}
    if aux then losses[#losses + 1] = aux end
    if z then losses[#losses + 1] = z end
    -- (a split whose ranks' gradients are summed, not averaged: each rank's
    -- share of the losses, their mean over the ranks being the micro-batch's)
    if #losses > 0 then out = attach_losses(out, losses, self.loss_scale / (split and split.summed or 1)) end
  end
  out = gl.dropout(out:reshape(x.shape), self.dropout, self.training)
  if residual then return residual + out end
  return out
end

-- this step's load, kept rows and losses, summed over its micro-steps on
-- the device (read on the host only when the trainer logs): load, kept
-- and assignments the micro-batches' (a split sequence's over its group),
-- the losses this rank's
function MoE:observe(load, counts, assignments, aux, z)
  gl.no_grad(function()
    local s = self.stats
    if not s then
      s = { load = gl.zeros({ self.n_experts }, { dtype = 'float64', device = load.device }):keep(),
            kept = gl.zeros({ self.n_experts }, { dtype = 'float64', device = load.device }):keep(),
            aux = gl.zeros({}, { dtype = 'float64', device = load.device }):keep(),
            z = gl.zeros({}, { dtype = 'float64', device = load.device }):keep(), assignments = 0, passes = 0 }
      self.stats = s
    end
    s.load:add_(load:to('float64'))
    s.kept:add_(counts:to('float64'))
    if aux then s.aux:add_(aux:detach():to('float64')) end
    if z then s.z:add_(z:detach():to('float64')) end
    s.assignments, s.passes = s.assignments + assignments, s.passes + 1
  end)
end

-- ---------------------------------------------------- a split sequence
-- Context parallelism (gptlua.dist.context_parallel) and tensor
-- parallelism's sequence parallel (gptlua.dist.tensor_parallel) give each
-- rank of a group its share of every sequence of the micro-batch, and the
-- layer routes only that share.  What one process computes over the whole
-- micro-batch is computed over the group: the load (an all-reduce of E
-- counts) that the balancing loss and the bias update read, the capacity
-- and which assignments it drops (every rank's choices gathered into
-- sequence order, routed as one process routes them, each rank keeping its
-- own), and the metrics.  The balancing and z losses are means over a
-- rank's own tokens, which average over the group to the micro-batch's:
-- under cp the group's gradients are averaged (the data-parallel policy
-- over dp x cp), so each rank's losses count as they are; under sp they are
-- summed over tp (the replicated parameters' rule), so each counts 1/tp.
-- The experts stay whole on every rank of the group (each rank runs them
-- over its own tokens) and their gradients are reduced over it as the
-- other replicated parameters' are.

-- Sets model's MoE layers to route a split sequence: comm the ranks that
-- split it, active() whether this forward splits it, segments_of(rank,
-- Tl) -> the {first position, length} runs of the sequence that rank
-- (of comm) holds, in its row order (Tl rows in all), summed: how many of
-- the group's ranks sum their gradients rather than average them.
function M.split_tokens(model, comm, active, segments_of, summed)
  for _, l in ipairs(M.layers(model)) do
    l[2].token_split = { comm = comm, active = active, segments_of = segments_of, summed = summed }
  end
end

-- gl.moe_route for a split micro-batch: experts (N, K) this rank's choices
-- of its rows of shape (B, Tl, C); returns this rank's slots and counts,
-- the micro-batch's load and kept rows per expert.  Collective.
function M.split_route(split, experts, shape, E, cap)
  return gl.no_grad(function()
    local comm, n = split.comm, split.comm.size
    if cap == 0 then
      local slots, counts, load = gl.moe_route(experts, E, 0)
      local all = load:clone()
      comm:all_reduce_async(all, 'sum'):wait()
      return slots, counts, all, all
    end
    -- the capacity keeps each expert's first assignments in sequence order
    local B, Tl, K = shape[1], shape[2], experts.shape[2]
    local buf = gl.empty({ n, B, Tl, K }, { dtype = experts.dtype, device = experts.device })
    comm:all_gather_async(buf, experts:contiguous():view(B, Tl, K)):wait()
    local runs = {}
    for q = 0, n - 1 do
      local at = 0
      for _, s in ipairs(split.segments_of(q, Tl)) do
        runs[#runs + 1] = { s[1], buf:select(1, q + 1):narrow(2, at + 1, s[2]) }
        at = at + s[2]
      end
    end
    table.sort(runs, function(a, b) return a[1] < b[1] end)
    local parts = {}
    for i, r in ipairs(runs) do parts[i] = r[2] end
    local whole = gl.cat(parts, 2):contiguous()
    local all_slots, kept, load = gl.moe_route(whole:view(B * n * Tl, K), E, cap)
    -- this rank's rows of the micro-batch's plan: which of its assignments are kept
    local by_pos, mine = all_slots:view(B, n * Tl, K), {}
    for i, s in ipairs(split.segments_of(comm.rank, Tl)) do mine[i] = by_pos:narrow(2, s[1] + 1, s[2]) end
    local keep = gl.ge(gl.cat(mine, 2):contiguous():view(B * Tl, K), 0)
    -- routed locally, each dropped assignment sent to an expert E past the
    -- real ones (its rows after theirs, left out of counts and slots)
    local slots, counts = gl.moe_route(gl.where(keep, experts, E), E + 1, 0)
    return gl.where(keep, slots, -1), counts:narrow(1, 1, E):contiguous(), load, kept
  end)
end

-- --------------------------------------------------------- around a step
-- the model's MoE layers, in block order, as {name, layer}
function M.layers(model)
  local out = {}
  local function walk(m, prefix)
    if getmetatable(m) == MoE then out[#out + 1] = { prefix, m } return end
    for _, n in ipairs(m._modules or {}) do walk(m[n], prefix == '' and n or prefix .. '.' .. n) end
  end
  walk(model, '')
  return out
end

-- before a step: the balancing losses' gradient scale, the statistics cleared
function M.begin_step(layers, scale)
  for _, l in ipairs(layers) do
    local m = l[2]
    m.loss_scale = scale
    local s = m.stats
    if s then
      gl.no_grad(function() s.load:zero_(); s.kept:zero_(); s.aux:zero_(); s.z:zero_() end)
      -- a step replayed from a CUDA graph runs no Lua forward: its passes
      -- are those of the step before (the shapes are fixed under a graph)
      if s.passes > 0 then s.step_assignments, s.step_passes = s.assignments, s.passes end
      s.assignments, s.passes = 0, 0
    end
  end
end

-- after the optimizer step: each layer's router sees the step's load,
-- summed over the ranks with other micro-batches (comm: the mesh's dp
-- group, or the world's without a mesh; nil: one process)
function M.after_step(layers, comm)
  for _, l in ipairs(layers) do
    local m = l[2]
    if m.stats then
      local load = m.stats.load
      if comm and comm.size > 1 then
        load = load:clone()
        comm:all_reduce(load, 'sum')
      end
      m.policy:after_step(m, load)
    end
  end
end

-- What users watch, per layer (its module name) and over all layers: load
-- max/mean and coefficient of variation (over the experts, this step's
-- assignments of this rank's micro-batches), the fraction of assignments
-- dropped, the balancing and z losses (mean over micro-steps; under a split
-- sequence the group's mean: collective, every rank of it calls this), the
-- expert bias range.
function M.metrics(layers)
  local rec, worst, dropped_all, total_all = {}, 0, 0, 0
  for _, l in ipairs(layers) do
    local name, m = l[1], l[2]
    local s = m.stats
    if s and s.passes == 0 and s.step_passes then  -- a replayed step (begin_step)
      s.assignments, s.passes = s.step_assignments, s.step_passes
    end
    if s and s.passes > 0 then
      local load, kept = s.load:tolist(), s.kept:tolist()
      local E, sum, sq, mx, k = #load, 0, 0, 0, 0
      for e = 1, E do sum = sum + load[e]; mx = math.max(mx, load[e]); k = k + kept[e] end
      local mean = sum / E
      for e = 1, E do sq = sq + (load[e] - mean) ^ 2 end
      local block = name:match('h%.(%d+)%.mlp$')
      local p = 'moe.' .. (block and 'layer' .. block or name) .. '.'
      rec[p .. 'load_max_mean'] = mean > 0 and mx / mean or 0
      rec[p .. 'load_cv'] = mean > 0 and math.sqrt(sq / E) / mean or 0
      rec[p .. 'dropped'] = s.assignments > 0 and (s.assignments - k) / s.assignments or 0
      local aux, z = s.aux:item() / s.passes, s.z:item() / s.passes
      local split = m.token_split
      if split then
        aux = split.comm:all_reduce_number(aux, 'sum') / split.comm.size
        z = split.comm:all_reduce_number(z, 'sum') / split.comm.size
      end
      rec[p .. 'aux_loss'], rec[p .. 'z_loss'] = aux, z
      local b = m.expert_bias:to('float64'):tolist()
      local lo, hi = math.huge, -math.huge
      for e = 1, #b do lo, hi = math.min(lo, b[e]), math.max(hi, b[e]) end
      rec[p .. 'bias_min'], rec[p .. 'bias_max'] = lo, hi
      worst = math.max(worst, rec[p .. 'load_max_mean'])
      dropped_all, total_all = dropped_all + s.assignments - k, total_all + s.assignments
    end
  end
  if total_all > 0 then
    rec.moe_load_max_mean = worst
    rec.moe_dropped = dropped_all / total_all
  end
  return rec
end

-- installs a recipe's router (its moe_router hook's result) in every layer
function M.install_router(layers, router)
  for _, l in ipairs(layers) do l[2].policy = router end
end

return M
