-- Both ends of spec/netns_relay_spec.lua's connection, over the FFI's
-- sockets (so a client's connect is the C library's, which the relay's
-- shim replaces):
--   gptlua spec/support/netns_echo.lua serve ADDR PORT   -- echoes one connection to its end
--   gptlua spec/support/netns_echo.lua send ADDR PORT N  -- times a 1-byte round trip, then sends N
--                                                        -- bytes and reads them back
-- send prints "RTT_MS <ms>" and "ECHO <sent> <received> <same: true|false>";
-- a connect that fails prints "CONNECT_FAILED <errno>".
local ffi = require 'ffi'
local C = require('gptlua.libc').C
local now = require('gptlua.libc').monotonic

local mode, addr, port, n = arg[1], arg[2], tonumber(arg[3]), tonumber(arg[4] or 0)

local function sockaddr(ip, p)
  local a = ffi.new('uint8_t[16]')
  a[0], a[2], a[3] = 2, math.floor(p / 256), p % 256   -- AF_INET (little-endian), port in network order
  local i = 4
  for octet in ip:gmatch('%d+') do a[i] = tonumber(octet); i = i + 1 end
  return a
end

local function send_all(fd, s)
  local off = 0
  while off < #s do
    local k = tonumber(C.send(fd, ffi.cast('const char *', s) + off, #s - off, 0))
    if k <= 0 then error('send failed, errno ' .. ffi.errno()) end
    off = off + k
  end
end

local buf = ffi.new('char[65536]')
local function recv_some(fd)
  local k = tonumber(C.recv(fd, buf, 65536, 0))
  if k < 0 then error('recv failed, errno ' .. ffi.errno()) end
  return ffi.string(buf, k)
end

local fd = C.socket(2, 1, 0)
if mode == 'serve' then
  local one = ffi.new('int[1]', 1)
  C.setsockopt(fd, 1, 2, one, 4)   -- SO_REUSEADDR
  assert(C.bind(fd, sockaddr(addr, port), 16) == 0, 'bind failed')
  assert(C.listen(fd, 1) == 0, 'listen failed')
  print('listening'); io.stdout:flush()
  local c = C.accept4(fd, nil, nil, 0)
  assert(c >= 0, 'accept failed')
  while true do
    local s = recv_some(c)
    if s == '' then break end
    send_all(c, s)
  end
  C.shutdown(c, 1)
  C.close(c)
else
  if C.connect(fd, sockaddr(addr, port), 16) ~= 0 then print('CONNECT_FAILED ' .. ffi.errno()) os.exit(0) end
  local t0 = now()
  send_all(fd, 'p')
  assert(recv_some(fd) == 'p', 'the ping did not come back')
  print(('RTT_MS %.3f'):format((now() - t0) * 1000))
  local parts, x = {}, 12345   -- a deterministic pattern (an LCG), every byte value
  for i = 1, n do x = (x * 1103515245 + 12345) % 2147483648; parts[i] = string.char(math.floor(x / 65536) % 256) end
  local sent = table.concat(parts)
  send_all(fd, sent)
  C.shutdown(fd, 1)   -- SHUT_WR: the server echoes to the end, then ends its side
  local got = {}
  while true do
    local s = recv_some(fd)
    if s == '' then break end
    got[#got + 1] = s
  end
  got = table.concat(got)
  print(('ECHO %d %d %s'):format(#sent, #got, tostring(got == sent)))
end
C.close(fd)
