-- Run the trainer on N ranks with several cases and compare each with one
-- process: the helper the multi-rank trainer specs share (spec/dist_tp_spec.lua;
-- spec/dist_pp_spec.lua and spec/dist_nanochat_v2_spec.lua use its
-- grad_norms and assert_close).  The model is the small float64 GPT of
-- spec/dist/tp_recipe.lua; the ranks run spec/dist/tp_train.lua.
--
--   local DT = require 'support.dist_train'
--   local runs = DT.new(out)                -- out: a temp dir the spec removes
--   local ref = runs:reference('gpt2')      -- one process, in this one (cached)
--   local got = runs:launch({               -- one mpirun per world size
--     { ranks = 2, model = 'gpt2', args = '--tp=2' },
--     { ranks = 4, model = 'gpt2', args = '--dp=2 --tp=2 --dist=fsdp', reduce = 'float32' },
--   })
--   runs:check(cases[2], got[2])           -- losses, clipped norms, parameters, by the rule below
--
-- Cases of the same world size share one launch (tp_train.lua runs them one
-- after another, each with its own mesh): a launch costs process start-up,
-- MPI init and LuaJIT warm-up, seconds each on the 2-core CI machine, where
-- a 5-step run of the tiny model costs a fraction of that.  A case's fields:
-- ranks, model ('gpt2' or 'nanochat'), args (overrides, one string), iters
-- (5), name (its directory under out, made from model and args if absent),
-- reduce and state32 (the roundings the layout adds, for runs:check's rule),
-- tol (a hand-set relative tolerance, for assert_matches and the resume
-- checks that compare with one process's later steps).
local H = require 'support.mpi'
local cjson = require 'cjson'
local ckpt = require 'gptlua.checkpoint'
local train = require 'gptlua.train'

local M = {}
M.__index = M

local recipe = dofile(H.ROOT .. '/spec/dist/tp_recipe.lua')
M.recipe = recipe
M.TOKENS = recipe('gpt2').total_batch_size   -- tokens per step

function M.new(out) return setmetatable({ out = out, refs = {} }, M) end

-- every step's clipped gradient norm a run logged in <dir>/p/metrics.jsonl
function M.grad_norms(dir)
  local norms = {}
  for line in io.lines(dir .. '/p/metrics.jsonl') do
    local m = cjson.decode(line)
    if m.grad_norm then norms[#norms + 1] = m.grad_norm end
  end
  return norms
end

-- A perturbation of the one-process run by the roundings a layout adds
-- (perturb = {grad = g, state = true}): before every optimizer step each
-- gradient element times 1 + g or 1 - g (signs random, fixed by the seed),
-- and after it, with state, every float32 tensor of the optimizer's state
-- moved by one unit in the last place either way (what a float32 rounding
-- of an input that moved makes of it); with act = u, every linear layer's
-- input and output gradient times 1 + u or 1 - u, element by element, at
-- every call (a float32 model's activations, which the ranks' reordered
-- sums move too), and with fp8 = {x, g} an FP8 layer's by 1 +- x and 1 +- g
-- instead.
local function perturbed(build, perturb)
  local gl = require 'gptlua'
  local A = require 'gptlua.autograd'
  local seed = 104729
  local function signs(shape, u, dtype)
    seed = seed + 1
    dtype = dtype or 'float64'
    local r = gl.randn(shape, { seed = seed, dtype = dtype })
    return gl.where(r:gt(0), gl.full(shape, 1 + u, { dtype = dtype }), gl.full(shape, 1 - u, { dtype = dtype }))
  end
  local function moved(x, u) return x * signs(x.shape, u, x.dtype) end
  local function grad_moved(y, u)
    return A.record(y:detach(), { y }, function(_, g) return g * signs(g.shape, u, g.dtype) end, nil, 'grad_moved')
  end
  return function(cfg, model, groups)
    if perturb.act or perturb.fp8 then
      local nn = require 'gptlua.nn'
      for _, m in ipairs(model:modules()) do
        local by = m.fp8 and perturb.fp8 or (perturb.act and { x = perturb.act, g = perturb.act })
        if getmetatable(m) == nn.Linear and by then
          local forward = m.forward
          m.forward = function(self, x) return grad_moved(forward(self, moved(x, by.x)), by.g) end
        end
      end
    end
    local o = build(cfg, model, groups)
    local step, params = o.step, model:parameters()
    function o.step(self)
      if perturb.grad and perturb.grad > 0 then
        for _, p in ipairs(params) do
          if p.grad then p.grad:copy_((p.grad:to('float64') * signs(p.grad.shape, perturb.grad)):to(p.grad.dtype)) end
        end
      end
      step(self)
      if perturb.state then
        for _, sub in ipairs(self.optimizers or { self }) do
          for _, st in pairs(sub.state or {}) do
            for _, t in pairs(st) do
              if type(t) == 'table' and t.dtype == 'float32' then
                t:copy_((t:to('float64') * signs(t.shape, 2 ^ -23)):to('float32'))
              end
            end
          end
        end
      end
    end
    return o
  end
end

-- the run in this process that the ranks must equal: {losses, norms, params,
-- dir (its out_dir: the checkpoints of the steps before the last in dir/p)},
-- kept per model, overrides (over: recipe fields, e.g. { optimizer =
-- 'nanochat' }) and perturbation (perturb: see perturbed above)
function M:reference(model, over, perturb)
  local parts = { model }
  for k, v in pairs(over or {}) do parts[#parts + 1] = k .. '=' .. tostring(v) end
  if perturb then
    parts[#parts + 1] = ('perturbed=%s_%s_%s_%s'):format(tostring(perturb.grad), tostring(perturb.state),
      tostring(perturb.act), perturb.fp8 and perturb.fp8.x .. '_' .. perturb.fp8.g or 'nil')
  end
  table.sort(parts, function(a, b) return a < b end)
  local key = table.concat(parts, '_'):gsub('[^%w_=]', '')
  if not self.refs[key] then
    local r = { out_dir = self.out .. '/ref_' .. key }
    for k, v in pairs(over or {}) do r[k] = v end
    if perturb then r.build_optimizer = perturbed(train.build_optimizer, perturb) end
    local t = train.new(recipe(model, r), {})
    local res = t:run()
    self.refs[key] = { losses = res.losses, norms = M.grad_norms(r.out_dir), params = H.params_of(t.model),
                       dir = r.out_dir }
  end
  return self.refs[key]
end

-- The rule a run on ranks is held to against one process (the kernel
-- twins' rule, spec/support/cuda_twin.lua, in another form): the ranks
-- compute the same sums in another order and, where a layout reduces or
-- keeps state in float32, round them there; perturb (above) makes those
-- roundings, at their largest, in one process, and its difference from the
-- unperturbed run measures what they can do to this model's losses, norms
-- and parameters over these steps.  A run may differ from one process by
-- FACTOR times that, plus what the ranks' sums do to a step's own loss and
-- norm (perturb.floor, below).
M.FACTOR = 2
-- GL_CUDA_SPEC_VERBOSE=1 prints every comparison against its allowance, as the twins do
local VERBOSE = os.getenv('GL_CUDA_SPEC_VERBOSE') ~= nil

-- the perturbation a layout's arithmetic makes: every gradient is a sum
-- over the step's tokens, which the ranks split and add in another order (n
-- roundings at most, n the tokens per step); reduced in float32 (FSDP,
-- HSDP), one float32 rounding per rank more; and float32 optimizer state
-- (Muon's momentum) rounds its float64 input, which the ranks moved, to a
-- neighbouring float32: a gradient moved by one float32 rounding moves it
-- so, and the state's own unit is moved after every step.  floor: what the
-- ranks' sums do to a step's own loss and norm before any step propagates.
--
-- A model computing in float32 (over.dtype, the recipe's fields) sums in
-- float32: its order term is n float32 roundings, and its activations move
-- too (a row-parallel product's partial sums added, attention's sums cut
-- over cp): act, the widest product's inner dim (the MLP's 4 n_embd) in
-- float32 roundings, moves every linear layer's operands.  FP8 products
-- (over.fp8): the ranks quantize exactly the operands one process does at
-- the same micro-batch where those operands are bit-equal (gptlua.ops_fp8 makes a
-- split operand's scales one process's: spec/fp8_split_spec.lua), but the
-- roundings above move them, and a float32 rounding that moves an element
-- across an FP8 rounding boundary moves its FP8 value a whole step (2^-3 of
-- it at most for e4m3, 2^-2 for e5m2); downstream of one such step every
-- operand moves by more than float32 roundings, so any element may land on
-- its neighbour.  That is the most a changed rounding can do, and a
-- one-process run can make it: the perturbed run moves every FP8 layer's
-- input (e4m3) by 2^-3 and output gradient (e5m2) by 2^-2 of each element,
-- a step, at every call (fp8 = {x, g}).  (Moving them by the order term
-- instead crosses boundaries at random a few times a step, as the layout
-- does, and two such runs' differences are not comparable.)  So the rule
-- holds an FP8 layout to FP8's own rounding; that its scales are one
-- process's is fp8_split_spec's to check.
function M.rounding_of(ranks, reduce_dtype, float32_state, over)
  local unit = over and (over.dtype == 'float32' or over.fp8) and 2 ^ -24 or 2 ^ -53
  local order = M.TOKENS * unit
  -- (float32 gradients reduce in float32 whatever the policy)
  local reduce = (reduce_dtype == 'float32' or unit == 2 ^ -24) and ranks * 2 ^ -24 or 0
  local fp8 = over and over.fp8 and over.fp8 ~= 'off'
  return { grad = order + reduce + (float32_state and 2 ^ -24 or 0), floor = order + reduce,
           state = float32_state or nil, act = unit == 2 ^ -24 and 4 * recipe('gpt2').n_embd * unit or nil,
           fp8 = fp8 and { x = 2 ^ -3, g = 2 ^ -2 } or nil }
end

-- checks res against ref by the rule; refp: the reference perturbed by
-- perturb; steps: which of ref's steps res ran (default all); want_params:
-- the reference's parameters after res's last step (default ref.params)
function M.assert_by_rule(ref, refp, perturb, res, steps, want_params, refp_params)
  local assert = require 'luassert'
  local floor = perturb.floor
  local from, to = steps and steps[1] or 1, steps and steps[2] or #ref.losses
  -- (norms come from metrics.jsonl, which keeps 14 significant digits, as
  -- lua-cjson writes them: two records of one value differ by up to a unit
  -- in the 14th digit, 1e-13 relative)
  local function series(name, want, wantp, got, resolution)
    assert.equal(to - from + 1, #got, res.what .. ' ' .. name .. ': steps')
    for i = from, to do
      local g = got[i - from + 1]
      local rel, relp = math.abs(g - want[i]) / math.abs(want[i]), math.abs(wantp[i] - want[i]) / math.abs(want[i])
      local allowed = M.FACTOR * relp + floor + (resolution or 0)
      if VERBOSE then print(('%-60s %-13s step %d: %.3g of allowed %.3g'):format(res.what, name, i, rel / allowed, allowed)) end
      assert.is_true(rel <= allowed, ('%s %s: step %d %.15g, expected %.15g (relative error %.3g, allowed %.3g = '
        .. '%d x the rounding\'s %.3g + %.3g)'):format(res.what, name, i, g, want[i], rel, allowed, M.FACTOR, relp,
        floor + (resolution or 0)))
    end
  end
  series('loss', ref.losses, refp.losses, res.losses)
  series('gradient norm', ref.norms, refp.norms, res.norms, 1e-13)
  want_params, refp_params = want_params or ref.params, refp_params or refp.params
  local e, ep = H.rel_error(want_params, res.params or M.final_params(res)), H.rel_error(want_params, refp_params)
  local allowed = M.FACTOR * ep + floor
  if VERBOSE then print(('%-60s %-13s after %d: %.3g of allowed %.3g'):format(res.what, 'parameters', to, e / allowed, allowed)) end
  assert.is_true(e <= allowed, ('%s: parameters after step %d differ, relative error %.3g, allowed %.3g = %d x the '
    .. 'rounding\'s %.3g + %.3g'):format(res.what, to, e, allowed, M.FACTOR, ep, floor))
end

-- a launched case against one process by the rule: case.ranks, case.model,
-- case.reduce ('float32' where the layout reduces in float32: FSDP, HSDP),
-- case.state32 (float32 optimizer state: Muon); over: the reference's
-- recipe overrides
function M:check(case, res, over)
  local perturb = M.rounding_of(case.ranks, case.reduce or 'float64', case.state32)
  M.assert_by_rule(self:reference(case.model, over), self:reference(case.model, over, perturb), perturb, res)
end

-- a run resumed from a checkpoint of step from - 1 (its losses and norms
-- those of steps from..last) against one process by the rule; case: the
-- layouts it passed through, at their largest (ranks, reduce, state32, as
-- for check), since the steps before the checkpoint ran on one of them and
-- its roundings carry into the steps after
function M:check_resumed(case, res, from, over)
  local perturb = M.rounding_of(case.ranks, case.reduce or 'float64', case.state32)
  local ref = self:reference(case.model, over)
  M.assert_by_rule(ref, self:reference(case.model, over, perturb), perturb, res, { from, #ref.losses })
end

-- a run in this process as a result runs:check and check_resumed read:
-- t (a trainer after t:run()), res (what run returned), dir (its out_dir)
function M.local_result(t, res, dir, what)
  return { losses = res.losses, norms = M.grad_norms(dir), params = H.params_of(t.model), what = what }
end

-- runs cases on their ranks, one launch per world size (in the order the
-- sizes first appear); returns per case {dir, losses, norms, checkpoint, tol,
-- what} once every rank of every launch printed OK
function M:launch(cases)
  local sizes, by_size = {}, {}
  for i, c in ipairs(cases) do
    c.iters = c.iters or 5
    c.args = c.args or ''
    c.what = c.what or ('%s %s (%d ranks)'):format(c.model, c.args, c.ranks)
    c.dir = ('%s/%s'):format(self.out, c.name or ('%s_%d_%s'):format(c.model, c.ranks, c.args:gsub('[^%w]', '')))
    if not by_size[c.ranks] then by_size[c.ranks] = {}; sizes[#sizes + 1] = c.ranks end
    table.insert(by_size[c.ranks], i)
  end
  for _, n in ipairs(sizes) do
    local words = {}
    for _, i in ipairs(by_size[n]) do
      local c = cases[i]
      words[#words + 1] = ('%s %s %d %s'):format(c.dir, c.model, c.iters, c.args)
    end
    local o, rc = H.mpirun(n, 'spec/dist/tp_train.lua', table.concat(words, ' + '), 60 + 60 * #words)
    H.assert_ranks_ok(o, rc, n)
  end
  local got = {}
  for i, c in ipairs(cases) do
    local res = H.read_json(c.dir .. '/result.json')
    got[i] = { dir = c.dir, losses = res.losses, norms = M.grad_norms(c.dir), checkpoint = res.checkpoint,
               tol = c.tol or 1e-9, what = c.what }
  end
  return got
end

-- the final parameters a run saved (its last checkpoint; a pipeline's stage parts merged)
function M.final_params(res) return ckpt.load(res.checkpoint).model end

-- want[i] and got[i] agree to a relative tol, step by step
function M.assert_close(want, got, what, tol)
  local assert = require 'luassert'
  tol = tol or 1e-9
  assert.equal(#want, #got, what)
  for i = 1, #want do
    local rel = math.abs(want[i] - got[i]) / math.abs(want[i])
    assert.is_true(rel < tol, ('%s: step %d %.15g, expected %.15g (relative error %.2g)'):format(
      what, i, got[i], want[i], rel))
  end
end

-- a launched run equals the reference: every step's loss and clipped
-- gradient norm, and the final parameters (relative L2 error), to res.tol
function M.assert_matches(ref, res)
  local assert = require 'luassert'
  M.assert_close(ref.losses, res.losses, res.what .. ' loss', res.tol)
  M.assert_close(ref.norms, res.norms, res.what .. ' gradient norm', res.tol)
  local e = H.rel_error(ref.params, M.final_params(res))
  assert.is_true(e < res.tol, ('%s: final parameters differ, relative error %.3g'):format(res.what, e))
end

return M
