-- The optimizer step of nanochat's optimizer (Muon for the block matrices,
-- AdamW for the rest) on the default recipe's model (recipes/shakespeare.lua:
-- 4 layers, width 128), per muon_variant: 'classic' (Newton–Schulz) against
-- 'current' (MuonEq, Polar Express, Muon+, NorMuon, cautious weight decay),
-- timed in turns in one process so that a busy machine slows both alike.
-- Gradients are fixed random tensors; only optimizer:step() is timed.
--   gptlua recipes/tools/bench_muon.lua [--steps=20] [--rounds=5] [--threads=N] [--n_embd=128] [--n_layer=4]
-- Measured (2 cores shared with six other sessions, load average 18-27, so
-- the milliseconds mean little and the ratio is the result): --steps=10
-- --rounds=3: classic 544 ms, current 687 ms (1.26x); --rounds=5: 672 ms
-- against 771 ms (1.15x).  The variant's steps are O(elements) against the
-- iteration's O(elements x min(rows, cols)) but are about 30 more op calls
-- per matrix.
local gl = require 'gptlua'
local train = require 'gptlua.train'
local now = require('gptlua.cli').now

local opts = { steps = 20, rounds = 5, threads = 0, n_embd = 128, n_layer = 4 }
for _, a in ipairs(arg) do
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k or opts[k] == nil then
    error('bench_muon: unknown argument ' .. a .. ' (--steps, --rounds, --threads, --n_embd, --n_layer)', 0)
  end
  opts[k] = tonumber(v) or error('bench_muon: --' .. k .. ' expects a number', 0)
end
if opts.threads > 0 then gl.set_num_threads(opts.threads) end

local recipe = dofile(gl.root .. '/recipes/shakespeare.lua')
local function setup(variant)
  local r = {}
  for k, v in pairs(recipe) do r[k] = v end
  r.optimizer, r.muon_variant, r.muon_weight_decay, r.device = 'nanochat', variant, 0.1, 'cpu'
  r.nanochat = { version = 'v1' }  -- the block its numbers were measured with
  r.n_embd, r.n_layer, r.n_head = opts.n_embd, opts.n_layer, math.max(1, math.floor(opts.n_embd / 32))
  local cfg = train.resolve_config(r, {})
  cfg.vocab_size = 65
  local model = train.build_model(cfg)
  local opt = train.build_optimizer(cfg, model)
  for i, p in ipairs(model:parameters()) do p.grad = gl.randn(p.shape, { seed = i }):mul_(1e-2):keep() end
  opt:step()   -- the state exists before timing
  return opt
end

local runs = { classic = setup('classic'), current = setup('current') }
local times = { classic = {}, current = {} }
for _ = 1, opts.rounds do
  for _, v in ipairs({ 'classic', 'current' }) do
    local t0 = now()
    for _ = 1, opts.steps do gl.scope(function() runs[v]:step() end) end
    table.insert(times[v], (now() - t0) / opts.steps * 1e3)
  end
end
local function median(l) table.sort(l); return l[math.floor((#l + 1) / 2)] end
local c, n = median(times.classic), median(times.current)
print(('nanochat optimizer step, n_layer %d, n_embd %d, %d threads: classic %.2f ms, current %.2f ms (%.2fx), '
  .. 'medians of %d rounds of %d steps'):format(opts.n_layer, opts.n_embd, gl.get_num_threads and gl.get_num_threads() or 0,
  c, n, n / c, opts.rounds, opts.steps))
