-- gptlua.control_socket — the Unix-domain socket a running job listens on
-- (gptlua.control) and `gptlua attach` connects to, through LuaJIT's FFI on
-- libc: no C of our own, no thread, nothing that blocks a training step.
--
-- Protocol: one JSON object a line each way.  The client sends
--   {"id": 1, "code": "<Lua source>", "ranks": "all" | [0, 1] | 0}
-- and the job answers, at its next step boundary,
--   {"id": 1, "step": 42, "results": [{"rank": 0, "ok": true, "out": "..."}]}
-- or, for a line it cannot read, {"error": "control: ..."} (the job goes on).
--
-- Security: the socket file is created with mode 0600 inside the run
-- directory (umask set around bind, then chmod), so only the job's user can
-- connect; every peer's credentials (SO_PEERCRED) are checked against the
-- job's effective uid as well, and a peer of another uid is dropped.
local ffi = require 'ffi'
local C = ffi.C

local S = {}

require 'gptlua.libc'   -- sockets, poll, getpwuid

-- Linux values (the same on x86-64 and aarch64)
local AF_UNIX, SOCK_STREAM, SOCK_NONBLOCK, SOCK_CLOEXEC = 1, 1, 2048, 524288
local SOL_SOCKET, SO_PEERCRED, MSG_DONTWAIT, MSG_NOSIGNAL = 1, 17, 64, 16384
local EAGAIN, EINTR, ECONNREFUSED, ENOENT = 11, 4, 111, 2
local POLLIN, POLLOUT = 1, 4
S.MAX_LINE = 1024 * 1024   -- a longer line is refused and its client dropped

local function errstr() return ffi.string(C.strerror(ffi.errno())) end

-- the sockaddr of path, or nil and why (sun_path holds 107 bytes and a NUL)
local function address(path)
  if #path > 107 then
    return nil, ('socket path %s is %d bytes, longer than the 107 a Unix socket allows'):format(path, #path)
  end
  local a = ffi.new('struct gl_sockaddr_un')
  a.sun_family = AF_UNIX
  ffi.copy(a.sun_path, path)
  return a
end

-- A connected, blocking client socket; returns fd or nil and the reason.
function S.connect(path)
  local a, why = address(path)
  if not a then return nil, why end
  local fd = C.socket(AF_UNIX, SOCK_STREAM + SOCK_CLOEXEC, 0)
  if fd < 0 then return nil, 'socket: ' .. errstr() end
  if C.connect(fd, a, ffi.sizeof(a)) ~= 0 then
    local e = ffi.errno()
    C.close(fd)
    return nil, ffi.string(C.strerror(e)), e
  end
  return fd
end

local Server = {}
Server.__index = Server
local listening = {}   -- path -> the server this process listens on there

-- Listens on path (non-blocking).  A socket file left there by a killed
-- job (nothing accepts on it) is removed first; one a live job answers on
-- is not touched: returns nil and the reason.
function S.listen(path)
  local a, why = address(path)
  if not a then return nil, why end
  if listening[path] then listening[path]:close() end
  local probe, _, e = S.connect(path)
  if probe then
    C.close(probe)
    return nil, ('another job is listening on %s'):format(path)
  end
  if e == ECONNREFUSED then C.unlink(path) end   -- stale: its job is gone
  local fd = C.socket(AF_UNIX, SOCK_STREAM + SOCK_NONBLOCK + SOCK_CLOEXEC, 0)
  if fd < 0 then return nil, 'socket: ' .. errstr() end
  local old = C.umask(tonumber('177', 8))         -- the file is born 0600
  local rc = C.bind(fd, a, ffi.sizeof(a))
  local err = rc ~= 0 and errstr()
  C.umask(old)
  if rc ~= 0 or C.chmod(path, tonumber('600', 8)) ~= 0 or C.listen(fd, 8) ~= 0 then
    err = err or errstr()
    C.close(fd)
    return nil, ('cannot listen on %s: %s'):format(path, err)
  end
  local server = setmetatable({ fd = fd, path = path, clients = {}, queue = {}, uid = C.geteuid(),
    buf = ffi.new('char[65536]'), pfd = ffi.new('struct gl_pollfd[1]') }, Server)
  -- a job that ends in an error still removes its socket (when the state
  -- closes); a later run in this process replaces one left open here
  server.guard = ffi.gc(ffi.new('int[1]'), function() server:close() end)
  listening[path] = server
  return server
end

-- "user (pid N)" of a connected peer, and its uid
local function peer(fd)
  local cred, len = ffi.new('struct gl_ucred'), ffi.new('unsigned[1]', ffi.sizeof('struct gl_ucred'))
  if C.getsockopt(fd, SOL_SOCKET, SO_PEERCRED, cred, len) ~= 0 then return nil end
  local pw = C.getpwuid(cred.uid)
  local name = pw ~= nil and ffi.string(pw.pw_name) or ('uid ' .. tonumber(cred.uid))
  return ('%s (pid %d)'):format(name, cred.pid), cred.uid
end

-- sends a whole line to a client, waiting at most a second for room; a
-- client that cannot take it (gone, or not reading) is dropped
function Server:send(client, line)
  if client.closed then return false end
  local p, n, sent = line .. '\n', #line + 1, 0
  local t = 0
  while sent < n do
    local k = C.send(client.fd, ffi.cast('const char *', p) + sent, n - sent, MSG_DONTWAIT + MSG_NOSIGNAL)
    if k > 0 then sent = sent + tonumber(k)
    elseif ffi.errno() == EAGAIN and t < 10 then
      self.pfd[0].fd, self.pfd[0].events = client.fd, POLLOUT
      C.poll(self.pfd, 1, 100)
      t = t + 1
    elseif ffi.errno() ~= EINTR then self:drop(client); return false end
  end
  return true
end

function Server:drop(client)
  if client.closed then return end
  client.closed = true
  C.close(client.fd)
  for i, c in ipairs(self.clients) do if c == client then table.remove(self.clients, i) break end end
end

local function refuse(self, client, msg)
  self:send(client, require('cjson').encode({ error = 'control: ' .. msg }))
end

-- one line from a client: a command queued, or an error sent back
local function take_line(self, client, line)
  local cjson = require 'cjson'
  local ok, m = pcall(cjson.decode, line)
  if not ok or type(m) ~= 'table' then
    return refuse(self, client, 'malformed message (expected one JSON object a line: {"id": N, "code": "...", "ranks": "all"})')
  end
  if type(m.code) ~= 'string' then
    return refuse(self, client, ('message without code (a string of Lua), got %s'):format(type(m.code)))
  end
  local ranks = m.ranks
  if ranks == nil then ranks = { 0 } end
  if type(ranks) == 'number' then ranks = { ranks } end
  if ranks ~= 'all' then
    local good = type(ranks) == 'table'
    if good then for _, r in ipairs(ranks) do good = good and type(r) == 'number' and r >= 0 and r % 1 == 0 end end
    if not good then
      return refuse(self, client, ('ranks must be "all", a rank or a list of ranks, got %s'):format(cjson.encode(m.ranks)))
    end
  end
  self.queue[#self.queue + 1] = { client = client, id = m.id, code = m.code, ranks = ranks, who = client.who,
                                  quiet = m.quiet == true }   -- quiet: Tab completion, not an event of the run
end

-- Accepts new clients and reads whatever they sent, without blocking (or
-- waiting up to wait_ms for something to arrive); queued commands are in
-- self.queue.
function Server:poll(wait_ms)
  if wait_ms and wait_ms > 0 and #self.queue == 0 then
    local n = #self.clients + 1
    local fds = ffi.new('struct gl_pollfd[?]', n)
    fds[0].fd, fds[0].events = self.fd, POLLIN
    for i, c in ipairs(self.clients) do fds[i].fd, fds[i].events = c.fd, POLLIN end
    C.poll(fds, n, wait_ms)
  end
  while true do
    local fd = C.accept4(self.fd, nil, nil, SOCK_NONBLOCK + SOCK_CLOEXEC)
    if fd < 0 then break end
    local who, uid = peer(fd)
    local client = { fd = fd, who = who, data = '' }
    self.clients[#self.clients + 1] = client
    if uid ~= self.uid then
      refuse(self, client, 'connection refused: not the job\'s user')
      self:drop(client)
    end
  end
  for _, client in ipairs({ unpack(self.clients) }) do
    while not client.closed do
      local k = C.recv(client.fd, self.buf, 65536, MSG_DONTWAIT)
      if k > 0 then
        local chunk = ffi.string(self.buf, k)
        client.data = client.data .. chunk
        if chunk:find('\n', 1, true) then   -- (searched only then: a long unfinished line stays linear)
          local start = 1
          while true do
            local nl = client.data:find('\n', start, true)
            if not nl then break end
            local line = client.data:sub(start, nl - 1)
            if line:match('%S') then take_line(self, client, line) end
            start = nl + 1
          end
          client.data = client.data:sub(start)
        end
        if #client.data > S.MAX_LINE then
          refuse(self, client, ('message longer than %d bytes'):format(S.MAX_LINE))
          self:drop(client)
        end
      elseif k == 0 or ffi.errno() ~= EAGAIN and ffi.errno() ~= EINTR then
        self:drop(client)      -- gone: its queued commands still run, their replies go nowhere
      else break end
    end
  end
  return #self.queue > 0
end

-- the queued commands, emptying the queue
function Server:take()
  local q = self.queue
  self.queue = {}
  return q
end

function Server:close()
  if not self.fd then return end
  for _, c in ipairs({ unpack(self.clients) }) do self:drop(c) end
  C.close(self.fd)
  self.fd = nil
  C.unlink(self.path)
  if listening[self.path] == self then listening[self.path] = nil end
end

-- the client side: a line sent, a line read (blocking, within timeout_s)
local Client = {}
Client.__index = Client

function S.client(path)
  local fd, why = S.connect(path)
  if not fd then return nil, why end
  return setmetatable({ fd = fd, data = '', buf = ffi.new('char[65536]'), pfd = ffi.new('struct gl_pollfd[1]') }, Client)
end

-- sends line and its newline (partial = true: line alone, as a client cut
-- off mid-message would)
function Client:send(line, partial)
  local p = partial and line or line .. '\n'
  local n, sent = #p, 0
  while sent < n do
    local k = C.send(self.fd, ffi.cast('const char *', p) + sent, n - sent, MSG_NOSIGNAL)
    if k < 0 then return nil, errstr() end
    sent = sent + tonumber(k)
  end
  return true
end

-- the next line, or nil and 'timeout' / 'closed'
function Client:read_line(timeout_s)
  local deadline = require('gptlua.cli').now() + timeout_s
  while true do
    local line, rest = self.data:match('^([^\n]*)\n(.*)$')
    if line then self.data = rest; return line end
    local left = deadline - require('gptlua.cli').now()
    if left <= 0 then return nil, 'timeout' end
    self.pfd[0].fd, self.pfd[0].events = self.fd, POLLIN
    if C.poll(self.pfd, 1, math.min(math.ceil(left * 1000), 1000)) > 0 then
      local k = C.recv(self.fd, self.buf, 65536, 0)
      if k <= 0 then return nil, 'closed' end
      self.data = self.data .. ffi.string(self.buf, k)
    end
  end
end

function Client:close()
  if self.fd then C.close(self.fd); self.fd = nil end
end

S.ENOENT, S.ECONNREFUSED = ENOENT, ECONNREFUSED
return S
