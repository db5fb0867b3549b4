-- Runs flash attention forward and backward (bfloat16, head dim 64 and 128)
-- on cuda:0 under the simulator's stream trace, and prints the device's
-- "props MAJOR.MINOR OPTIN", "D=HEAD_DIM kernel NAME" for each kernel launched, then "ok".  For
-- spec/sim_arch_spec.lua, which runs it with GL_SIM_ARCH set to each GPU:
-- a launch over that GPU's shared memory limit fails the run, so "ok" means
-- the runtime chose what fits there.
package.path = GPTLUA.root .. '/spec/?.lua;' .. package.path
local gl = require 'gptlua'
local lib = gl.lib
local trace = dofile(GPTLUA.root .. '/recipes/tools/sim_trace.lua')
local cuda = require 'gptlua.cuda'
local function K(rc) if rc ~= 0 then error(gl.ffi.string(lib.gl_last_error())) end end

local p = cuda.get_device_properties(0)
print(('props %d.%d %d'):format(p.major, p.minor, p.shared_memory_per_block_optin))

for _, D in ipairs({ 64, 128 }) do
  trace.start()
  local B, H, T = 1, 2, 128
  local function t(shape, seed) return gl.randn(shape, { seed = seed }):to('bfloat16'):to('cuda:0') end
  local q, k, v, g = t({ B, H, T, D }, 1), t({ B, H, T, D }, 2), t({ B, H, T, D }, 3), t({ B, H, T, D }, 4)
  local o = gl.empty({ B, H, T, D }, { dtype = 'bfloat16', device = 'cuda:0' })
  local lse = gl.empty({ B, H, T }, { dtype = 'float32', device = 'cuda:0' })
  K(lib.gl_attention_forward(o.c, lse.c, q.c, k.c, v.c, 1 / math.sqrt(D), 0))
  local dq, dk, dv = gl.empty({ B, H, T, D }, { dtype = 'bfloat16', device = 'cuda:0' }),
                     gl.empty({ B, H, T, D }, { dtype = 'bfloat16', device = 'cuda:0' }),
                     gl.empty({ B, H, T, D }, { dtype = 'bfloat16', device = 'cuda:0' })
  K(lib.gl_attention_backward(dq.c, dk.c, dv.c, g.c, q.c, k.c, v.c, o.c, lse.c, 1 / math.sqrt(D), 0))
  cuda.synchronize(0)
  trace.stop()
  -- the trace names a launch by its kernel expression (flash_bwd_kernel<D,SEG>): the head dim is printed with it
  local seen = {}
  for _, r in ipairs(trace.records()) do
    local name = r.kind == 'work' and r.what:match('^kernel (.*)')
    if name and not seen[name] then
      seen[name] = true
      print(('D=%d kernel %s'):format(D, name))
    end
  end
end
print('ok')
