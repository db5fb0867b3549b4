-- gptlua.dist.rendezvous — the launchers of a job on several nodes (one
-- TCP launcher a node: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT) meeting
-- before each attempt of a job that restarts (gptlua.dist.elastic), as
-- torchrun's elastic agents meet at their c10d rendezvous: after a failure
-- the launchers that can still reach each other agree on the next world.
--
-- Node 0's launcher is the rendezvous host: it listens on MASTER_PORT for
-- the whole job.  Before each attempt (round 0 first, round k before
-- restart k) every other launcher connects and sends one JSON line,
--   {"node": 1, "ranks": 2, "round": 1, "nnodes": 2, "max_restarts": K, "min_ranks": M}
-- The host closes the round once every node of NNODES has joined, or
-- timeout s (--rdzv_timeout) after it opened it, and answers each joined
-- node with its place in the next world, nodes in NODE_RANK order:
--   {"round": 1, "world": 3, "first_rank": 2, "port": P, "nodes": [0, 1]}
-- where P is a port the host found free for this round: the ranks' own
-- rendezvous (rank 0, on the host, serves it at MASTER_ADDR:P).  When the
-- joined nodes have fewer ranks than --min_ranks, or a node's request does
-- not fit the job, the answer is {"stop": "<one line>"}.
--
-- A node that cannot reach the host, or gets no answer, within twice the
-- timeout gives up with one line.  So the job goes on only where the host
-- is: the host's node lost ends the job on every node, as torchrun's
-- static c10d endpoint does (no other launcher takes over).
local ffi = require 'ffi'
local cjson = require 'cjson'
local libc = require 'gptlua.libc'
local C = ffi.C

local M = {}

-- Linux values (the same on x86-64 and aarch64)
local AF_INET, SOCK_STREAM, SOCK_NONBLOCK, SOCK_CLOEXEC = 2, 1, 2048, 524288
local SOL_SOCKET, SO_REUSEADDR, SO_ERROR, MSG_NOSIGNAL = 1, 2, 4, 16384
local EAGAIN, EINTR, EINPROGRESS = 11, 4, 115
local POLLIN, POLLOUT = 1, 4
local now = libc.monotonic

local function errstr(e) return ffi.string(C.strerror(e or ffi.errno())) end

-- a sockaddr_in (16 bytes) for 4 address bytes (nil: any) and a port
local function sockaddr(ip, port)
  local a = ffi.new('uint8_t[16]')
  a[0] = AF_INET                        -- sin_family, little-endian
  a[2], a[3] = math.floor(port / 256), port % 256
  if ip then ffi.copy(a + 4, ip, 4) end
  return a
end

-- the IPv4 address of host (a name or a dotted quad) as 4 bytes, or nil and why
function M.resolve(host)
  local hints = ffi.new('struct gl_addrinfo')
  hints.ai_family, hints.ai_socktype = AF_INET, SOCK_STREAM
  local res = ffi.new('struct gl_addrinfo*[1]')
  local rc = C.getaddrinfo(host, nil, hints, res)
  if rc ~= 0 then return nil, ('cannot resolve %s: %s'):format(host, ffi.string(C.gai_strerror(rc))) end
  local ip = ffi.string(ffi.cast('uint8_t *', res[0].ai_addr) + 4, 4)
  C.freeaddrinfo(res[0])
  return ip
end

-- writes all of line and a newline to fd (non-blocking) before deadline
local function send_line(fd, line, deadline)
  local p = line .. '\n'
  local n, sent = #p, 0
  local pfd = ffi.new('struct gl_pollfd[1]')
  while sent < n do
    local k = C.send(fd, ffi.cast('const char *', p) + sent, n - sent, MSG_NOSIGNAL)
    if k > 0 then sent = sent + tonumber(k)
    elseif k < 0 and (ffi.errno() == EAGAIN or ffi.errno() == EINTR) and now() < deadline then
      pfd[0].fd, pfd[0].events = fd, POLLOUT
      C.poll(pfd, 1, 100)
    else return false end
  end
  return true
end

-- reads what fd has into conn.data (non-blocking); false when it closed
local buf = ffi.new('char[4096]')
local function read_some(conn)
  while true do
    local k = C.recv(conn.fd, buf, 4096, 0)
    if k > 0 then conn.data = conn.data .. ffi.string(buf, k)
    elseif k == 0 then return false
    else return ffi.errno() == EAGAIN or ffi.errno() == EINTR end
  end
end

-- ------------------------------------------------------------------ the host
local Host = {}
Host.__index = Host

-- Listens on port (all interfaces) for the job's launchers.  o: nnodes, n
-- (the host's own ranks), min_ranks, max_restarts, timeout.  Returns the
-- host, or nil and a line saying why not.
function M.host(port, o)
  local fd = C.socket(AF_INET, SOCK_STREAM + SOCK_NONBLOCK + SOCK_CLOEXEC, 0)
  if fd < 0 then return nil, 'socket: ' .. errstr() end
  C.setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, ffi.new('int[1]', 1), 4)
  if C.bind(fd, sockaddr(nil, port), 16) ~= 0 or C.listen(fd, 64) ~= 0 then
    local why = errstr()
    C.close(fd)
    return nil, ('cannot listen for the launchers\' rendezvous on port %d (MASTER_PORT): %s'):format(port, why)
  end
  return setmetatable({ fd = fd, o = o }, Host)
end

function Host:close()
  if self.fd then C.close(self.fd); self.fd = nil end
end

-- why a join request does not fit this round, or nil
function Host:misfit(m, round, joined)
  local o = self.o
  if type(m) ~= 'table' or type(m.node) ~= 'number' or type(m.ranks) ~= 'number' then
    return 'a malformed rendezvous request (expected {"node": N, "ranks": R, "round": K, ...})'
  end
  if m.node < 1 or m.node >= o.nnodes or m.node % 1 ~= 0 then
    return ('NODE_RANK=%s does not fit a job of NNODES=%d'):format(tostring(m.node), o.nnodes)
  end
  if joined[m.node] then return ('node %d joined this round twice'):format(m.node) end
  if m.nnodes ~= o.nnodes or m.max_restarts ~= o.max_restarts or m.min_ranks ~= o.min_ranks then
    return ('node %d was started with NNODES=%s --max_restarts=%s --min_ranks=%s; the rendezvous host with '
      .. 'NNODES=%d --max_restarts=%d --min_ranks=%d'):format(m.node, tostring(m.nnodes), tostring(m.max_restarts),
      tostring(m.min_ranks), o.nnodes, o.max_restarts, o.min_ranks)
  end
  if m.round ~= round then
    return ('node %d asked to join round %s, the job is at round %d: it was left out of the job at an earlier '
      .. 'restart'):format(m.node, tostring(m.round), round)
  end
  if m.ranks < 1 or m.ranks % 1 ~= 0 then return ('node %d offers %s ranks'):format(m.node, tostring(m.ranks)) end
end

-- Round `round`: waits for the other nodes (all of NNODES, or until the
-- timeout), then answers them.  Returns the host's place ({world,
-- first_rank = 0, port, nodes}), or nil and the line every node stops with.
function Host:round(round, say)
  local o = self.o
  local joined, count = { [0] = { ranks = o.n } }, 1
  local conns = {}
  local deadline = now() + o.timeout
  local pfds = ffi.new('struct gl_pollfd[?]', 65)
  while count < o.nnodes and now() < deadline do
    pfds[0].fd, pfds[0].events = self.fd, POLLIN
    local np = 1
    for _, c in ipairs(conns) do
      if np < 65 then pfds[np].fd, pfds[np].events = c.fd, POLLIN; np = np + 1 end
    end
    C.poll(pfds, np, math.max(1, math.min(200, math.ceil((deadline - now()) * 1000))))
    while #conns < 64 do
      local fd = C.accept4(self.fd, nil, nil, SOCK_NONBLOCK + SOCK_CLOEXEC)
      if fd < 0 then break end
      conns[#conns + 1] = { fd = fd, data = '' }
    end
    for i = #conns, 1, -1 do
      local c = conns[i]
      local open = read_some(c)
      local line = c.data:match('^([^\n]*)\n')
      if line then
        table.remove(conns, i)
        local ok, m = pcall(cjson.decode, line)
        local why = self:misfit(ok and m or nil, round, joined)
        if why then
          say('rendezvous: refused a node: ', why)
          send_line(c.fd, cjson.encode({ stop = why }), now() + 1)
          C.close(c.fd)
        else
          joined[m.node], count = { ranks = m.ranks, fd = c.fd }, count + 1
        end
      elseif not open then
        table.remove(conns, i)
        C.close(c.fd)
      end
    end
  end
  for _, c in ipairs(conns) do C.close(c.fd) end   -- came too late to be read: they retry, and are told
  local nodes, world, first = {}, 0, {}
  for node = 0, o.nnodes - 1 do
    if joined[node] then nodes[#nodes + 1], first[node], world = node, world, world + joined[node].ranks end
  end
  local stop
  if world < o.min_ranks then
    stop = ('only %d of %d ranks (node%s %s of %d) joined the rendezvous within %g s, fewer than --min_ranks=%d: %s')
      :format(world, o.nnodes * o.n, #nodes == 1 and '' or 's', table.concat(nodes, ', '), o.nnodes, o.timeout,
      o.min_ranks, round == 0 and 'the job does not start'
        or ('giving up after %d restart%s'):format(round - 1, round == 2 and '' or 's'))
  end
  local port = not stop and require('gptlua.dist.launch').free_port()
  if not stop and not port then stop = 'rendezvous: no free TCP port on the host for the ranks\' rendezvous' end
  for _, node in ipairs(nodes) do
    local j = joined[node]
    if j.fd then
      local answer = stop and { stop = stop }
        or { round = round, world = world, first_rank = first[node], port = port, nodes = nodes }
      send_line(j.fd, cjson.encode(answer), now() + 5)
      C.close(j.fd)
    end
  end
  if stop then return nil, stop end
  return { round = round, world = world, first_rank = 0, port = port, nodes = nodes }
end

-- ---------------------------------------------------------------- the others
-- Joins round `round` at host:port as node `node` with n ranks (o: nnodes,
-- min_ranks, max_restarts, timeout).  Returns this node's place, or nil and
-- the line it stops with.
function M.join(host, port, node, n, round, o)
  local limit = 2 * o.timeout
  local deadline = now() + limit
  local ip, why = M.resolve(host)
  if not ip then return nil, 'rendezvous: ' .. why end
  local request = cjson.encode({ node = node, ranks = n, round = round, nnodes = o.nnodes,
    max_restarts = o.max_restarts, min_ranks = o.min_ranks })
  local pfd = ffi.new('struct gl_pollfd[1]')
  local last = 'no answer'
  while now() < deadline do
    local fd = C.socket(AF_INET, SOCK_STREAM + SOCK_NONBLOCK + SOCK_CLOEXEC, 0)
    if fd < 0 then return nil, 'rendezvous: socket: ' .. errstr() end
    local connected = C.connect(fd, sockaddr(ip, port), 16) == 0
    if not connected and ffi.errno() == EINPROGRESS then
      pfd[0].fd, pfd[0].events = fd, POLLOUT
      C.poll(pfd, 1, math.max(1, math.ceil((deadline - now()) * 1000)))
      local err, len = ffi.new('int[1]'), ffi.new('unsigned[1]', 4)
      C.getsockopt(fd, SOL_SOCKET, SO_ERROR, err, len)
      connected = pfd[0].revents ~= 0 and err[0] == 0
      if not connected then last = err[0] ~= 0 and errstr(err[0]) or 'connection timed out' end
    elseif not connected then last = errstr() end
    if connected and send_line(fd, request, deadline) then
      local conn = { fd = fd, data = '' }
      while now() < deadline do
        pfd[0].fd, pfd[0].events = fd, POLLIN
        C.poll(pfd, 1, math.max(1, math.min(500, math.ceil((deadline - now()) * 1000))))
        local open = read_some(conn)
        local line = conn.data:match('^([^\n]*)\n')
        if line then
          C.close(fd)
          local ok, m = pcall(cjson.decode, line)
          if not ok or type(m) ~= 'table' then return nil, 'rendezvous: a malformed answer from the host: ' .. line end
          if m.stop then return nil, 'rendezvous: ' .. tostring(m.stop) end
          return m
        end
        if not open then last = 'the host closed the connection'; break end
      end
    end
    C.close(fd)
    if now() < deadline then C.poll(nil, 0, 200) end
  end
  return nil, ('rendezvous: no answer from the rendezvous host %s:%d within %g s (%s): this node stops; the job '
    .. 'goes on without it where the host still runs'):format(host, port, limit, last)
end

return M
