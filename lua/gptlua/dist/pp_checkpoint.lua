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

local M = {}


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
  local fsdp = policy:_fsdp()
  local whole = fsdp and fsdp:full_state_dict()  -- FSDP: gathered over dp (its shards of tp's cut, under tp)
  for _, np in ipairs(pipe.named) do if not others[np[1]] then model_sd[np[1]] = whole and whole[np[1]] or np[2] end end
  for k, t in pairs(opt) do if not others[opt_param_name(k)] then opt_out[k] = t end end
  -- buffers: a block's from its stage (a MoE router's expert bias moves on its stage only), the rest from the first
  for _, nb in ipairs(pipe.model:named_buffers()) do
    if (pipe:owner_of(nb[1]) or 0) == me then model_sd[nb[1]] = nb[2] end
  end
  -- expert parallelism: this stage's experts gathered whole over its ep group (collective over it)
  local ep = policy.inner.ep_layout and policy.inner
  if ep then
    for k, t in pairs(opt_sd.tensors) do  -- (a sharded policy's steps them apart; shared ones from the first stage)
      if not others[opt_param_name(k)] then opt_out[k] = opt_out[k] or t end
    end
    for k, t in pairs(ep.ep_layout:gather(model_sd)) do model_sd[k] = t end
    for k, t in pairs(ep.ep_layout:gather(opt_out)) do opt_out[k] = t end
  end
  local layout = policy.inner.layout
  local writer = mesh.coord.dp == 0 and mesh.coord.cp == 0 and (not layout or layout.rank == 0)
  if layout and mesh.coord.dp == 0 and mesh.coord.cp == 0 then  -- tp: the shards gathered whole (collective over tp)
    local TP = require 'gptlua.dist.tensor_parallel'
    model_sd, opt_out = TP.full_state(layout, model_sd), TP.full_state(layout, opt_out, opt_param_name)
  end
  local files, parts = {}, { model = {}, optim = {} }
  for r = 0, mesh.size.pp - 1 do
    local mf, of = M.files(r)
    files[#files + 1], files[#files + 2] = mf, of
    if r > 0 then parts.model[#parts.model + 1], parts.optim[#parts.optim + 1] = mf, of end
  end
  state.parts = parts
  local final, pending = ckpt.save_collective(world, trainer.ckpt_dir, trainer.step, { tag = 'stages', state = state,
    files = files, keep_last = trainer.cfg.keep_last, writer = trainer.save_writer,
    write = function(tmp, put)
      if not writer then return end
      local mf, of = M.files(me)
      put(tmp .. '/' .. mf, model_sd)
      put(tmp .. '/' .. of, opt_out)
    end })
  if not pending then trainer:print(('saved checkpoint %s'):format(final)) end
  return final
end

return M
