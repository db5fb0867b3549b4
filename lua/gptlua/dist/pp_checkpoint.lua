-- gptlua.dist.pp_checkpoint — checkpoints of a pipeline-parallel run: every
-- stage writes its own parameters and optimizer state, so no rank ever holds
-- the whole model.
--
-- The directory is an ordinary gptlua checkpoint (gptlua.checkpoint: made
-- under a temporary name, renamed when complete, every file checksummed in
-- state.json) whose model and optimizer state are split by pp rank:
--   model.safetensors, optim.safetensors      pp rank 0's (and the buffers)
--   model.ppNNNNN.safetensors, optim.ppNNNNN.safetensors   pp rank N's
--   state.json    + parts = {model = {files}, optim = {files}}
-- checkpoint.load merges the parts, so the checkpoint reads as an unsharded
-- run's: it loads into any pp size, pp = 1 included.  gpt2's tied embedding
-- and nanochat v2's lambdas are written once, by the first stage.  One rank per pp rank writes (dp 0,
-- tp 0): ZeRO's pieces of a stage's optimizer state are assembled over dp
-- first, tensor parallelism's shards gathered over tp.  Collective over the
-- world.
local ckpt = require 'gptlua.checkpoint'
local cjson = require 'cjson'

local M = {}

local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

function M.files(r)
  if r == 0 then return 'model.safetensors', 'optim.safetensors' end
  return ('model.pp%05d.safetensors'):format(r), ('optim.pp%05d.safetensors'):format(r)
end

-- "adamw.NAME.m" -> NAME
local function opt_param_name(key) return key:match('^[%w_]+%.(.*)%.[%w_]+$') end

-- save(policy, trainer, opt_sd, state): policy the pp policy
-- (gptlua.dist.policies.pp); returns the checkpoint's path
function M.save(policy, trainer, opt_sd, state)
  local mesh, pipe = policy.mesh, policy.pipe
  local world, me = mesh.world, mesh.coord.pp
  local tp = require 'gptlua.dist.policies.tp'
  -- this stage's whole optimizer state (ZeRO: assembled over dp; collective)
  local opt = tp._local_optimizer_state(policy.inner.layout and policy.inner or policy, opt_sd)
  -- the parameters several stages hold (gpt2's tied embedding, nanochat v2's
  -- lambdas, equal on every holder) are written by the first stage only
  local others = {}
  if me ~= 0 then
    if pipe.adapter.tied then others[pipe.adapter.tied] = true end
    for _, name in ipairs(pipe.adapter.shared or {}) do others[name] = true end
  end
  local model_sd, opt_out = {}, {}
  local whole = policy.inner.full_state_dict and policy.inner:full_state_dict()  -- FSDP: gathered over dp
  for _, np in ipairs(pipe.named) do if not others[np[1]] then model_sd[np[1]] = whole and whole[np[1]] or np[2] end end
  for k, t in pairs(opt) do if not others[opt_param_name(k)] then opt_out[k] = t end end
  if me == 0 then for _, nb in ipairs(pipe.model:named_buffers()) do model_sd[nb[1]] = nb[2] end end
  local layout = policy.inner.layout
  local writer = mesh.coord.dp == 0 and mesh.coord.cp == 0 and (not layout or layout.rank == 0)
  if layout and mesh.coord.dp == 0 and mesh.coord.cp == 0 then  -- tp: the shards gathered whole (collective over tp)
    local TP = require 'gptlua.dist.tensor_parallel'
    model_sd, opt_out = TP.full_state(layout, model_sd), TP.full_state(layout, opt_out, opt_param_name)
  end
  local final = ('%s/step_%07d'):format(trainer.ckpt_dir, trainer.step)
  local tmp = final .. '.tmp-stages'
  if world.rank == 0 then
    ckpt.mkdir_p(trainer.ckpt_dir)
    os.execute('rm -rf ' .. quote(tmp))
    ckpt.mkdir_p(tmp)
  end
  world:barrier()
  if writer then
    local mf, of = M.files(me)
    ckpt.save_safetensors(tmp .. '/' .. mf, model_sd)
    ckpt.save_safetensors(tmp .. '/' .. of, opt_out)
  end
  world:barrier()
  if world.rank == 0 then
    local ok, err = pcall(function()
      local files, parts = {}, { model = {}, optim = {} }
      for r = 0, mesh.size.pp - 1 do
        local mf, of = M.files(r)
        files[mf], files[of] = ckpt.checksum(tmp .. '/' .. mf), ckpt.checksum(tmp .. '/' .. of)
        if r > 0 then parts.model[#parts.model + 1], parts.optim[#parts.optim + 1] = mf, of end
      end
      state.files, state.step, state.format, state.parts = files, trainer.step, 'gptlua-checkpoint-1', parts
      local f = assert(io.open(tmp .. '/state.json', 'wb'))
      f:write(cjson.encode(state))
      f:close()
      if ckpt.exists(final) then os.execute('rm -rf ' .. quote(final)) end
      local rok, rerr = os.rename(tmp, final)
      if not rok then error('checkpoint: rename to ' .. final .. ' failed: ' .. tostring(rerr)) end
    end)
    if not ok then os.execute('rm -rf ' .. quote(tmp)); error(err, 0) end
    ckpt.prune(trainer.ckpt_dir, trainer.cfg.keep_last, final)
  end
  world:barrier()  -- nobody reads or prunes before the rename
  trainer:print(('saved checkpoint %s'):format(final))
  return final
end

return M
