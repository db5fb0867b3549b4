-- gptlua.dist.policies.shards — checkpoints of sharded optimizer state.
--
-- A sharded checkpoint is an ordinary gptlua checkpoint directory (see
-- gptlua.checkpoint: written under a temporary name and renamed, every file
-- checksummed in state.json and verified by checkpoint.load) with one more
-- file per rank:
--   model.safetensors            the weights (rank 0)
--   optim.safetensors            state every rank holds alike (rank 0)
--   optim.rankNNNNN.safetensors  rank N's pieces: "<key>@<offset>" is the
--                                flat range [offset, offset+numel) of the
--                                state tensor <key> (a name without
--                                "@" is the whole tensor, as in an
--                                unsharded checkpoint)
--   state.json                   + shards = {policy, world, files, layout}
-- layout maps every state key to its full shape, so a checkpoint can be
-- re-cut for any number of ranks (each rank copies the overlap of what it
-- owns now with every piece) or assembled whole for an unsharded run.
local gl = require 'gptlua'
local ckpt = require 'gptlua.checkpoint'
local B = require 'gptlua.dist.policies.base'
local G = require 'gptlua.ffi'

local S = {}


function S.rank_file(r) return ('optim.rank%05d.safetensors'):format(r) end

-- Writes the checkpoint of a sharded run at trainer.step; collective over
-- policy.comm.  policy provides each_state(f) and state_layout().
function S.save(trainer, policy, model_sd, state)
  local comm, N = policy.comm, policy.comm.size
  local list = {}
  for r = 0, N - 1 do list[#list + 1] = S.rank_file(r) end
  state.shards = { policy = policy.name, world = N, files = list, layout = policy:state_layout() }
  local final, pending = ckpt.save_collective(comm, trainer.ckpt_dir, trainer.step, { tag = 'shards', state = state,
    files = { 'model.safetensors', 'optim.safetensors', unpack(list) },
    keep_last = trainer.cfg and trainer.cfg.keep_last or 0, writer = trainer.save_writer,
    write = function(tmp, put)
      local mine, common = {}, {}
      policy:each_state(function(key, t, off, replicated)
        if replicated then common[key] = t
        else mine[('%s@%d'):format(key, off)] = t:clone() end
      end)
      put(tmp .. '/' .. S.rank_file(comm.rank), mine)
      if comm.rank == 0 then
        put(tmp .. '/model.safetensors', model_sd)
        put(tmp .. '/optim.safetensors', common)
      end
    end })
  if trainer.print and not pending then trainer:print(('saved checkpoint %s'):format(final)) end
  return final
end

-- key -> list of {off, flat tensor}: every piece of optimizer state in a
-- loaded checkpoint c (checkpoint.load) at path, sharded or not.
function S.index(path, c)
  local idx = {}
  local function add(name, t)
    local k, off = name:match('^(.*)@(%d+)$')
    if not k then k, off = name, 0 end
    idx[k] = idx[k] or {}
    table.insert(idx[k], { off = tonumber(off), t = B.view(t, 0, { t:numel() }, false) })
  end
  for name, t in pairs(c.optim or {}) do add(name, t) end
  local sh = c.state and c.state.shards
  for _, f in ipairs(sh and sh.files or {}) do
    for name, t in pairs(ckpt.load_safetensors(path .. '/' .. f)) do add(name, t) end
  end
  return idx
end

-- Copies elements [off, off + dst:numel()) of state tensor `key` into the
-- contiguous tensor dst from whatever pieces hold them.
function S.fill(idx, key, off, dst, path)
  local n, covered = dst:numel(), 0
  for _, pc in ipairs(idx[key] or {}) do
    local lo, hi = math.max(off, pc.off), math.min(off + n, pc.off + pc.t:numel())
    if hi > lo then
      G.check(G.lib.gl_copy(B.view(dst, lo - off, { hi - lo }, false).c, B.view(pc.t, lo - pc.off, { hi - lo }, false).c))
      covered = covered + (hi - lo)
    end
  end
  if covered ~= n then
    error(('resume: optimizer state %s [%d, %d) is missing from checkpoint %s'):format(key, off, off + n,
      tostring(path)), 0)
  end
end

-- The whole optimizer state of checkpoint c ({key = tensor} as
-- optimizer:load_state_dict wants), assembled from its shards.
function S.full_tensors(path, c)
  local sh = c.state and c.state.shards
  if not sh then return c.optim end
  local idx, out = S.index(path, c), {}
  for k, shape in pairs(sh.layout) do
    local t = gl.zeros(shape, { dtype = 'float32' })
    S.fill(idx, k, 0, t, path)
    out[k] = t
  end
  return out
end

-- The wrapped optimizer's step counters from a checkpoint's state.
function S.set_steps(optimizer, st)
  if optimizer.optimizers then
    for i, o in ipairs(optimizer.optimizers) do o.t = st.opt_steps and st.opt_steps[i] or o.t end
  else
    optimizer.t = st.opt_step or optimizer.t
  end
end

return S
