-- gptlua.train_graph — the trainer's CUDA graph mode (config key cuda_graph).
--
-- A micro-step's forward and backward (every kernel from the embedding to
-- the last weight gradient, a few hundred launches) is captured once, after
-- cuda_graph_warmup optimizer steps run op by op, and replayed from then on:
-- Lua dispatches nothing per op, the host spends one launch per micro-step.
--   - Inputs: the batch is copied into two fixed device tensors before each
--     replay (the graph reads them); gradients are the parameters' own .grad
--     tensors, made during the warm-up and zeroed in place each step, so the
--     replayed backward accumulates into them as the op-by-op one does.
--   - Memory: what the capture allocates comes from the graph's pool
--     (kernels/runtime.cu, engine/alloc.c) and stays the graph's; the
--     caching allocator's free blocks are handed back before the capture,
--     so the pool does not sit beside the warm-up's cached copy of the same
--     temporaries (twice the activations).
--   - Losses: gl.cross_entropy and the fused head read nothing on the host
--     (the count of targets and the upstream gradient stay on the device),
--     so a run is the same computation whether a step is replayed or
--     launched op by op.
--   - Outside the graph, as before: the loss read (one host wait per
--     micro-step), the gradient norm and clipping, the optimizer step.  They
--     read host numbers (the scheduled learning rate, the clip decision)
--     that a captured launch would freeze.
-- cuda_graph = 'auto' (the default) uses a graph where one applies (a CUDA
-- device, one process, no dropout, no profiler; the trainer's batch shapes
-- are fixed) and says once why a capture failed, then runs op by op; true
-- makes either an error; 'off' or false never captures.  CPU runs are
-- unaffected.
local gl = require 'gptlua'
local cuda = require 'gptlua.cuda'

local M = {}

local WORDS = { auto = 'auto', ['true'] = true, on = true, ['false'] = false, off = false }

-- cfg.cuda_graph as 'auto', true or false ('off'); an error for anything else
function M.mode(cfg)
  local v = cfg.cuda_graph
  if type(v) == 'string' then v = WORDS[v:lower()] == nil and v or WORDS[v:lower()] end
  if v ~= 'auto' and v ~= true and v ~= false then
    error(("config: cuda_graph must be 'off' (false), 'auto' or true, got %s"):format(tostring(cfg.cuda_graph)), 0)
  end
  return v
end

-- why a graph cannot serve this trainer, or nil
local function obstacle(t)
  local cfg = t.cfg
  if cfg.device == 'cpu' then return 'the device is cpu (CUDA graphs need a CUDA device)' end
  if t.world > 1 or t.dist then return 'the run has ' .. t.world .. ' ranks (graphs serve one process for now)' end
  if cfg.dropout > 0 then
    return ('dropout %g > 0 draws a fresh mask each step from the host RNG, which a graph would replay'):format(cfg.dropout)
  end
  if cfg.profile ~= '' then return 'the profiler wraps every op, which a replay does not call' end
  return nil
end

local Graph = {}
Graph.__index = Graph

-- the graph mode of trainer t, or nil when off (an error when cuda_graph =
-- true cannot be honoured)
function M.for_trainer(t)
  local mode = M.mode(t.cfg)
  if mode == false then return nil end
  local why = obstacle(t)
  if why then
    if mode == true then error('cuda_graph = true: ' .. why, 0) end
    return nil
  end
  return setmetatable({ t = t, mode = mode, steps = 0, warmup = t.cfg.cuda_graph_warmup }, Graph)
end

-- forward and backward of one micro-step on (x, y); on_loss(loss) sees the
-- loss before the backward frees the graph's tensors
local function forward_backward(model, x, y, accum, on_loss)
  local _, loss = model:forward(x, y)
  on_loss(loss)
  local scaled = loss * (1 / accum)
  scaled:backward(nil, { free_activations = true })
end

-- op by op, as the trainer without a graph; returns the loss
local function eager(model, x, y, accum)
  local v
  gl.scope(function() forward_backward(model, x, y, accum, function(l) v = l:item() end) end)
  return v
end

-- captures the micro-step on the fixed inputs; true, or false and why
function Graph:capture(model, accum)
  local loss
  local ok, err = pcall(cuda.graph, function()
    gl.scope(function()
      forward_backward(model, self.x, self.y, accum, function(l) loss = l:detach():clone():keep() end)
    end)
  end, self.t.cfg.device)
  if not ok then return false, tostring(err) end
  self.g, self.loss = err, loss
  return true
end

-- one micro-step (the trainer's loop body): the batch, forward, backward;
-- returns the loss as a number
function Graph:micro_step(micro, accum)
  return self:micro_step_body(micro, accum)
end

function Graph:micro_step_body(micro, accum)
  local t = self.t
  local x, y = t.data.train:next_batch()
  if self.g then
    self.x:copy_(x)
    self.y:copy_(y)
    self.g:replay()
    return self.loss:item()
  end
  if self.failed or self.steps < self.warmup then return eager(t.model, x, y, accum) end
  self.x, self.y = x:clone():keep(), y:clone():keep()
  cuda.empty_cache(t.cfg.device)  -- the warm-up's cached blocks: the pool replaces them
  local ok, why = self:capture(t.model, accum)
  if not ok then  -- nothing captured ran: this micro-step runs op by op
    self.failed, self.x, self.y = true, nil, nil
    if self.mode == true then error(why, 0) end
    t:print(why .. '; running op by op (cuda_graph = false silences this)')
    return eager(t.model, x, y, accum)
  end
  t:print(('cuda_graph: captured the forward and backward (%d nodes, %s of graph memory)')
    :format(self.g.nodes, require('gptlua.progress').fmt_bytes(self.g.pool_bytes)))
  self.g:replay()
  return self.loss:item()
end

-- an optimizer step ended (the warm-up counts them)
function Graph:step_done() self.steps = self.steps + 1 end

function Graph:free()
  if self.g then self.g:free() end
  self.g = nil
end

return M
