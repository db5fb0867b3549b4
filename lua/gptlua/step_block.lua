-- gptlua.step_block — a training step's scalars in one float64 tensor on the
-- step's device (gl_ops.h, "The step block"), and its pinned host copy.
--
-- The host writes the rates (each AdamW group's GL_STEP_ADAMW_SLOTS, the
-- clip threshold) into the host copy before a step; the step's first work
-- is one small copy of it to the device (gl_step_block_copy, no host wait,
-- so a CUDA graph holds it and a replay reads this step's values); the
-- device writes the micro-step losses, the gradient's sum of squares, norm,
-- clip scale and skip flag; the step's last work copies the block back, and
-- the host reads it once, after the step.  Slots: the header (GL_STEP_*),
-- then what reserve() hands out in order.  On a CPU device both copies are
-- plain CPU tensors (the CPU twins of the kernels take the same block).
local gl = require 'gptlua'
local G = require 'gptlua.ffi'
local ffi, lib = gl.ffi, gl.lib

local M = {}
local Block = {}
Block.__index = Block


-- a block for device dev; reserve slots, then realize()
function M.new(device)
  return setmetatable({ device = device, n = lib.GL_STEP_HEADER }, Block)
end

-- k consecutive slots; returns the first's index (0-based, as the C side)
function Block:reserve(k)
  if self.dev then error('step_block: reserve after realize', 2) end
  local first = self.n
  self.n = self.n + k
  return first
end

-- allocates the device block and its host copy (pinned for a CUDA device)
function Block:realize()
  local n = self.n
  self.dev = gl.zeros({ n }, { dtype = 'float64', device = self.device }):keep()
  if self.device == 'cpu' then self.host = gl.zeros({ n }, { dtype = 'float64' }):keep()
  else
    self.host = gl.empty_pinned({ n }, { dtype = 'float64' }):keep()
    self.host:zero_()
  end
  self.h = ffi.cast('double *', self.host:data_ptr())  -- what the host writes and reads
  return self
end

-- queued: host copy -> device (the step's first work)
function Block:send() G.check(lib.gl_step_block_copy(self.dev.c, self.host.c), 2) end
-- queued: device -> host copy (the step's last work); read after a synchronize
function Block:fetch() G.check(lib.gl_step_block_copy(self.host.c, self.dev.c), 2) end

-- the float64 sum of squares of tensors (a list) into GL_STEP_SUMSQ, on the device
function Block:sumsq(tensors)
  local n = #tensors
  local a = self._xs
  if not a or self._xs_cap < n then a = ffi.new('const gl_tensor *[?]', math.max(n, 1)); self._xs, self._xs_cap = a, n end
  for i, t in ipairs(tensors) do a[i - 1] = t.c end
  G.check(lib.gl_step_sumsq(self.dev.c, n, a), 2)
end

-- LOSS, NORM, CLIP_SCALE, SKIP from the nloss losses at slot loss_at
function Block:finalize(loss_at, nloss) G.check(lib.gl_step_finalize(self.dev.c, loss_at, nloss), 2) end

-- the device block's slot i as a 1-element tensor view (a loss is copied there)
function Block:slot(i) return self.dev:narrow(1, i + 1, 1) end

return M
