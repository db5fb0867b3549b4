-- gptlua.dist.policies.ddp — data parallel: every rank holds the whole
-- model and optimizer; gradients are averaged over ranks.
--
-- Each parameter's .grad is a view into its bucket's flat buffer, so
-- backward accumulates straight into the buffers the all-reduce works on and
-- nothing is copied in or out.  On the last micro-step of a step, a bucket's
-- asynchronous all-reduce (average) starts from the gradient-ready hook of
-- its last parameter and overlaps the rest of backward; earlier micro-steps
-- only accumulate (no_sync).  after_backward waits for the reductions; then
-- every rank runs the wrapped optimizer on identical gradients.
local gl = require 'gptlua'
local B = require 'gptlua.dist.policies.base'

local DDP = setmetatable({}, { __index = B.Base })
DDP.__index = DDP

function DDP.new(name, o)
  local self = setmetatable({}, DDP)
  B.Base.init(self, name, o)
  B.broadcast_params(self.comm, self.params)
  local order = {}
  for i = #self.params, 1, -1 do order[#order + 1] = self.params[i] end
  for _, list in ipairs(B.plan(order, self.cap_bytes)) do
    local n = 0
    for _, p in ipairs(list) do n = n + p:numel() end
    local b = { params = {}, grad = B.flat(n, list.dtype, list.device) }
    local off = 0
    for _, p in ipairs(list) do
      local v = B.view(b.grad, off, p.shape)
      if p.grad then v:copy_(p.grad) end
      p.grad = v
      b.params[#b.params + 1] = p
      off = off + p:numel()
    end
    self.buckets[#self.buckets + 1] = b
  end
  self:_order_buckets(order)
  self:_install_hooks()
  -- PowerSGD compression as the buckets' communication hook (powersgd.lua)
  local rank = o.cfg and o.cfg.powersgd_rank or 0
  if rank ~= 0 then require('gptlua.dist.policies.powersgd').install(self, rank, o.model) end
  return self
end

function DDP:_launch(b)
  if not self.sync then return end
  b.work = self.comm:all_reduce_async(b.grad, 'avg')
end

function DDP:_finish()
  for _, b in ipairs(self.buckets) do
    if b.work then b.work:wait(); b.work = nil end
  end
end

function DDP:zero_grad()
  for _, b in ipairs(self.buckets) do b.grad:zero_() end
end

-- after the all-reduce every rank holds the averaged gradients: the local
-- norm is the global one
function DDP:grad_norm()
  local grads = {}
  for i, b in ipairs(self.buckets) do grads[i] = b.grad end
  return math.sqrt(B.sumsq_list(grads))
end

function DDP:scale_grads(s)
  for _, b in ipairs(self.buckets) do b.grad:mul_(s) end
end

function DDP:step() self.optimizer:step() end

-- bytes of optimizer state on this rank (the whole, unsharded)
function DDP:optimizer_state_bytes() return B.optimizer_state_bytes(self.optimizer) end

return DDP
