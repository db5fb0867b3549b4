-- gptlua.dist.compose — which parallel layouts compose with which
-- data-parallel policy, optimizer and model: the trainer's whole layout
-- checked at once, before anything is built or cut, so that a layout that
-- cannot run is refused in one line and one that passes does not fail later.
--
-- check(cfg, world, model_cfg) raises 'config: ...' (error(msg, 0)) or
-- returns the mesh sizes {pp, dp, cp, tp}.  It is a pure function of the
-- resolved config, the world size and the model's sizes (no collective, no
-- allocation), so every rank of a job reaches the same verdict at the same
-- point: gptlua.train prints a refusal once (rank 0) and every rank exits
-- cleanly (exit_refused below), and a spec asks it without launching
-- anything (spec/composition_spec.lua).
--
-- The parts keep their own checks (mesh.sizes, TensorParallel.check,
-- ContextParallel.check, the pipeline's partition and schedules, the
-- policies' constructors), and this calls them, so the rules live in one
-- place each; what is checked here alone is how the parts compose.
local M = {}

local function fail(msg) error('config: ' .. msg, 0) end

-- the policies that run over a mesh's dp dimension (under tp, cp or pp):
-- those that keep every rank's parameters equal to one process's
M.MESH_POLICIES = { ddp = true, zero1 = true, zero2 = true, fsdp = true, hsdp = true }
M.MESH_POLICY_LIST = "'ddp', 'zero1', 'zero2', 'fsdp' or 'hsdp'"

-- a part's own check, its message in the config's words (one line)
local function part(f, ...)
  local ok, err = pcall(f, ...)
  if not ok then error((tostring(err):gsub('^[^\n]-:%d+: ', ''):gsub('\n.*', '')), 0) end
end

-- hooks: the recipe's (its own pp_schedule is not cfg's);
-- model_cfg: the model's sizes (n_head, n_kv_head, n_embd, n_layer,
-- block_size, vocab_size, padded_vocab_size, window), nil for a recipe's own
-- model (its parts check it when they cut it)
function M.check(cfg, world, model_cfg, hooks)
  local mesh = require 'gptlua.dist.mesh'
  local sizes = { pp = 1, dp = world, cp = 1, tp = 1 }
  if cfg.tp > 1 or cfg.cp > 1 or cfg.pp > 1 or cfg.dp > 0 then
    part(function() sizes = mesh.sizes({ dp = cfg.dp, tp = cfg.tp, cp = cfg.cp, pp = cfg.pp }, world) end)
  end
  -- expert parallelism: a cut of the dp group (gptlua.dist.expert_parallel)
  if (cfg.ep or 1) > 1 then require('gptlua.dist.expert_parallel').check(cfg, sizes.dp) end
  local dims = {}
  for _, d in ipairs({ 'pp', 'tp', 'cp' }) do if sizes[d] > 1 then dims[#dims + 1] = d end end
  local where = table.concat(dims, ' and ') .. ' > 1'
  if #dims > 0 and not M.MESH_POLICIES[cfg.dist] then
    fail(("dist '%s' with %s is not supported (expected %s over the dp dimension)"):format(tostring(cfg.dist),
      where, M.MESH_POLICY_LIST))
  end
  if cfg.dist == 'hsdp' then  -- shard groups within the ranks that average gradients (dp x cp)
    local n, s = sizes.dp * sizes.cp, cfg.shard_size
    if s < 1 or n % s ~= 0 then
      fail(('hsdp needs shard_size dividing the %s %d (ranks per shard group), got %d'):format(
        #dims > 0 and 'dp x cp group of' or 'world size', n, s))
    end
  end
  if cfg.sp and sizes.tp < 2 then fail('sp (sequence parallel) needs tp > 1, got tp ' .. sizes.tp) end
  if cfg.total_batch_size > 0 then
    local per = cfg.batch_size * cfg.block_size * sizes.dp
    if cfg.total_batch_size % per ~= 0 then
      fail(('total_batch_size %d is not a multiple of batch_size*block_size*%s (%d)'):format(cfg.total_batch_size,
        #dims > 0 and 'dp' or 'world', per))
    end
  end
  if not model_cfg then return sizes end
  if sizes.tp > 1 then
    part(require('gptlua.dist.tensor_parallel').check, model_cfg, sizes.tp, cfg.sp)
  end
  if sizes.cp > 1 then
    local CP = require 'gptlua.dist.context_parallel'
    part(CP.check, model_cfg, sizes.cp, cfg.cp_mode, sizes.tp)
    if cfg.model == 'nanochat' then part(CP.check_nanochat, model_cfg, cfg.cp_mode, cfg.sp) end
  end
  if sizes.pp > 1 then
    local v = cfg.pp_virtual or 1
    if model_cfg.n_layer < sizes.pp * v then
      fail(('pipeline: %d blocks cannot fill %d stages (pp %d x pp_virtual %d; each needs one)'):format(
        model_cfg.n_layer, sizes.pp * v, sizes.pp, v))
    end
    local accum = cfg.total_batch_size > 0 and cfg.total_batch_size / (cfg.batch_size * cfg.block_size * sizes.dp)
      or cfg.gradient_accumulation_steps
    if not (hooks and hooks.pp_schedule) then  -- (a recipe's own schedule is checked when it is made)
      part(require('gptlua.dist.schedules').make, cfg.pp_schedule, sizes.pp, accum, v)
    end
  end
  return sizes
end

-- A refusal every rank of a job reached alike, at the same point and
-- outside any collective (gptlua.dist.compose's verdict on the layout, a bad
-- key): rank 0 prints msg, the one line, and every rank shuts its backend
-- down and exits, without the abort that a rank's own error needs (no
-- message from each rank, no launcher banner).  Under `gptlua -n`'s mpirun
-- (GPTLUA_LAUNCH_STATUS names a file) rank 0 writes the status there and
-- every rank exits 0, so mpirun adds no banner of its own, and the launcher
-- exits with the status; otherwise every rank exits 1.
function M.exit_refused(msg)
  local dist = require 'gptlua.dist'
  local found = dist.discover()
  local rank = dist.size() > 1 and dist.rank() or (found and found.rank) or 0
  io.stdout:flush()
  local status_file = os.getenv('GPTLUA_LAUNCH_STATUS')
  if status_file == '' then status_file = nil end
  if rank == 0 then
    io.stderr:write(tostring(msg), '\n')
    io.stderr:flush()
    if status_file then
      local f = io.open(status_file, 'wb')
      if f then f:write('1\n'); f:close() else status_file = nil end
    end
  end
  pcall(dist.finalize)
  os.exit(status_file and 0 or 1)
end

return M
