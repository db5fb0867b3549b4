-- spec/support/pty.lua — runs a command on a pseudo-terminal (forkpty), so
-- a spec can use the REPL as a person at a terminal does: type keys, press
-- Ctrl-C or Tab, and wait for text to appear.  Every wait is bounded.
--   local s = pty.spawn({ exe, '-i', script }, { HOME = dir })
--   s:send('1 + 1\n'); s:expect('2'); s:send('\3'); local status = s:finish()
local ffi = require 'ffi'

for _, decl in ipairs({
  'int forkpty(int *amaster, char *name, void *termp, void *winp);',
  'int execve(const char *path, char *const argv[], char *const envp[]);',
  'long read(int fd, void *buf, size_t n);',
  'long write(int fd, const void *buf, size_t n);',
  'int close(int fd);',
  'int kill(int pid, int sig);',
  'int waitpid(int pid, int *status, int options);',
  -- (the same struct and declaration as gptlua.control_socket's: ffi.C.poll is
  -- declared once per process, by whichever loads first)
  'struct gl_pollfd { int fd; short events; short revents; };',
  'int poll(struct gl_pollfd *fds, unsigned long n, int timeout_ms);',
  'void _exit(int status);',
}) do pcall(ffi.cdef, decl) end
local C = ffi.C

local M = {}
local Session = {}
Session.__index = Session

-- spawn(argv, env): argv[1] is the executable's path; env the whole environment
function M.spawn(argv, env)
  local cargv = ffi.new('char *[?]', #argv + 1)
  local keep = {}
  for i, a in ipairs(argv) do
    keep[#keep + 1] = ffi.new('char[?]', #a + 1, a)
    cargv[i - 1] = keep[#keep]
  end
  local names = {}
  for k in pairs(env) do names[#names + 1] = k end
  local cenv = ffi.new('char *[?]', #names + 1)
  for i, k in ipairs(names) do
    local s = k .. '=' .. env[k]
    keep[#keep + 1] = ffi.new('char[?]', #s + 1, s)
    cenv[i - 1] = keep[#keep]
  end
  local master = ffi.new('int[1]')
  local pid = C.forkpty(master, nil, nil, nil)
  if pid == 0 then  -- the child: nothing but exec (no Lua runs here)
    C.execve(cargv[0], cargv, cenv)
    C._exit(127)
  end
  assert(pid > 0, 'pty: forkpty failed')
  return setmetatable({ fd = master[0], pid = pid, out = '', seen = 0, keep = keep }, Session)
end

-- reads what is available within ms milliseconds; false at end of output
function Session:pump(ms)
  local p = ffi.new('struct gl_pollfd[1]')
  p[0].fd, p[0].events = self.fd, 1
  if C.poll(p, 1, ms) <= 0 then return true end
  local buf = ffi.new('char[4096]')
  local n = C.read(self.fd, buf, 4096)
  if n <= 0 then return false end
  self.out = self.out .. ffi.string(buf, n)
  return true
end

function Session:send(s)
  assert(C.write(self.fd, s, #s) == #s, 'pty: write failed')
end

-- waits (at most `seconds`) for `text` to appear after what the last
-- expect matched; returns the output up to it
function Session:expect(text, seconds)
  local deadline = os.time() + (seconds or 20)
  while true do
    local i, j = self.out:find(text, self.seen + 1, true)
    if i then
      local before = self.out:sub(self.seen + 1, j)
      self.seen = j
      return before
    end
    if os.time() > deadline or not self:pump(100) then
      error(('pty: %q did not appear; the terminal showed:\n%s'):format(text, self.out:sub(self.seen + 1)), 2)
    end
  end
end

-- sends Ctrl-D (unless told not to), waits for the exit and returns its status
-- (128 + N for a signal N); kills the child after `seconds`
function Session:finish(seconds, no_eof)
  if not no_eof then self:send('\4') end
  local st = ffi.new('int[1]')
  local deadline = os.time() + (seconds or 20)
  while C.waitpid(self.pid, st, 1) == 0 do  -- WNOHANG
    self:pump(50)
    if os.time() > deadline then C.kill(self.pid, 9); C.waitpid(self.pid, st, 0); break end
  end
  self:pump(0)
  C.close(self.fd)
  local s = st[0]
  if bit.band(s, 0x7f) == 0 then return bit.band(bit.rshift(s, 8), 0xff) end
  return 128 + bit.band(s, 0x7f)
end

return M
