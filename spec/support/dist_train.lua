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
--     { ranks = 4, model = 'gpt2', args = '--dp=2 --tp=2 --dist=fsdp', tol = 1e-6 },
--   })
--   DT.assert_matches(ref, got[1])           -- losses, clipped norms, parameters
--
-- Cases of the same world size share one launch (tp_train.lua runs them one
-- after another, each with its own mesh): a launch costs process start-up,
-- MPI init and LuaJIT warm-up, seconds each on the 2-core CI machine, where
-- a 5-step run of the tiny model costs a fraction of that.  A case's fields:
-- ranks, model ('gpt2' or 'nanochat'), args (overrides, one string), iters
-- (5), name (its directory under out, made from model and args if absent),
-- tol (1e-9; assert_matches' relative tolerance).
local H = require 'support.mpi'
local cjson = require 'cjson'
local ckpt = require 'gptlua.checkpoint'
local train = require 'gptlua.train'

local M = {}
M.__index = M

local recipe = dofile(H.ROOT .. '/spec/dist/tp_recipe.lua')
M.recipe = recipe

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

-- the run in this process that the ranks must equal: {losses, norms, params,
-- dir (its out_dir: the checkpoints of the steps before the last in dir/p)},
-- kept per model and overrides (over: recipe fields, e.g. { optimizer = 'nanochat' })
function M:reference(model, over)
  local parts = { model }
  for k, v in pairs(over or {}) do parts[#parts + 1] = k .. '=' .. tostring(v) end
  table.sort(parts, function(a, b) return a < b end)
  local key = table.concat(parts, '_'):gsub('[^%w_=]', '')
  if not self.refs[key] then
    local r = { out_dir = self.out .. '/ref_' .. key }
    for k, v in pairs(over or {}) do r[k] = v end
    local t = train.new(recipe(model, r), {})
    local res = t:run()
    self.refs[key] = { losses = res.losses, norms = M.grad_norms(r.out_dir), params = H.params_of(t.model),
                       dir = r.out_dir }
  end
  return self.refs[key]
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
