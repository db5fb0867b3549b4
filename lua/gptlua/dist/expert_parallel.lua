-- gptlua.dist.expert_parallel — expert parallelism (--ep=N): the routed
-- experts of every mixture-of-experts layer (gptlua.moe) split over N ranks
-- of the data-parallel group, tokens sent to the rank that holds their
-- expert and back with all-to-alls of variable sizes.
--
-- Layout.  The dp group is cut into ep groups of N consecutive dp ranks
-- (dp rank d is rank d % N of ep group floor(d / N)); ep rank i holds
-- experts [i E/N, (i+1) E/N) of every layer, under their global names
-- (experts.<e>), so a state dict's keys are the same at any ep.  The
-- dp / N ranks with the same ep rank (one per ep group) hold the same
-- experts: they are the experts' replica group, as in DeepSpeed-MoE and
-- torchtitan.  Everything else (attention, router, embeddings, dense MLPs,
-- shared experts) is replicated or sharded by the data-parallel policy as
-- without ep.
--
-- A layer's forward on each rank (its own N tokens, as without ep):
--   1. the router and gl.moe_route as in one process: per-expert counts
--      (capacity applied here, on the rank the tokens come from, so the
--      same assignments are dropped as at ep 1 on the same dp ranks);
--   2. the counts go to the experts' owners (an all-to-all of E integers,
--      E/N to each peer) and are read on the host: they size the exchange;
--   3. gl.moe_permute puts the kept rows in expert order; the rows of peer
--      p's experts are contiguous, so one all-to-all sends each peer its
--      rows (dispatch);
--   4. the received rows (by source rank, then expert) are permuted into
--      expert order, every local expert's MLP runs as one grouped product
--      each way, and the rows are permuted back;
--   5. a second all-to-all returns them (combine), and gl.moe_combine sums
--      each token's expert outputs with its weights.
-- The shared experts (every token's) run while step 3's rows are in flight.
-- Backward runs the same exchanges in reverse (the all-to-all's gradient
-- is the all-to-all with the counts swapped).  The counts read in step 2
-- are a host synchronisation per layer and pass: on a device the exchange
-- sizes are host arguments of NCCL's send/recv, so this exchange cannot be
-- captured in a CUDA graph; the fixed-size exchange (below, chosen by
-- moe.ep_exchange) reads nothing on the host.  A plan (gptlua.plan, values
-- unknown) assumes balanced routing: every expert gets N K / E of a rank's
-- assignments.
--
-- Gradients.  An expert's gradient on its owner already sums the
-- contributions of every token of its ep group; summing over the replica
-- group adds the other groups', and dividing by dp gives the average over
-- the whole dp group that a replicated expert gets from ddp (every rank's
-- loss is its own tokens' mean); under cp the ep groups of the cp ranks
-- saw the sequences' other positions, and their gradients are averaged
-- over cp too.  The gradient norm adds the experts'
-- squares summed over the ep group (each expert once) to the policy's.
--
-- Optimizer.  The experts are ordinary parameters of the optimizer (each
-- expert's matrix its own Muon matrix).  Under ddp the optimizer's step
-- updates them with the rest; under zero1, zero2, fsdp and hsdp, which are
-- built without them, the optimizer's own step runs on them alone before
-- the policy's step updates its shards.
--
-- Checkpoints hold whole experts: the first replica's ep group gathers
-- every expert's parameters and optimizer state to world rank 0, which
-- writes them under their global names, so a checkpoint resumes at any ep
-- (each rank loads the experts it holds) and without ep.
--
-- Composition.  A rank builds only its own experts (gptlua.dist.pp_build,
-- with EP.holds).  Under tp every MoE block stays whole on each tp rank
-- (its input is the replicated residual), ep cutting each tp column's dp
-- ranks; under pp ep cuts each stage's dp ranks.  Their policies wrap this
-- one (tp's and pp's checkpoints gather the experts with Layout:gather).
local gl = require 'gptlua'
local A = require 'gptlua.autograd'
local nn = require 'gptlua.nn'
local B = require 'gptlua.dist.policies.base'
local ckpt = require 'gptlua.checkpoint'

local EP = {}

local function fail(msg) error('config: ' .. msg, 0) end

-- the data-parallel policies ep runs under: those that keep one process's parameters
EP.POLICIES = { ddp = true, zero1 = true, zero2 = true, fsdp = true, hsdp = true }

-- The layout's rules (gptlua.dist.compose calls this with the mesh's dp
-- size; a pure function of the config): one line for a bad ep.
function EP.check(cfg, dp)
  local ep = cfg.ep or 1
  if ep == 1 then return end
  local mc = require('gptlua.moe').resolve(cfg.moe, cfg.n_embd)
  if not mc then fail(('ep %d needs mixture-of-experts blocks (moe.experts > 0), got moe.experts 0'):format(ep)) end
  if mc.experts % ep ~= 0 then
    fail(('ep %d does not divide moe.experts %d (each ep rank holds moe.experts / ep experts)'):format(ep, mc.experts))
  end
  if dp % ep ~= 0 then fail(('ep %d does not divide the %d data-parallel ranks'):format(ep, dp)) end
  if not EP.POLICIES[cfg.dist] then
    fail(("dist '%s' with ep > 1 is not supported (expected 'ddp', 'zero1', 'zero2', 'fsdp' or 'hsdp')"):format(
      tostring(cfg.dist)))
  end
end

-- The ep group and the replica group of this rank, split from the
-- data-parallel Comm dp (collective over it).
function EP.groups(dp, ep)
  local r = dp.rank
  local group = dp:split(math.floor(r / ep), r, { size = ep, rank = r % ep })
  local replica = dp:split(r % ep, r, { size = dp.size / ep, rank = math.floor(r / ep) })
  return group, replica
end

-- name -> whether this rank holds the parameter of that name: every one but
-- the experts of its ep group's other ranks (the partial build,
-- gptlua.dist.pp_build, leaves those unmade)
function EP.holds(cfg, mesh)
  local mc = require('gptlua.moe').resolve(cfg.moe, cfg.n_embd)
  local per, rank = mc.experts / mesh.size.ep, mesh.coord.dp % mesh.size.ep
  return function(name)
    local e = name:match('%f[%w]experts%.(%d+)%.')
    return not e or math.floor(tonumber(e) / per) == rank
  end
end

-- --------------------------------------------------------------- exchange
local function sum(t, lo, hi) local s = 0 for i = lo, hi do s = s + t[i] end return s end

-- x (rows, C): rows send[p] to peer p in order -> (sum recv, C), the rows
-- of peer p in order; its gradient is the exchange back.  during (optional):
-- work to do while the exchange is in flight; its result is returned second.
local function exchange(x, send, recv, comm, during)
  local C = x.shape[2]
  local sc, rc = {}, {}
  for p = 1, comm.size do sc[p], rc[p] = send[p] * C, recv[p] * C end
  local out = gl.empty({ sum(recv, 1, #recv), C }, { dtype = x.dtype, device = x.device })
  local work = comm:all_to_all_async(out, x:is_contiguous() and x or x:contiguous(),
    { send_counts = sc, recv_counts = rc })
  local extra = during and during()
  work:wait()
  return A.record(out, { x }, function(_, g) return exchange(g, recv, send, comm) end, nil, 'ep_all_to_all'), extra
end

-- ----------------------------------------------------------------- layout
local Layout = {}
Layout.__index = Layout
EP.Layout = Layout

-- Keeps this rank's experts in every MoE layer of model (built by
-- gptlua.dist.pp_build without the others: the ones kept have a one-rank
-- build's values) and sets the layers to exchange their tokens.
-- group, replica: EP.groups; dp: the data-parallel group's size; cp: the
-- mesh's cp group (nil without context parallelism).
function EP.parallelize(model, group, replica, dp, cp)
  local self = setmetatable({ group = group, replica = replica, size = group.size, rank = group.rank, dp = dp,
                              cp = cp, layers = {}, params = {}, is_expert = {}, model = model }, Layout)
  for _, l in ipairs(require('gptlua.moe').layers(model)) do
    local m = l[2]
    local n = m.n_experts / self.size
    local first = self.rank * n
    local mine = nn.ModuleList()
    mine.n = n
    for j = 1, n do
      local ex = m.experts[first + j]
      mine:add(tostring(first + j - 1), ex)   -- its global name
      mine[j] = ex
      for _, p in ipairs(ex:parameters()) do self.params[#self.params + 1] = p; self.is_expert[p] = true end
    end
    m.experts = mine
    m.ep, m.n_local = self, n
    self.layers[#self.layers + 1] = m
  end
  return self
end

-- The expert rows of one layer (gptlua.moe's MoE:forward under ep): xf
-- (N, C) this rank's tokens, slots and counts from gl.moe_route, weights
-- (N, K); returns (N, C), each token's weighted sum of its experts' outputs,
-- and the result of during() (the shared experts: run while the rows are
-- on their way to the experts' ranks).
function Layout:forward(layer, xf, slots, counts, weights, run_experts, during)
  if self:fixed_exchange(layer) then return self:forward_fixed(layer, xf, slots, counts, weights, run_experts, during) end
  self:prepare_fixed(layer, slots, counts.device)
  local n, El, comm = self.size, layer.n_local, self.group
  local planned = require('gptlua.meta').is_meta(counts)
  local c = planned and self:balanced(layer, slots) or counts:tolist()
  local theirs = gl.empty({ n * El }, { dtype = 'int64', device = counts.device })
  comm:all_to_all(theirs, counts)   -- E/n counts to each peer: its experts' rows from this rank
  local got = theirs:tolist()
  if planned then  -- every peer routes alike: it sends this rank's experts what this rank's counts say
    for p = 1, n do for j = 1, El do got[(p - 1) * El + j] = c[self.rank * El + j] end end
  end
  local send, recv, kept = {}, {}, 0
  for p = 1, n do
    send[p] = sum(c, (p - 1) * El + 1, p * El)
    recv[p] = sum(got, (p - 1) * El + 1, p * El)
    kept = kept + send[p]
  end
  local rows, extra = exchange(gl.moe_permute(xf, slots, kept), send, recv, comm, during)
  -- received rows (source rank, then expert) -> expert order: row i goes to
  -- its expert's block, after the rows of lower ranks
  local R = rows.shape[1]
  local local_counts, start = {}, {}
  for j = 1, El do
    local s = 0
    for p = 1, n do s = s + got[(p - 1) * El + j] end
    local_counts[j] = s
  end
  local at = 0
  for j = 1, El do start[j] = at; at = at + local_counts[j] end
  local order, i = {}, 0
  for p = 1, n do
    for j = 1, El do
      for _ = 1, got[(p - 1) * El + j] do order[i + 1] = start[j]; start[j] = start[j] + 1; i = i + 1 end
    end
  end
  local dev = counts.device
  local idx = R > 0 and gl.tensor(order, { dtype = 'int64', device = dev }):view(R, 1)
    or gl.empty({ 0, 1 }, { dtype = 'int64', device = dev })
  local ones = gl.ones({ R, 1 }, { dtype = rows.dtype, device = rows.device })
  local y = run_experts(layer, gl.moe_permute(rows, idx, R), gl.tensor(local_counts, { dtype = 'int64', device = dev }))
  local back = exchange(gl.moe_combine(y, idx, ones), recv, send, comm)
  return gl.moe_combine(back, slots, weights), extra
end

-- The counts a plan (gptlua.plan: meta tensors, no values) assumes:
-- balanced routing, the N K assignments spread evenly over the experts
-- (the first N K mod E one more), each capped at the capacity.
function Layout:balanced(layer, slots)
  local N, K, E = slots.shape[1], slots.shape[2], layer.n_experts
  local cap = require('gptlua.moe').capacity(layer.capacity_factor, N, K, E)
  local c = {}
  for e = 1, E do
    c[e] = math.floor(N * K / E) + ((e - 1) < (N * K) % E and 1 or 0)
    if cap > 0 then c[e] = math.min(c[e], cap) end
  end
  return c
end

-- ------------------------------------------------------- fixed-size exchange
-- The exchange a CUDA graph can hold (moe.ep_exchange = 'fixed', or 'auto'
-- while a CUDA graph is being captured): nothing is read on the host.  Each
-- rank sends each peer a block of B rows, B known from the shapes alone
-- (Layout.block_rows), its rows for that peer's experts first, in expert
-- order, zero rows after them; the per-expert counts travel on the device
-- (the all-to-all of E integers, waited for by the device), and the
-- receiving side turns them into each received row's place in expert order
-- with a few int64 tensor ops (prefix sums as products with triangular
-- masks).  The rows meet their experts in the same order as in the counts
-- exchange, so the results are the same bit for bit; the cost is bytes:
-- every all-to-all moves ep B rows instead of the rows routed.

-- int64 constants on a device, made once (arange is a copy from the host,
-- which a captured graph may not contain); while planning (meta tensors) a
-- fresh one each time, so that no shape without data outlives the plan
local constants = {}
local function constant(key, device, make)
  if require('gptlua.meta').active() then return make() end
  key = device .. '/' .. key
  if not constants[key] then constants[key] = make():keep() end
  return constants[key]
end
local function ids(m, device) return gl.arange(0, m, { dtype = 'int64', device = device }) end

-- inclusive prefix sums along the rows of x (a, m), int64, on x's device:
-- sum over j' of x[i][j'] [j' <= j]
local function prefix_mask(m, device)
  return constant('prefix/' .. m, device, function()
    local i = ids(m, device)
    return gl.le(i:view(1, m), i:view(m, 1)):to('int64'):view(1, m, m)
  end)
end
local function prefix(x)
  local a, m = x.shape[1], x.shape[2]
  return (x:view(a, 1, m) * prefix_mask(m, x.device)):sum(3)
end

-- 0 .. m-1 as (m) int64 on device
local function iota(m, device) return constant('ids/' .. m, device, function() return ids(m, device) end) end

-- The rows B of each block: what one rank can route to one peer.  Dropless,
-- each of N tokens picks at most min(K, E/ep) of a peer's experts; with a
-- capacity each expert keeps at most min(capacity, N) rows.  (Dropless, an
-- all-to-all of the fixed exchange moves ep N min(K, E/ep) rows of C
-- elements per rank where the counts exchange moves the N K rows routed:
-- ep min(K, E/ep) / K times the bytes under balanced routing.)
function Layout:block_rows(layer, N, K)
  local El = layer.n_local
  local B = N * math.min(K, El)
  local cap = require('gptlua.moe').capacity(layer.capacity_factor, N, K, layer.n_experts)
  if cap > 0 then B = math.min(B, El * math.min(cap, N)) end
  return B
end

-- whether this layer's forward uses the fixed exchange (moe.ep_exchange)
function Layout:fixed_exchange(layer)
  local mode = layer.ep_exchange or 'auto'
  if mode == 'auto' then return require('gptlua.cuda').capturing() ~= nil end
  return mode == 'fixed'
end

-- Under 'auto' on a GPU, the steps before a capture use the counts
-- exchange: the fixed exchange's constants for this shape are made there,
-- so that the captured step finds them.
function Layout:prepare_fixed(layer, slots, device)
  if (layer.ep_exchange or 'auto') ~= 'auto' or device == 'cpu' or require('gptlua.meta').active() then return end
  local n, El = self.size, layer.n_local
  prefix_mask(n, device)
  prefix_mask(El, device)
  iota(El, device)
  iota(self:block_rows(layer, slots.shape[1], slots.shape[2]), device)
end

-- slots (N, K) into the expert-ordered buffer -> slots into the blocks:
-- a row of peer p's experts moves from its place after the rows of the
-- peers before p (S_p) to the start of block p (p B); dropped stay -1
local function block_slots(slots, counts, n, B)
  local N, K = slots.shape[1], slots.shape[2]
  local per_peer = counts:view(n, -1):sum(2)                    -- (n) rows for each peer
  local S = prefix(per_peer:view(1, n)):view(n) - per_peer      -- (n) exclusive: S_p, non-decreasing
  local s = slots:reshape(N * K, 1)
  local below = gl.le(S:view(1, n), s):to('int64')              -- (N K, n): S_p <= s
  local p = gl.clamp(below:sum(2) - 1, 0)                       -- the last peer with S_p <= s
  local start = gl.max(below * S:view(1, n), 2)                 -- its S_p
  local moved = s:view(N * K) - start + p * B
  return gl.where(gl.ge(s:view(N * K), 0), moved, -1):view(N, K)
end

-- got (n El): rows from source p for local expert j, at p El + j -> for
-- each of the n B received rows its row in expert order (-1: padding), as
-- (n B, 1), and the local experts' counts (El).  Row i of block p is the
-- one of expert j where Eb[p][j] <= i < Cb[p][j] (Cb the inclusive prefix
-- over j, Eb = Cb - G); it goes after the rows of lower experts (start[j])
-- and those of expert j from lower sources (before[p][j]).  (No index
-- ops: broadcast comparisons and one-hot sums, (n, B, El) int64 each.)
local function received_order(got, n, El, B)
  local dev = got.device
  local G = got:view(n, El)
  local Cb = prefix(G)
  local local_counts = G:sum(1)
  local start = prefix(local_counts:view(1, El)):view(El) - local_counts
  local before = prefix(G:t():contiguous()):t() - G
  local D = start:view(1, El) + before - (Cb - G)                        -- (n, El): row of (p, j, i) less i
  local i = iota(B, dev)
  local j = gl.le(Cb:view(n, 1, El), i:view(1, B, 1)):to('int64'):sum(3)  -- (n, B): the expert of row i of block p
  local onehot = gl.eq(iota(El, dev):view(1, 1, El), gl.clamp(j, 0, El - 1):view(n, B, 1)):to('int64')
  local dest = (onehot * D:view(n, 1, El)):sum(3) + i:view(1, B)
  return gl.where(gl.lt(j, El), dest, -1):view(n * B, 1), local_counts
end

-- Layout:forward with the fixed exchange (same arguments and results)
function Layout:forward_fixed(layer, xf, slots, counts, weights, run_experts, during)
  local n, El, comm = self.size, layer.n_local, self.group
  local B = self:block_rows(layer, slots.shape[1], slots.shape[2])
  local got = gl.empty({ n * El }, { dtype = 'int64', device = counts.device })
  comm:all_to_all_async(got, counts):wait()   -- E/n counts to each peer; the device waits, not the host
  local blocks = {}
  for p = 1, n do blocks[p] = B end
  local mine = block_slots(slots, counts, n, B)
  local rows, extra = exchange(gl.moe_permute(xf, mine, n * B), blocks, blocks, comm, during)
  local idx, local_counts = received_order(got, n, El, B)
  local ones = gl.ones({ n * B, 1 }, { dtype = rows.dtype, device = rows.device })
  local y = run_experts(layer, gl.moe_permute(rows, idx, n * B), local_counts)
  local back = exchange(gl.moe_combine(y, idx, ones), blocks, blocks, comm)
  return gl.moe_combine(back, mine, weights), extra
end

-- key -> {template, local index} for a key of this rank's experts (a
-- parameter's name or an optimizer state key holding it), else nil
local function expert_key(self, key)
  local head, e, tail = key:match('^(.-%f[%w]experts%.)(%d+)(%..+)$')
  if not head then return nil end
  return head .. '#' .. tail, tonumber(e) - self.rank * self.layers[1].n_local
end

-- The whole experts of entries ({key = tensor}, this rank's experts among
-- them) on world rank 0: every ep group of the first replica gathers; the
-- others return {}.  Collective over the ep group.
function Layout:gather(entries)
  if self.replica.rank ~= 0 then return {} end
  local items = {}
  for k, t in pairs(entries) do
    local tmpl, j = expert_key(self, k)
    if tmpl then items[#items + 1] = { tmpl .. '@' .. j, tmpl, j, t } end
  end
  table.sort(items, function(a, b) return a[1] < b[1] end)
  local out, El = {}, self.layers[1].n_local
  for _, it in ipairs(items) do
    local t = it[4]
    local parts = {}
    for p = 1, self.size do parts[p] = gl.empty(t.shape, { dtype = t.dtype, device = 'cpu' }) end
    self.group:all_gather(parts, t:is_contiguous() and t or t:contiguous())
    if self.group.rank == 0 then
      for p = 1, self.size do out[(it[2]:gsub('#', tostring((p - 1) * El + it[3]), 1))] = parts[p] end
    end
  end
  return out
end

-- sd without the experts this rank does not hold
function Layout:local_entries(sd)
  local out, El = {}, self.layers[1].n_local
  for k, t in pairs(sd) do
    local _, j = expert_key(self, k)
    if not j or (j >= 0 and j < El) then out[k] = t end
  end
  return out
end

-- ----------------------------------------------------------------- policy
-- The trainer's policy under ep: wraps the data-parallel policy (inner),
-- which holds every parameter but the experts.
local P = {}
P.__index = P
EP.Policy = P

function EP.policy(inner, layout)
  local self = setmetatable({ inner = inner, ep_layout = layout, optimizer = inner.optimizer, comm = inner.comm,
                              name = inner.name, collective_forward = true }, P)
  -- a sharded policy's pieces for its checkpoints (and the pipeline's), the experts' state beside them
  if inner.each_state then self.each_state, self.state_layout = P.sharded_each_state, P.sharded_state_layout end
  return self
end

function P:zero_grad()
  self.inner:zero_grad()
  for _, p in ipairs(self.ep_layout.params) do if p.grad then p.grad:zero_() end end
end
function P:before_micro_step(micro, accum) return self.inner:before_micro_step(micro, accum) end
function P:average_number(x) return self.inner:average_number(x) end

-- the experts' gradients: summed over their replicas (and cp), over dp (x cp) (see the header)
function P:after_backward()
  self.inner:after_backward()
  local L = self.ep_layout
  for _, p in ipairs(L.params) do
    if p.grad then
      if L.replica.size > 1 then L.replica:all_reduce_async(p.grad, 'sum'):wait() end  -- (NCCL: a device wait)
      if L.cp then L.cp:all_reduce_async(p.grad, 'sum'):wait() end
      p.grad:mul_(1 / (L.dp * (L.cp and L.cp.size or 1)))
    end
  end
end

function P:grad_norm()
  local s = 0
  for _, p in ipairs(self.ep_layout.params) do if p.grad then s = s + B.sumsq(p.grad) end end
  if self.ep_layout.size > 1 then s = self.ep_layout.group:all_reduce_number(s, 'sum') end
  return math.sqrt(self.inner:grad_norm() ^ 2 + s)
end

-- The step block's sum of squares (gptlua.train_graph's whole step, all
-- on the device): the experts' summed over the ep group (each expert
-- once), then the policy's gradients' (the same on every rank) added.
function P:block_sumsq(b, params)
  local L, experts, rest = self.ep_layout, {}, {}
  for _, p in ipairs(params) do
    if p.grad then
      local list = L.is_expert[p] and experts or rest
      list[#list + 1] = p.grad
    end
  end
  local slot = b:slot(gl.lib.GL_STEP_SUMSQ)
  self.expert_sumsq = self.expert_sumsq or gl.empty({ 1 }, { dtype = 'float64', device = b.device }):keep()
  b:sumsq(experts)
  self.expert_sumsq:copy_(slot)
  if L.size > 1 then L.group:all_reduce_async(self.expert_sumsq, 'sum'):wait() end
  b:sumsq(rest)
  slot:add_(self.expert_sumsq)
end

-- f(p, grad, counted) for every gradient this rank holds, counted once
-- over the world of one stage (the pipeline's norm): the inner policy's
-- pieces (ddp: every gradient, counted on its group's first rank) and the
-- experts, counted on their first replica
function P:each_grad(f)
  local inner, L = self.inner, self.ep_layout
  if inner.each_grad then inner:each_grad(f)
  else
    local counted = inner.comm.rank == 0
    for _, p in ipairs(inner.params) do if p.grad then f(p, p.grad, counted) end end
  end
  local counted = L.replica.rank == 0 and (not L.cp or L.cp.rank == 0)
  for _, p in ipairs(L.params) do if p.grad then f(p, p.grad, counted) end end
end

function P:scale_grads(s)
  self.inner:scale_grads(s)
  for _, p in ipairs(self.ep_layout.params) do if p.grad then p.grad:mul_(s) end end
end

-- The optimizer's own step over the experts alone: each part of it steps
-- groups holding only the experts (views of its groups: the rates the
-- schedules set are read through), and its step count is left for the
-- sharded policy's step to advance.
local function step_experts(optimizer, is_expert)
  for _, o in ipairs(optimizer.optimizers or { optimizer }) do
    local groups, t, mine = o.groups, o.t, {}
    for _, g in ipairs(groups) do
      local v = setmetatable({ params = {}, names = {} }, { __index = g })
      for i, p in ipairs(g.params) do
        if is_expert[p] then v.params[#v.params + 1], v.names[#v.names + 1] = p, g.names[i] end
      end
      if #v.params > 0 then mine[#mine + 1] = v end
    end
    if #mine > 0 then
      o.groups = mine
      local ok, err = pcall(o.step, o)
      o.groups = groups
      if not ok then error(err, 0) end
    end
    o.t = t
  end
end

function P:step()
  -- ddp's step is the optimizer's over every parameter; the sharded policies update their own parts only
  if self.inner.name ~= 'ddp' then step_experts(self.optimizer, self.ep_layout.is_expert) end
  return self.inner:step()
end

function P:detach() if self.inner.detach then self.inner:detach() end end
function P:optimizer_state_bytes()
  return (self.inner.optimizer_state_bytes and self.inner:optimizer_state_bytes() or 0)
    + (self.inner.name ~= 'ddp' and B.optimizer_state_bytes(self.optimizer) or 0)
end

local function merge(a, b) for k, v in pairs(b) do a[k] = v end return a end

-- fsdp's sharded checkpoint (gptlua.dist.policies.shards): its pieces, and
-- the whole experts' optimizer state as state rank 0 writes once
function P:sharded_each_state(f, all)
  self.inner:each_state(f, all)
  for k, t in pairs(self.gathered or {}) do f(k, t, 0, true, 'state') end
end
function P:sharded_state_layout()
  local out = self.inner:state_layout()
  for k, t in pairs(self.gathered or {}) do out[k] = t.shape end
  return out
end

function P:save_checkpoint(trainer, model_sd, opt_sd, state)
  local L = self.ep_layout
  local experts_model, experts_opt = L:gather(model_sd), L:gather(opt_sd.tensors)
  state.ep = L.size
  if self.inner.save_checkpoint then  -- a sharded policy's pieces, and the experts' state whole
    local full = merge(self.inner.full_state_dict and self.inner:full_state_dict(0) or model_sd, experts_model)
    if self.inner.full_state_dict then state.fsdp = { shard_size = self.inner.S } end
    self.gathered = experts_opt
    local path = require('gptlua.dist.policies.shards').save(trainer, self, full, state)
    self.gathered = nil
    return path
  end
  if trainer.rank ~= 0 then return nil end
  local path, pending = ckpt.save(trainer.ckpt_dir, trainer.step, { model = merge(model_sd, experts_model),
    optim = merge(opt_sd.tensors, experts_opt), state = state }, trainer.cfg.keep_last, trainer.save_writer)
  if not pending then trainer:print(('saved checkpoint %s'):format(path)) end
  return path
end

-- the model's part of a checkpoint (train.lua's load hook): this rank's experts and the rest
function P:load_model(sd)
  self.ep_layout.model:load_state_dict(self.ep_layout:local_entries(sd))
end

function P:load_checkpoint(trainer, c, path)
  local shards = require 'gptlua.dist.policies.shards'
  local st = c.state
  if not self.inner.load_checkpoint then  -- ddp: the optimizer's whole state, the other ranks' experts left out
    local tensors = st.shards and shards.full_tensors(path, c) or c.optim
    self.optimizer:load_state_dict({ step = st.opt_step, steps = st.opt_steps, tensors = tensors })
    return
  end
  self.inner:load_checkpoint(trainer, c, path)
  self:load_expert_state(shards.index(path, c), path)
end

-- Under a sharded policy: each expert's optimizer state, whole, from
-- wherever the checkpoint has it (index: gptlua.dist.policies.shards.index).
function P:load_expert_state(index, path)
  local shards = require 'gptlua.dist.policies.shards'
  local groups = require 'gptlua.optim.groups'
  local own = B.owners(self.optimizer, self.name)
  for _, p in ipairs(self.ep_layout.params) do
    local w = own[p]
    if w then
      local st_p = groups.new_state(p, w.opt:param_state(p, w.group), w.opt.state_dtype)
      for k, t in pairs(st_p) do
        if k ~= 'master' then shards.fill(index, w.opt.prefix .. w.name .. '.' .. k, 0, t, path) end
      end
      w.opt.state[p] = st_p
    end
  end
end

return EP
