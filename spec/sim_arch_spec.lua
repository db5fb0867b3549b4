-- The simulator pretending to be each GPU the library is built for
-- (GL_SIM_ARCH: compute capability and opt-in shared memory per block,
-- spec/cudasim/runtime.cpp), and the runtime's choice of kernel there:
-- flash attention's backward needs 112 KiB of shared memory at head dim
-- 128, more than sm_86 and sm_89 allow (99 KiB), so there the engine falls
-- back to the unfused path; sm_80 (163 KiB) and sm_90 (227 KiB) run it.  A
-- launch over a GPU's limit fails the run (spec/sim/arch_kernels.lua).
-- Tagged #cuda #sim: only under the simulator.
local S = require 'support.sim'

local FITS = { ['80'] = true, ['86'] = false, ['89'] = false, ['90'] = true }

describe('cuda-sim as each GPU: the runtime takes what fits #cuda #sim', function()
  for _, arch in ipairs({ '80', '86', '89', '90' }) do
    it('sm_' .. arch .. ': flash attention backward at D=128 ' .. (FITS[arch] and 'runs' or 'falls back'), function()
      local out, rc = require('support.mpi').sh(('env GL_SIM_ARCH=%s %s spec/sim/arch_kernels.lua'):format(arch,
        S.EXE), 300)
      assert(rc == 0 and out:find('\nok\n', 1, true) or out:find('^ok\n'), ('arch %s: exit %s\n%s'):format(arch,
        tostring(rc), out))
      local optin = { ['80'] = 163 * 1024, ['86'] = 99 * 1024, ['89'] = 99 * 1024, ['90'] = 227 * 1024 }
      assert.matches(('props %s.%s %d'):format(arch:sub(1, 1), arch:sub(2, 2), optin[arch]), out, 1, true)
      assert.matches('D=128 kernel flash_fwd_kernel<D,SEG>', out, 1, true)  -- 85 KiB: fits every arch
      assert.matches('D=64 kernel flash_bwd_kernel<D,SEG>', out, 1, true)
      assert.is_nil(out:find('D=64 kernel attn_dkdv_fallback_kernel', 1, true), out)
      if FITS[arch] then
        assert.matches('D=128 kernel flash_bwd_kernel<D,SEG>', out, 1, true)
        assert.is_nil(out:find('D=128 kernel attn_dkdv_fallback_kernel', 1, true), out)
      else
        assert.is_nil(out:find('D=128 kernel flash_bwd_kernel', 1, true), out)
        assert.matches('D=128 kernel attn_dkdv_fallback_kernel<P,T>', out, 1, true)
      end
    end)
  end

end)
