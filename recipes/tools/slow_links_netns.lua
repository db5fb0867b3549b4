-- recipes/tools/slow_links_netns.lua — the slow-link policies over a slow
-- link: two ranks, each in a network namespace of its own (spec/support/
-- netns.lua), joined by a veth pair shaped by tc's token bucket to --rate
-- and delayed --delay_ms each way by a TCP relay in each namespace (these
-- kernels have no netem), rendezvousing over TCP and training over Gloo.
-- Every policy runs recipes/tools/slow_links.lua with the same token
-- budget; prints one Markdown table row per policy as it ends.  Needs root
-- (CAP_NET_ADMIN), `ip`, `tc` and a C compiler.
--
--   gptlua recipes/tools/slow_links_netns.lua [--tokens=393216] [--rate=100mbit] [--delay_ms=20]
--                                             [--only=SUBSTRING]
--
-- --rate=none: the link unshaped; --delay_ms=0: no relay (the baseline).
-- seconds: rank 0's wall time of train.main (building the model, the
-- steps, the final checkpoint; not the eval after it); s/step: the steps'
-- own time over their number; MB: what rank 0 sent (Comm.sent_bytes), in
-- 10^6 bytes.
package.path = GPTLUA.root .. '/spec/?.lua;' .. package.path
local NS = require 'support.netns'
local cjson = require 'cjson'
local launch = require 'gptlua.dist.launch'

local o = { tokens = 393216, rate = '100mbit', delay_ms = 20 }
for _, a in ipairs(arg or {}) do
  local k, v = a:match('^%-%-([%w_]+)=(.+)$')
  if not k or o[k] == nil and k ~= 'only' then
    io.stderr:write(('slow_links_netns: unknown argument %s (expected --tokens=N, --rate=R, --delay_ms=MS, --only=S)\n')
      :format(a))
    os.exit(2)
  end
  o[k] = (k == 'tokens' or k == 'delay_ms') and tonumber(v) or v
end
if not (o.tokens and o.tokens > 0) or not (o.delay_ms and o.delay_ms >= 0) then
  io.stderr:write('slow_links_netns: --tokens expected > 0 and --delay_ms >= 0\n')
  os.exit(2)
end
local ok, why = NS.available()
if not ok then io.stderr:write('slow_links_netns: network namespaces are not available here: ' .. why .. '\n') os.exit(1) end

local POLICIES = {
  '--dist=ddp',
  '--dist=ddp --powersgd_rank=4',
  '--dist=localsgd --sync_every=8',
  '--dist=localsgd --sync_every=32',
  '--dist=diloco --sync_every=32',
  '--dist=diloco --sync_every=32 --diloco_fragments=4',
  '--dist=diloco --sync_every=128',
  '--dist=ps --max_staleness=4',
}

print(('%s tokens on 2 ranks, one per network namespace; link %s, %s\n'):format(o.tokens,
  o.rate == 'none' and 'unshaped' or o.rate .. ' (tbf)', o.delay_ms > 0 and o.delay_ms .. ' ms each way (relay)' or 'no relay'))
print('| policy | seconds | s/step | val loss | MB sent (rank 0) |')
print('| --- | --- | --- | --- | --- |')
for _, p in ipairs(POLICIES) do
  if not o.only or p:find(o.only, 1, true) then
    local link = { rate = o.rate ~= 'none' and o.rate or nil, delay_ms = o.delay_ms > 0 and o.delay_ms or nil }
    local out, statuses = NS.with(link, function(nodes)
      return NS.run_ranks(nodes, launch.free_port(), function()
        return ('%s %s/recipes/tools/slow_links.lua --tokens=%d %s'):format(GPTLUA.exe, GPTLUA.root, o.tokens, p)
      end, 1800)
    end)
    local line = out:match('RESULT (%b{})')
    local label = p:gsub('%-%-dist=', '')
    if statuses[1] ~= 0 or statuses[2] ~= 0 or not line then
      print(('| `%s` | failed (status %s, %s) | | | |'):format(label, tostring(statuses[1]), tostring(statuses[2])))
      io.stderr:write(out .. '\n')
    else
      local r = cjson.decode(line)
      print(('| `%s` | %.1f | %.3f | %.3f | %.1f |'):format(label, r.seconds, r.step_seconds / r.steps, r.val_loss,
        r.bytes_rank0 / 1e6))
    end
    io.stdout:flush()
  end
end
