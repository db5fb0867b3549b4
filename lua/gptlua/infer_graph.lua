-- gptlua.infer_graph — the KV-cache engine's decode step (gptlua.infer)
-- replayed as a CUDA graph on a GPU.
--
-- A graph replays the same kernels with the same arguments, so nothing
-- that changes from step to step may be baked into them: the decode step
-- here reads all of it from fixed device buffers the host writes before
-- each replay (ordinary copies and fills, outside the graph):
--   ids (B, 1)        this step's tokens;
--   slot (1)          the cache position being written: each layer adds
--                     its new K and V there with index_add (the slot is
--                     still zero), and also copies them into the cache's
--                     last slot, which stays the current token's;
--   positions (B, 1)  each row's position (its prompt's, with padding);
--   segments (B, S)   1 on the slots a query sees (the prompt's tokens and
--                     the decoded ones before the slot, and the last slot),
--                     0 elsewhere (padding, the slots not written yet): the
--                     attention runs over the whole capacity under
--                     gl.with_segments, its query at the last slot.
-- The logits land in a fixed buffer the host reads after the replay.  The
-- first decode step runs this body op by op (the warm-up: the caching
-- allocator holds its blocks), the second is captured and replayed, and the
-- rest replay.  The caches need one slot more than the generation (the
-- last); a layer whose sliding window is shorter than the capacity cannot
-- run here (the window counts from the query's slot) and the engine decodes
-- op by op instead (M.obstacle).
local gl = require 'gptlua'
local cuda = require 'gptlua.cuda'

local M = {}

-- why the decode of this model with caches of capacity S cannot be a graph, or nil
function M.obstacle(model, S, device)
  if not tostring(device):match('^cuda') then return 'the model is not on a GPU' end
  for _, mod in ipairs(model:modules()) do
    if type(mod.window) == 'number' and mod.window > 0 and mod.window < S then
      return ('a sliding window of %d keys (shorter than the cache\'s %d slots) counts from the query\'s slot in a '
              .. 'graph'):format(mod.window, S)
    end
  end
  return nil
end

local Step = {}
Step.__index = Step
M.Step = Step

-- the decode step of engine over caches (from Engine:prefill, capacity one
-- slot more than needed) for B rows; opts.capture = false runs every step
-- op by op (the same body: what a replay must equal); opts.required makes a
-- failed capture an error (else the steps run op by op, self.note says why)
function M.new(engine, caches, B, opts)
  opts = opts or {}
  local dev, S, p = engine.device, caches[1].cap, caches[1].pos
  local self = setmetatable({ engine = engine, caches = caches, B = B, capture = opts.capture ~= false,
                              required = opts.required, steps = 0, replays = 0, nodes = 0 }, Step)
  self.pad = caches.pad or {}
  local seg = gl.zeros({ B, S }, { dtype = 'int64', device = dev })
  if caches.segments then seg:copy_(caches.segments) else seg:narrow(2, 1, p):fill_(1) end
  if S > p then seg:narrow(2, p + 1, S - p):fill_(0) end
  seg:narrow(2, S, 1):fill_(1)  -- the current token's slot
  self.segments = seg:keep()
  self.slot = gl.zeros({ 1 }, { dtype = 'int64', device = dev }):keep()
  self.positions = gl.zeros({ B, 1 }, { dtype = 'int64', device = dev }):keep()
  self.ids = gl.zeros({ B, 1 }, { dtype = 'int64', device = dev }):keep()
  return self
end

-- the step's device work: the forward of ids into the caches at slot, the logits into self.logits
function Step:body()
  local caches, model = self.caches, self.engine.model
  gl.scope(function()
    for i = 1, #caches do caches[i].slot = self.slot end
    caches.positions = self.positions
    local ok, logits = pcall(gl.with_segments, self.segments, function() return model:forward(self.ids, nil, caches) end)
    for i = 1, #caches do caches[i].slot = nil end
    caches.positions = nil
    if not ok then error(logits, 0) end
    self.logits:copy_(logits:select(2, 1))
  end)
end

-- decodes ids (B numbers) at the caches' position; returns the logits (B, V),
-- a fixed buffer the next step overwrites
function Step:step(ids)
  local caches, B = self.caches, self.B
  local p = caches[1].pos
  -- this step's inputs into the fixed buffers (outside any graph)
  local col, pos = {}, {}
  for b = 1, B do col[b], pos[b] = { ids[b] }, { p - (self.pad[b] or 0) } end
  self.ids:copy_(gl.tensor(col, { dtype = 'int64' }))
  self.positions:copy_(gl.tensor(pos, { dtype = 'int64' }))
  self.slot:fill_(p)
  if p > 0 then self.segments:narrow(2, p, 1):fill_(1) end  -- the previous token, now in its slot
  if not self.logits then
    local V = self.engine.model.config.vocab_size
    self.logits = gl.empty({ B, V }, { dtype = caches[1].k.dtype, device = self.engine.device }):keep()
  end
  if self.graph then
    self.graph:replay()
    self.replays = self.replays + 1
  elseif self.capture and self.steps >= 1 then  -- after the warm-up step: capture, then replay
    local ok, g = pcall(cuda.graph, function() self:body() end, self.engine.device)
    if ok then
      self.graph, self.nodes = g, g.nodes
      g:replay()
      self.replays = self.replays + 1
    else  -- nothing captured ran: this step and the rest op by op
      if self.required then error(g, 0) end
      self.capture, self.note = false, tostring(g)
      self:body()
    end
  else
    self:body()
  end
  for i = 1, #caches do caches[i].pos = p + 1 end
  self.steps = self.steps + 1
  return self.logits
end

-- the graph and the fixed buffers freed now (the logits too: read them first)
function Step:free()
  if self.graph then self.graph:free(); self.graph = nil end
  local Tensor = require 'gptlua.tensor'
  for _, k in ipairs({ 'segments', 'slot', 'positions', 'ids', 'logits' }) do
    if self[k] then Tensor.release(self[k]); self[k] = nil end
  end
end

return M
