-- Two nodes on one machine (spec/support/netns.lua): each rank in a network
-- namespace of its own, the two joined by a veth pair, rendezvousing over
-- TCP and training over Gloo as on two hosts (torchrun-style variables,
-- MASTER_ADDR the first node's address); ddp across them equals one rank
-- with the same global batch, on a plain link and on one shaped to 20
-- Mbit/s (tc tbf).  Skipped, saying why, where namespaces cannot be made
-- (not root, no CAP_NET_ADMIN, no `ip`).
local NS = require 'support.netns'
local H = require 'support.mpi'
local ckpt = require 'gptlua.checkpoint'
local train = require 'gptlua.train'
local launch = require 'gptlua.dist.launch'

local ok, why = NS.available()
if not ok then
  describe('ddp across two network namespaces', function()
    pending('skipped: network namespaces are not available here (' .. why .. ')')
  end)
  return
end

-- the same run in this process: 1 rank, 2 accumulation steps (the 2 ranks' global batch)
local reference
local function reference_params()
  if not reference then
    local dir = H.tmpdir()
    local r = dofile('spec/dist/elastic_recipe.lua')
    r.out_dir, r.quiet, r.checkpoint_interval, r.gradient_accumulation_steps = dir, true, 0, 2
    local _, t = train.main(r, {})
    reference = H.params_of(t.model)
    os.execute('rm -rf ' .. dir)
  end
  return reference
end

describe('ddp across two network namespaces', function()
  for _, rate in ipairs({ false, '20mbit' }) do
    it(('equals one rank with the same global batch%s'):format(rate and (' over a link shaped to ' .. rate) or ''),
      function()
      local dir = H.tmpdir()
      local out, statuses = NS.with({ rate = rate or nil }, function(nodes)
        local port = launch.free_port()
        return NS.run_ranks(nodes, port, function()
          return ('%s %s/spec/dist/elastic_recipe.lua --out_dir=%s --dist=ddp --checkpoint_interval=0'):format(H.EXE,
            H.ROOT, dir)
        end, 120)
      end)
      assert.same({ 0, 0 }, statuses, out)
      assert.truthy(out:find('dist: ddp (on 2 ranks)', 1, true), out)
      local got = ckpt.load(dir .. '/elastic/checkpoints/step_0000008').model
      local e = H.rel_error(reference_params(), got)
      -- the two ranks' gradients summed in another order than one rank's accumulation
      assert.is_true(e < 1e-5, ('ddp across namespaces: final parameters differ, relative error %.3g'):format(e))
      os.execute('rm -rf ' .. dir)
    end)
  end
end)
