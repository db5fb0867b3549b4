-- The latency relay of spec/support/netns.lua (netns_relay.c and its
-- connect shim), between two network namespaces: a connection from one to
-- the other passes its bytes intact and in order, a round trip takes at
-- least twice the relay's delay (each direction holds it once), and a
-- connect the destination refuses is refused to the caller.  Skipped,
-- saying why, where namespaces cannot be made or the relay cannot be
-- compiled.
local NS = require 'support.netns'
local H = require 'support.mpi'

local ok, why = NS.available()
if ok then   -- the relay is C, compiled here
  local built, err = pcall(NS.relay_build)
  if not built then ok, why = false, tostring(err) end
end
if not ok then
  describe('the netns latency relay', function()
    pending('skipped: network namespaces or a C compiler are not available here (' .. why .. ')')
  end)
  return
end

local DELAY_MS = 50
local ECHO = H.ROOT .. '/spec/support/netns_echo.lua'

-- runs the echo server in node 2 and the client (through node 1's relay) in node 1
local function echo(nodes, port, nbytes, serve)
  local server = ''
  if serve then
    server = ('ip netns exec %s %s %s serve %s %d > /tmp/%s.echo 2>&1 & '):format(nodes[2].name, H.EXE, ECHO,
      nodes[2].addr, port, nodes[2].name)
  end
  -- the client retries its connect until the server listens (a refused connect prints CONNECT_FAILED)
  local client = ('ip netns exec %s env %s %s %s send %s %d %d'):format(nodes[1].name, nodes[1].env, H.EXE, ECHO,
    nodes[2].addr, port, nbytes)
  local cmd = server .. (serve and ('for i in $(seq 100); do out=$(%s); case "$out" in CONNECT_FAILED*) sleep 0.1;; '
    .. '*) break;; esac; done; echo "$out"; wait'):format(client) or client)
  local out = H.sh('bash -c ' .. ("'%s'"):format(cmd:gsub("'", "'\\''")), 60)
  os.remove(('/tmp/%s.echo'):format(nodes[2].name))
  return out
end

describe('the netns latency relay', function()
  it(('passes bytes intact and delays each direction %d ms'):format(DELAY_MS), function()
    local out = NS.with({ delay_ms = DELAY_MS }, function(nodes)
      return echo(nodes, 7000, 300000, true)
    end)
    assert.truthy(out:find('ECHO 300000 300000 true', 1, true), out)
    local rtt = tonumber(out:match('RTT_MS ([%d.]+)'))
    assert.truthy(rtt, out)
    assert.is_true(rtt >= 2 * DELAY_MS, ('a round trip took %.1f ms, expected >= %d'):format(rtt, 2 * DELAY_MS))
  end)

  it('refuses a connect the destination refuses', function()
    local out = NS.with({ delay_ms = DELAY_MS }, function(nodes)
      return echo(nodes, 7001, 0, false)   -- nothing listens on node 2
    end)
    assert.truthy(out:find('CONNECT_FAILED 111', 1, true), out)   -- ECONNREFUSED
  end)
end)
