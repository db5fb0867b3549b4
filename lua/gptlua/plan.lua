-- gptlua.plan — the memory planner: one rank's memory for a training run,
-- found by running the trainer itself on the meta device (gptlua.meta)
-- in a fake world (gptlua.dist.fake) of the planned size.
--
--   gptlua --plan recipe.lua [--world=N] [--rank=R] [--device_memory=80GiB] [--margin=0.1] [--key=value ...]
--   local r = require('gptlua.plan').plan(recipe, { world = 8, rank = 0, device_memory = '80GiB' })
--   r.bytes.total, r.groups, r.traffic, r.fits, r.suggestions, r.text
--
-- How: gptlua.train builds the trainer from the recipe as a run would (its
-- dataset and loaders for real, with their values: meta.paused; the model,
-- the optimizer and the policy on the meta device), then runs two full
-- optimizer steps (the first creates the optimizer state, the second is
-- the steady state) with every micro-step, the policy's collectives and
-- the optimizer.  No kernel runs and no memory is taken beyond the data's;
-- the allocator's meta twin charges every storage the size class the real
-- allocator would (engine/alloc.c), so its peak is the run's peak, the
-- dataset and the loaders' batches counted.  One model of a step, the
-- trainer's own: a change to an op, a model or a policy is planned as it is.
--
-- What is live at the peak: the plan runs again and stops at the
-- allocation that reached the peak, and sorts the live storages by who
-- holds them: parameters (the model's, or the policy's flat buffers they
-- view), gradients, optimizer state, master weights (optimizer state named
-- master), communication buffers (tensors the policy holds besides those),
-- data (what the dataset and loaders hold: real tensors), activations by
-- the layer whose forward made them (backward: the rest).  Collective
-- bytes are the fake world's count for the second step, per group.
--
-- Suggestions when it does not fit are plans of the changed config (a
-- smaller micro-batch with more accumulation, activation checkpointing, a
-- more sharded policy), each run like the first.
local gl = require 'gptlua'
local meta = require 'gptlua.meta'
local fake = require 'gptlua.dist.fake'
local train = require 'gptlua.train'
local report = require 'gptlua.plan_report'

local M = {}

M.POLICIES = { 'none', 'ddp', 'zero1', 'zero2', 'fsdp', 'hsdp' }
local POLICY_RANK = { none = 0, ddp = 1, zero1 = 2, zero2 = 3, fsdp = 4, hsdp = 4 }
M.DEFAULT_MARGIN = 0.10
M.fmt_bytes, M.parse_bytes = report.fmt_bytes, report.parse_bytes

local function fail(msg) error('plan: ' .. msg, 0) end

-- ------------------------------------------------------------ config in --
local PLAN_OPTS = { world = true, rank = true, device_memory = true, mem = true, margin = true }

-- device memory when none is given: the GPU's, or the machine's RAM
local function default_device_memory(device)
  if device ~= 'cpu' then
    local ok, cuda = pcall(require, 'gptlua.cuda')
    if ok and cuda.is_available() then
      local id = require('gptlua.tensor').device_id(device, 'plan: device')
      local props = cuda.get_device_properties(id)
      return props.total_memory, ('%s, %s'):format(device, props.name)
    end
    fail(('device %s is not available here to read its memory: pass --device_memory=SIZE (e.g. 80GiB)'):format(device))
  end
  local f = io.open('/proc/meminfo', 'r')
  if f then
    local text = f:read('*a')
    f:close()
    local kb = text:match('MemTotal:%s*(%d+)')
    if kb then return tonumber(kb) * 1024, 'cpu RAM, /proc/meminfo' end
  end
  fail('cannot read the machine memory from /proc/meminfo: pass --device_memory=SIZE')
end

local function int_opt(v, what, lo)
  local n = tonumber(v)
  if not n or n < lo or n ~= math.floor(n) then
    fail(('%s must be %s, got %s'):format(what, lo == 1 and 'a positive integer' or 'an integer >= 0', tostring(v)))
  end
  return n
end

-- The recipe (a copy), its --key=value strings and the planner's options.
local function resolve(recipe, args, opts)
  if type(recipe) ~= 'table' then fail('expected a recipe or config table, got ' .. type(recipe)) end
  opts = opts or {}
  local rargs = {}
  local popts = { world = opts.world, rank = opts.rank, device_memory = opts.device_memory, margin = opts.margin }
  local device_arg
  args = args or {}
  local i = 0
  while i < #args do
    i = i + 1
    local a = args[i]
    local k, v = tostring(a):match('^%-%-([%w_%-]+)=(.*)$')
    k = k and k:gsub('%-', '_')
    local bare = tostring(a):match('^%-%-([%w_%-]+)$')
    if bare and (PLAN_OPTS[bare:gsub('%-', '_')] or bare == 'device') then
      local nxt = args[i + 1]  -- --world 8 as --world=8
      if nxt == nil or tostring(nxt):sub(1, 2) == '--' then fail(('--%s needs a value: --%s=VALUE'):format(bare, bare)) end
      k, v, i = bare:gsub('%-', '_'), tostring(nxt), i + 1
    end
    if k and PLAN_OPTS[k] then popts[k == 'mem' and 'device_memory' or k] = v
    elseif k == 'device' then device_arg = v
    else rargs[#rargs + 1] = a end
  end
  local copy = {}
  for k, v in pairs(recipe) do copy[k] = v end
  -- the device is read for its memory; the plan runs on the CPU allocator's
  -- twin, whose size classes and caching the CUDA allocator shares
  local device = device_arg or copy.device or train.defaults.device
  if type(device) ~= 'string' then fail('device must be a string, got ' .. type(device)) end
  if device == 'auto' then device = gl.default_device() end
  require('gptlua.tensor').device_id(device, 'config: device')
  copy.device = 'cpu'
  if copy.dtype == nil or copy.dtype == 'auto' then copy.dtype = train.auto_dtype(device) end
  local o = { world = int_opt(popts.world == nil and 1 or popts.world, 'world', 1), device = device,
              name = recipe.name }
  o.rank = int_opt(popts.rank == nil and 0 or popts.rank, 'rank', 0)
  if o.rank >= o.world then fail(('rank must be in 0..%d (world %d), got %d'):format(o.world - 1, o.world, o.rank)) end
  o.margin = popts.margin == nil and M.DEFAULT_MARGIN or tonumber(popts.margin)
  if not o.margin or o.margin < 0 or o.margin >= 1 then
    fail(('margin must be a fraction in [0, 1), got %s'):format(tostring(popts.margin)))
  end
  -- unset on several launched ranks, dist is ddp (gptlua.train): so here
  local dist_given = copy.dist ~= nil
  for _, a in ipairs(rargs) do if tostring(a):match('^%-%-dist=') or a == '--dist' then dist_given = true end end
  if o.world > 1 and not dist_given then rargs[#rargs + 1] = '--dist=ddp' end
  -- the config as the trainer will see it (errors in it are the trainer's)
  local cfg = train.resolve_config(copy, rargs)
  local valid = {}
  for _, p in ipairs(M.POLICIES) do valid[p] = true end
  if not valid[cfg.dist] then
    fail(("unknown dist '%s' (expected %s)"):format(tostring(cfg.dist), table.concat(M.POLICIES, ', ')))
  end
  if cfg.dist == 'hsdp' and (cfg.shard_size < 1 or o.world % cfg.shard_size ~= 0) then
    fail(('hsdp needs shard_size dividing the world size %d (ranks per shard group), got %s'):format(o.world,
      tostring(cfg.shard_size)))
  end
  if popts.device_memory ~= nil then
    o.device_memory, o.memory_from = M.parse_bytes(popts.device_memory, 'device_memory'), 'given'
  else
    o.device_memory, o.memory_from = default_device_memory(device)
  end
  o.name = o.name or cfg.name
  return copy, rargs, cfg, o
end

-- Shards that are not here (a recipe planned before its data is prepared):
-- random tokens of the same batches.  The shard loader maps its files,
-- which the allocator does not hold, so the plan is the same.
local function data_note(cfg)
  if cfg.data ~= 'shards' then return nil end
  local data = require 'gptlua.data'
  for _, dir in ipairs({ cfg.data_dir, gl.root .. '/' .. cfg.data_dir }) do
    local ok, files = pcall(data.list_shards, dir, 'train')
    if cfg.data_dir ~= '' and ok and #files > 0 then return nil end
  end
  return ("the shards of %s are not here: planned with random tokens of the same batches (the shard loader maps "
    .. 'its files; the allocator holds only its batches)'):format(cfg.data_dir ~= '' and cfg.data_dir or "data_dir")
end

-- ------------------------------------------------------------- the run --
local ffi = require 'ffi'
local function storage_id(t)
  local s = t.c.storage
  return s ~= nil and tonumber(ffi.cast('intptr_t', s)) or nil
end

-- Which layer each module's forward belongs to: a module inside a
-- ModuleList element is that element's ('transformer.h.3'), any other the
-- model's child's ('transformer.wte', 'lm_head').
local function layer_names(model)
  local out = {}
  local function walk(m, path, label, in_list)
    for _, n in ipairs(m._modules or {}) do
      local c = m[n]
      local p = path == '' and n or (path .. '.' .. n)
      local l = label or ((in_list or path == '' or #(c._modules or {}) == 0) and p) or nil
      if in_list then l = p end
      -- only the module that starts a label is wrapped: what runs inside it
      -- is tagged through its wrapper's label, and a wrapped nn.Linear or
      -- norm inside a block would no longer be the plain module that the
      -- fused ops (models/common.lua: gl.mlp, gl.linear's residual, add +
      -- norm) require, so the plan would run the unfused ops instead
      if l and not label then out[c] = l end
      walk(c, p, label or (in_list and p) or nil, getmetatable(c) and getmetatable(c).__name == 'ModuleList')
    end
  end
  walk(model, '', nil, false)
  return out
end

-- Wraps each module's forward to tag the tensors it makes with its layer;
-- returns a function that undoes it.
local function tag_layers(model, set_label)
  local names, undo = layer_names(model), {}
  for m, label in pairs(names) do
    local own = rawget(m, 'forward')
    local f = m.forward
    m.forward = function(...)
      local prev = set_label(label)
      local res = { pcall(f, ...) }
      set_label(prev)
      if not res[1] then error(res[2], 0) end
      return unpack(res, 2, table.maxn(res))
    end
    undo[#undo + 1] = function() rawset(m, 'forward', own) end
  end
  return function() for _, u in ipairs(undo) do u() end end
end

-- Mixture of experts (gptlua.moe): while the plan runs, the engine ops of
-- the MoE layers tag what they make as the dispatch (the routing plan, the
-- token rows permuted into expert order, the combine back) or the expert
-- products (the grouped products' outputs and their activation), and the
-- dispatch records each layer's tokens N, top-k K and rows (N K, or E x
-- capacity); returns a function that undoes it.  parts: tensor -> part.
local MOE_DISPATCH, MOE_PRODUCTS = 'MoE dispatch and combine', 'MoE expert products'
local function tag_moe(model, parts, shapes, label_of)
  local layers = require('gptlua.moe').layers(model)
  if #layers == 0 then return function() end end
  local saved = {}
  local function wrap(name, f)
    saved[name] = saved[name] or gl[name]
    gl[name] = f
  end
  local function tagged(name, p, after)
    local f = gl[name]
    wrap(name, function(...)
      local res = { f(...) }
      for i = 1, table.maxn(res) do if getmetatable(res[i]) == gl.Tensor then parts[res[i]] = p end end
      if after then after(...) end
      return unpack(res, 1, table.maxn(res))
    end)
  end
  tagged('moe_route', MOE_DISPATCH)
  tagged('moe_combine', MOE_DISPATCH)
  tagged('moe_permute', MOE_DISPATCH, function(x, slots, rows)
    local l = label_of() or '?'
    if not shapes[l] then shapes[l] = { tokens = x.shape[1], top_k = slots.shape[2], rows = rows } end
  end)
  tagged('grouped_linear', MOE_PRODUCTS)
  -- the experts' activation, applied to a grouped product's output
  for _, l in ipairs(layers) do
    local act = l[2].act
    if not saved[act] then
      local f = gl[act]
      wrap(act, function(x, ...)
        local y = f(x, ...)
        if parts[x] == MOE_PRODUCTS then parts[y] = MOE_PRODUCTS end
        return y
      end)
    end
  end
  return function() for name, f in pairs(saved) do gl[name] = f end end
end

-- The model's MoE layers as the plan reports them: parameters (total,
-- those a token uses, the experts'; the whole model's: whole is its count
-- before tp or ep cut it, when they did), experts, per rank (E / ep: expert
-- parallel ranks hold E / ep each), top-k, capacity factor, hidden width.
local function moe_facts(model, cfg, whole)
  local moe = require 'gptlua.moe'
  local layers = moe.layers(model)
  if #layers == 0 then return nil end
  local m = layers[1][2]
  local expert_params = 0
  for _, l in ipairs(layers) do   -- (every expert of a layer has the first's size; a rank under ep holds E / ep)
    expert_params = expert_params + l[2].n_experts * l[2].experts[1]:num_params()
  end
  local ep = cfg.ep or 1
  local total = whole or model:num_params()
  return { layers = #layers, experts = m.n_experts, ep = ep, experts_per_rank = m.n_experts / ep, top_k = m.top_k,
           capacity_factor = m.capacity_factor, hidden = m.experts[1].c_fc.weight.shape[1],
           total_params = total, active_params = total - moe.inactive_params(model), expert_params = expert_params }
end

-- Every tensor reachable from root through tables (depth-limited), with
-- the name of the field that holds it.
local function each_tensor(root, f, depth, seen, key)
  seen = seen or {}
  if type(root) ~= 'table' or seen[root] or (depth or 0) > 6 then return end
  seen[root] = true
  if getmetatable(root) == gl.Tensor then f(root, key); return end
  for k, v in pairs(root) do
    if type(v) == 'table' then each_tensor(v, f, (depth or 0) + 1, seen, type(k) == 'string' and k or key) end
    if type(k) == 'table' then each_tensor(k, f, (depth or 0) + 1, seen, key) end
  end
end

-- What the sharding policies' own buffers are, by the fields that hold
-- them (gptlua.dist.policies, dist/fsdp.lua); any other tensor a policy
-- holds is a communication buffer (gathered units, send buffers, stacks).
local POLICY_FIELDS = { pflat = 'parameters', pshard = 'parameters', gshard = 'gradients', grad = 'gradients',
  m = 'optimizer state', v = 'optimizer state', buf = 'optimizer state', master = 'master weights' }

-- The live storages at this moment, sorted into groups (see the header).
local function classify(t, registry, parts)
  local group, bytes = {}, {}
  local function mark(x, g)
    local id = storage_id(x)
    if id and not group[id] then group[id] = g; bytes[id] = tonumber(x.c.storage.capacity) end
  end
  for _, p in ipairs(t.params) do mark(p, 'parameters') end
  for _, b in ipairs(t.model:named_buffers()) do mark(b[2], 'parameters') end
  for _, p in ipairs(t.params) do if p.grad then mark(p.grad, 'gradients') end end
  local opts = t.optimizer.optimizers or { t.optimizer }
  for _, o in ipairs(opts) do
    for _, st in pairs(o.state or {}) do
      if type(st) == 'table' then
        if st.master then mark(st.master, 'master weights') end
        each_tensor(st, function(x) mark(x, 'optimizer state') end)
      end
    end
  end
  each_tensor(t.policy, function(x, key) mark(x, POLICY_FIELDS[key] or 'communication buffers') end)
  local out = { layers = {} }
  local seen, part_of = {}, {}
  for x, p in pairs(parts or {}) do local id = storage_id(x); if id then part_of[id] = p end end
  for x, label in pairs(registry) do
    local id = storage_id(x)
    if id and not seen[id] then
      seen[id] = true
      local g = group[id]
      local b = tonumber(x.c.storage.capacity)
      if not g then
        if x.c.storage.meta == 2 then g = 'data'
        else
          g = 'activations'
          out.layers[label or 'backward'] = (out.layers[label or 'backward'] or 0) + b
          local p = part_of[id]
          if p then out.moe = out.moe or {}; out.moe[p] = (out.moe[p] or 0) + b end
        end
      end
      out[g] = (out[g] or 0) + b
    end
  end
  return out
end

-- One plan of recipe (+ rargs) on rank o.rank of o.world: builds the
-- trainer on the meta device and runs two optimizer steps.  stop_at: the
-- allocation count at which to take the live set (the peak's); returns
-- {peak, n_allocs_at_peak, groups, traffic, cfg, trainer facts}.
local function run_plan(recipe, rargs, o, stop_at)
  local dist = require 'gptlua.dist'
  local Tensor = gl.Tensor
  local label, registry, snapshot, trainer = nil, setmetatable({}, { __mode = 'k' }), nil, nil
  local parts, moe_shapes = setmetatable({}, { __mode = 'k' }), {}
  local function set_label(l) local p = label; label = l; return p end
  local prev_world
  local res = meta.run(function()
    local w = fake.world(o.world, o.rank)
    prev_world = dist.set_world(w)
    local r = {}
    for k, v in pairs(recipe) do r[k] = v end
    local build = r.build_data or train.build_data
    r.build_data = function(cfg, rank, world) return meta.paused(build, cfg, rank, world) end
    if o.random_data then r.data = 'random' end
    r.quiet, r.tensorboard, r.profile = true, false, ''
    local peak_at, best = nil, -1
    Tensor.on_wrap = function(x)
      registry[x] = label or false
      local st = gl.memory_stats()
      if stop_at and not snapshot and st.n_allocs >= stop_at and trainer then
        snapshot = classify(trainer, registry, parts)
      end
      if st.peak > best then best, peak_at = st.peak, st.n_allocs end
    end
    local ok, err = pcall(function()
      local t = train.new(r, rargs)
      trainer = t
      local untag = tag_layers(t.model, set_label)
      local untag_moe = tag_moe(t.model, parts, moe_shapes, function() return label end)
      local ok2, err2 = pcall(function()
        t:train_step()
        fake.reset(w)
        t:train_step()
      end)
      untag_moe()
      untag()
      if not ok2 then error(err2, 0) end
    end)
    Tensor.on_wrap = nil
    dist.set_world(prev_world)
    local st = gl.memory_stats()
    local t = trainer
    trainer = nil
    if t and t.data then
      for _, k in ipairs({ 'train', 'val', 'eval_train' }) do if t.data[k] and t.data[k].close then t.data[k]:close() end end
    end
    if not ok then error(err, 0) end
    return { peak = st.peak, peak_at = peak_at, traffic = fake.traffic(w), cfg = t.cfg,
             accum = t.cfg.gradient_accumulation_steps, num_params = t.model:num_params(),
             tokens_per_step = t.tokens_per_step, model_config = t.model.config,
             moe = moe_facts(t.model, t.cfg, t.whole_num_params), moe_shapes = moe_shapes,
             pipeline = t.pipeline and { text = tostring(t.pipeline), schedule = t.pipeline.schedule } }
  end, { reads = 'zeros' })
  res.groups = snapshot
  return res
end

-- The numbers of one configuration: the plan, then its live set at the peak.
local function compute(recipe, rargs, o)
  local a = run_plan(recipe, rargs, o)
  local b = run_plan(recipe, rargs, o, a.peak_at)
  a.groups = b.groups or {}
  a.bytes = { total = a.peak }
  for k, v in pairs(a.groups) do if type(v) == 'number' then a.bytes[k] = v end end
  return a
end

local function with(rargs, changes)
  local out = {}
  for _, a in ipairs(rargs) do
    local k = tostring(a):match('^%-%-([%w_%.]+)=')
    if not (k and changes[k] ~= nil) then out[#out + 1] = a end
  end
  local keys = {}
  for k in pairs(changes) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do out[#out + 1] = ('--%s=%s'):format(k, tostring(changes[k])) end
  return out
end

-- What to change when the plan does not fit, each planned: the largest
-- smaller micro-batch that fits (same tokens per step), activation
-- checkpointing, each more sharded policy (with the micro-batch that then fits).
local function suggestions(recipe, rargs, o, base, usable)
  local cfg = base.cfg
  local out = {}
  local function add(changes, r, why)
    local flags = {}
    for _, a in ipairs(with({}, changes)) do flags[#flags + 1] = a end
    out[#out + 1] = { changes = changes, total = r.peak, fits = r.peak <= usable, flags = table.concat(flags, ' '),
                      why = why, order = #out }
  end
  local function shrink(changes)
    local last
    for b = cfg.batch_size - 1, 1, -1 do
      if cfg.batch_size % b == 0 then
        local ch = {}
        for k, v in pairs(changes) do ch[k] = v end
        ch.batch_size = b
        if cfg.total_batch_size == 0 then ch.gradient_accumulation_steps = base.accum * cfg.batch_size / b end
        local r = run_plan(recipe, with(rargs, ch), o)
        last = { ch, r }
        if r.peak <= usable then return ch, r end
      end
    end
    if last then return last[1], last[2] end
  end
  local function note(ch)
    local b = ch.batch_size
    return b and (' (accumulation %d, same tokens per step)'):format(base.accum * cfg.batch_size / b) or ''
  end
  local ch, r = shrink({})
  if ch then add(ch, r, 'smaller micro-batch' .. note(ch)) end
  if not cfg.activation_checkpointing then
    local ac = { activation_checkpointing = true }
    local rac = run_plan(recipe, with(rargs, ac), o)
    if rac.peak < base.peak then
      if rac.peak > usable then
        local ch2, r2 = shrink(ac)
        if ch2 then ac, rac = ch2, r2 end
      end
      add(ac, rac, 'activation checkpointing' .. note(ac))
    end
  end
  if o.world > 1 then
    for _, pol in ipairs({ 'ddp', 'zero1', 'zero2', 'fsdp' }) do
      if POLICY_RANK[pol] > POLICY_RANK[cfg.dist] then
        local pc = { dist = pol }
        local rp = run_plan(recipe, with(rargs, pc), o)
        if rp.peak > usable then
          local ch3, r3 = shrink(pc)
          if ch3 then pc, rp = ch3, r3 end
        end
        add(pc, rp, ('%s over %d ranks'):format(pol, o.world) .. note(pc))
      end
    end
  end
  table.sort(out, function(x, y)
    if x.fits ~= y.fits then return x.fits end
    return x.order < y.order
  end)
  return out
end

-- plan(recipe, {world=1, rank=0, device_memory=bytes|'80GiB', margin=0.1,
-- args={'--key=value', ...}}) -> the plan (see the header); r.text is what
-- `gptlua --plan` prints.
function M.plan(recipe, opts)
  opts = opts or {}
  local r0, rargs, cfg, o = resolve(recipe, opts.args, opts)
  o.note = data_note(cfg)
  o.random_data = o.note ~= nil
  local t0 = require('gptlua.libc').cpu_seconds()
  local r = compute(r0, rargs, o)
  r.config, r.name, r.world, r.rank, r.device = r.cfg, o.name, o.world, o.rank, o.device
  r.device_memory, r.memory_from, r.margin = o.device_memory, o.memory_from, o.margin
  r.usable = math.floor(o.device_memory * (1 - o.margin))
  r.fits = r.peak <= r.usable
  r.note = o.note
  r.suggestions = r.fits and {} or suggestions(r0, rargs, o, r, r.usable)
  r.seconds = require('gptlua.libc').cpu_seconds() - t0
  r.text = report.render(r)
  return r
end

-- `gptlua --plan recipe.lua [args]`: prints the plan; 0 when it was made
-- (whether or not it fits: the verdict is in the output).
function M.main(script, args)
  local f, err = loadfile(script)
  if not f then fail(('cannot load recipe %s: %s'):format(tostring(script), tostring(err))) end
  local recipe = f(unpack(args or {}))
  if type(recipe) ~= 'table' then
    fail(('recipe %s returned %s, expected a config table'):format(script, type(recipe)))
  end
  local r = M.plan(recipe, { args = args })
  io.write(r.text)
  io.stdout:flush()
  return 0
end

return M
