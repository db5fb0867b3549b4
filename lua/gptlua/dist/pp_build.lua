-- gptlua.dist.pp_build — a pipeline rank builds only its stages' parameters
-- (and, under expert parallelism, only its own experts of them).
--
--   local model = require('gptlua.dist.pp_build').build(trainer, builder)
--
-- The model's parameters that other pp ranks hold get no storage here: they
-- stay in the model (names, shapes, dtype, so the partition, the owner
-- table and checkpoints see the whole model) as freed tensors marked
-- t.held_by = the pp rank that trains them; any use of their values raises
-- "tensor was freed".  So parameters, gradients and optimizer state on a
-- rank are its stages' share (gpt2's tied wte: the first and the last stage
-- each hold it).
--
-- The initial values are exactly a one-rank build's with the same seed.
-- The RNG is counter-based (gptlua.ops: a seed and an offset advanced by
-- the number of values drawn), so a parameter's numbers depend only on how
-- many were drawn before it.  The builder runs twice, unchanged:
--   1. every parameter is released as soon as it is registered
--      (nn.on_param): this gives the structure (names in registration
--      order, shapes) from which the partition decides who holds what;
--   2. from the same RNG state, each parameter this rank does not hold is
--      released as it is registered; its later in-place initialisation
--      (nanochat v2's normal_/uniform_/zero_ after construction) only
--      advances the RNG by its size, as the real draw would.
-- Every parameter is made and drawn for real before its release (the
-- builder's own code decides its values), so the peak while building is
-- this rank's share plus the largest single parameter, not the whole model
-- (building on the meta device and replaying each parameter's init would
-- avoid even that, but needs every builder's init to be replayable); the
-- cost is one more initialisation's draws.  A builder that reads or
-- computes with a parameter after registering it (other than those
-- in-place draws) raises, naming it, rather than diverging silently.
local gl = require 'gptlua'
local nn = require 'gptlua.nn'
local Tensor = gl.Tensor

local M = {}

local function fail(msg) error('pipeline build: ' .. msg, 0) end

-- A parameter released during the build: metadata readable, in-place
-- initialisers advance the RNG, anything else raises.
local METADATA = { numel = true, dim = true, size = true, is_freed = true, is_floating = true, stride = true,
  requires_grad_ = true, register_hook = true, keep = true }
local function draw(t) gl.rng_take(t:numel()); return t end
local function keep_as_is(t) return t end
local Skipped = { __name = 'Tensor', __metatable = Tensor }
Skipped.__index = function(t, k)
  if k == 'normal_' or k == 'uniform_' then return draw end
  if k == 'zero_' or k == 'fill_' then return keep_as_is end
  local v = Tensor[k]
  if type(v) == 'function' and not METADATA[k] then
    error(('%s: the parameter is held by pipeline rank %d, not built on this rank'):format(k, rawget(t, 'held_by')), 2)
  end
  return v
end

-- t now holds no storage; marked as held by pp rank `by`
local function skip(t, by)
  Tensor.release(t)
  rawset(t, 'held_by', by)
  debug.setmetatable(t, Skipped)
end

-- runs builder(cfg) with on_param seeing every parameter registered
local function with_hook(on_param, builder, cfg)
  local prev = nn.on_param
  nn.on_param = on_param
  local ok, model = pcall(builder, cfg)
  nn.on_param = prev
  if not ok then error(model, 0) end
  return model
end

-- A freed placeholder of shape like `of` (a held_by parameter): tensor
-- parallelism cuts it into its part's shape
function M.placeholder(shape, of)
  local t = gl.empty(shape, { dtype = of.dtype, device = of.device })
  Tensor.release(t)
  rawset(t, 'held_by', rawget(of, 'held_by'))
  return t
end

-- name -> the pp ranks (0-based) holding it: the stage's rank that trains
-- it, for gpt2's tied embedding the last stage's rank too, and every rank
-- for the adapter's shared parameters
function M.holders(model, p, S, counts)
  local pipeline = require 'gptlua.dist.pipeline'
  local ad = pipeline.adapter(model)
  local owner = setmetatable({ counts = counts, p = p, S = S, adapter = ad }, pipeline.Pipeline)
  return function(name)
    local r = owner:owner_of(name)
    if r == nil then fail(('parameter %s belongs to no stage'):format(name)) end
    local out = { [r] = true }
    if name == ad.tied then out[(S - 1) % p] = true end
    for _, s in ipairs(ad.shared or {}) do   -- (nanochat v2's lambdas: every stage holds them)
      if name == s then for q = 0, p - 1 do out[q] = true end end
    end
    return out
  end
end

-- The trainer's model (builder(cfg)) with only this pp rank's parameters
-- materialised (see the header); trainer.cfg, trainer.mesh (pp > 1) and the
-- schedule and partition the pipeline will use (gptlua.dist.policies.pp).
function M.build(trainer, builder)
  local cfg, mesh = trainer.cfg, trainer.mesh
  local rng = gl.get_rng_state()
  -- 1: the structure
  local order = {}
  local whole = with_hook(function(t)
    order[#order + 1] = t
    skip(t, -1)
  end, builder, cfg)
  local name_of = {}
  for _, np in ipairs(whole:named_parameters()) do name_of[np[2]] = np[1] end
  local names = {}
  for k, t in ipairs(order) do
    names[k] = name_of[t]
    if not names[k] then fail(('parameter %d of the build is not among the model\'s named parameters'):format(k)) end
  end
  local me, holders = mesh.coord.pp, nil
  if mesh.size.pp > 1 then
    local pipeline = require 'gptlua.dist.pipeline'
    local sched = require('gptlua.dist.policies.pp').schedule(trainer)
    local counts = pipeline.partition(whole, sched.stages, trainer.hooks.pp_partition or cfg.pp_partition,
      cfg.block_size)
    holders = M.holders(whole, mesh.size.pp, sched.stages, counts)
  else
    holders = function() return { [me] = true } end
  end
  -- expert parallelism: the experts of the other ranks of this rank's ep group are not built either
  -- (gptlua.dist.expert_parallel cuts them out of the model)
  if (mesh.size.ep or 1) > 1 then
    local stage_holders, mine = holders, require('gptlua.dist.expert_parallel').holds(cfg, mesh)
    holders = function(name)
      if mine(name) then return stage_holders(name) end
      return { [-1] = true }
    end
  end
  whole, order = nil, nil
  -- 2: this rank's parameters, from the same RNG state
  gl.set_rng_state(rng)
  local k, skipped = 0, {}
  local model = with_hook(function(t)
    k = k + 1
    local name = names[k]
    if name == nil then fail(('the builder registered more parameters the second time (%d)'):format(k)) end
    local h = holders(name)
    if not h[me] then
      skip(t, next(h))
      skipped[#skipped + 1] = t
    end
  end, builder, cfg)
  if k ~= #names then fail(('the builder registered %d parameters, then %d'):format(#names, k)) end
  for _, t in ipairs(skipped) do Tensor.rebind(t, t.c) end  -- (no storage: plainly freed from now on)
  return model
end

return M
