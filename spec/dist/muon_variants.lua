-- Run on every rank by spec/dist_muon_spec.lua: trains policy_recipe.lua's
-- nanochat with nanochat's current optimizer (muon_variant 'current':
-- Polar Express, NorMuon, cautious weight decay 0.1, per-group AdamW) under
-- each policy, the global batch fixed by total_batch_size (any number of
-- ranks reads the same rows per step), checkpointing every 3 steps.
-- args: OUT MAX_ITERS policy[,policy...] [RESUME]
-- Rank 0 writes OUT/<policy>.json: {losses, state_bytes and state_piece_bytes
-- (per rank: the policy's count, and 4 bytes per element of every piece of
-- state each_state shows), normuon_elements (per rank: elements of NorMuon's
-- second moments held)}; the run's checkpoints are under OUT/<policy>/p.
-- Prints "OK rank R of N".
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local cjson = require 'cjson'
local recipe = dofile(gl.root .. '/spec/dist/policy_recipe.lua')

local out, iters, pols, resume = arg[1], tonumber(arg[2]), arg[3], arg[4]
local world = dist.init { backend = os.getenv('GPTLUA_SPEC_BACKEND') or 'mpi', timeout = 120 }

local function sum_over_ranks(x)
  local list = {}
  for r = 0, world.size - 1 do list[r + 1] = world:all_reduce_number(r == world.rank and x or 0, 'sum') end
  return list
end

for pol in pols:gmatch('[^,]+') do
  local r = recipe({ optimizer = 'nanochat', muon_variant = 'current', muon_weight_decay = 0.1, dist = pol,
    max_iters = iters, total_batch_size = 2 * 16 * 4, checkpoint_interval = 3, keep_last = 5, bucket_mb = 0.01,
    out_dir = out .. '/' .. pol })
  local t = train.new(r, resume and { '--resume=' .. resume } or {})
  local res = t:run()
  local pieces, normuon = 0, 0
  t.policy:each_state(function(k, v, _, _, kind)
    if kind == 'state' then pieces = pieces + 4 * v:numel() end
    if k:match('%.second_momentum_buffer$') then normuon = normuon + v:numel() end
  end)
  local bytes = sum_over_ranks(t.policy:optimizer_state_bytes())
  local piece_bytes, normuon_elements = sum_over_ranks(pieces), sum_over_ranks(normuon)
  if world.rank == 0 then
    local f = assert(io.open(('%s/%s.json'):format(out, pol), 'wb'))
    f:write(cjson.encode({ losses = res.losses, state_bytes = bytes, state_piece_bytes = piece_bytes,
      normuon_elements = normuon_elements }))
    f:close()
  end
  t.policy:detach()
end
print(('OK rank %d of %d'):format(world.rank, world.size))
