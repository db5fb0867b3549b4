-- recipes/tools/cuda_resources.lua — does every CUDA kernel fit every GPU the
-- library is built for?  (`make cuda-resources`, which `make test` runs.)
--
-- A launch fails ("too many resources requested for launch") when a block
-- asks more than the multiprocessor has: registers x threads per block over
-- the register file, or static + dynamic shared memory over the per-block
-- limit.  Neither shows until that launch runs on that GPU, and the
-- simulator cannot see registers at all, so this check reads them where
-- they are decided:
--   * registers and static shared memory per kernel and arch: ptxas -v
--     (`compile`, below, one resource file per source, every arch);
--   * threads per block: the kernel's __launch_bounds__, or each launch
--     site's block argument (GL_LAUNCH in kernels/*.cu), evaluated from the
--     sources' enum constants, or bounded by BLOCK_BOUNDS below;
--   * dynamic shared memory: each launch site's argument, a constant, or
--     bounded by the runtime guard named in SMEM_BOUNDS below (the check
--     fails when the guard's text is no longer in the source).
-- Per arch the limits are ARCHS'.  A kernel whose dynamic shared memory is
-- guarded by the device's opt-in limit (cu_smem_optin) runs wherever it
-- fits and takes its fallback elsewhere (spec/sim_arch_spec.lua runs both
-- sides in the simulator); here it must ask no static shared memory of its
-- own, which the guard does not count.
--
--   luajit recipes/tools/cuda_resources.lua compile SRC OUT ARCH...   (NVCC, CUDA_RES_FLAGS from the environment)
--   luajit recipes/tools/cuda_resources.lua check RESOURCE_FILE...
-- `check` prints one line per kernel and arch that does not fit and a
-- summary, and exits 1 when any does not.

local M = {}

-- Per-arch limits: registers per SM (and per block), the most registers a
-- thread can have, shared memory per block with the opt-in
-- (cudaFuncAttributeMaxDynamicSharedMemorySize) and without it.
M.ARCHS = {
  ['80'] = { name = 'A100', regs = 65536, max_regs = 255, smem_optin = 163 * 1024, smem_default = 48 * 1024 },
  ['86'] = { name = 'A10 / RTX 3090', regs = 65536, max_regs = 255, smem_optin = 99 * 1024, smem_default = 48 * 1024 },
  ['89'] = { name = 'L4 / L40S / RTX 4090', regs = 65536, max_regs = 255, smem_optin = 99 * 1024, smem_default = 48 * 1024 },
  ['90'] = { name = 'H100 / H200', regs = 65536, max_regs = 255, smem_optin = 227 * 1024, smem_default = 48 * 1024 },
}
-- registers are handed to warps in units of 256 (every arch above)
M.REG_UNIT = 256

-- Launch sites whose block size is not a constant: the largest it can be,
-- and why.  Keyed by the kernel's name (a template's, without arguments).
M.BLOCK_BOUNDS = {}   -- (none today: the row kernels declare __launch_bounds__(CU_ROW_MAX_THREADS))

-- Launch sites whose dynamic shared memory depends on the sizes: the bound
-- the launcher enforces before it launches ('optin': the device's opt-in
-- limit, so the kernel falls back where it would not fit; or a constant
-- expression of the sources' enums), and the guard's text in the source.
M.SMEM_BOUNDS = {
  flash_fwd_kernel = { 'optin', 'if ((size_t)cu_smem_optin(dev) < smem) return false;' },
  flash_bwd_kernel = { 'optin', 'if ((size_t)cu_smem_optin(dev) < smem) return false;' },
  gemm_mma_kernel = { 'optin', 'if ((size_t)cu_smem_optin(out->device) < smem) return 1;' },
  attn_fwd_fallback_kernel = { 'CU_SHARED_DYNAMIC_MAX', 'if (sm > CU_SHARED_DYNAMIC_MAX) return gl_error' },
  attn_dq_fallback_kernel = { 'CU_SHARED_DYNAMIC_MAX', 'if (s2 > CU_SHARED_DYNAMIC_MAX) return gl_error' },
  attn_dkdv_fallback_kernel = { 'CU_SHARED_DYNAMIC_MAX', 'if (s2 > CU_SHARED_DYNAMIC_MAX) return gl_error' },
  add_norm_forward_kernel = { 'ADD_NORM_MAX_SHARED', 'if (C * (wide ? 8 : 4) > ADD_NORM_MAX_SHARED)' },
}

-- ------------------------------------------------------------------ helpers
local function fail(msg) io.stderr:write('cuda_resources: ', msg, '\n'); os.exit(2) end

local function read(path)
  local f, err = io.open(path, 'rb')
  if not f then fail(err) end
  local s = f:read('*a')
  f:close()
  return s
end

local function sh_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- whether a shell command exits 0 (os.execute: a status under LuaJIT, true under 5.2+)
local function succeeds(cmd)
  local r = os.execute(cmd)
  return r == true or r == 0
end

-- the source without its comments (strings in kernels hold no comment marks)
local function strip_comments(s)
  s = s:gsub('/%*.-%*/', function(c) return (c:gsub('[^\n]', ' ')) end)
  return (s:gsub('//[^\n]*', ''))
end

local function squeeze(s) return (s:gsub('%s+', ' ')) end

-- ------------------------------------------------------------------ compile
-- ptxas -v of SRC for every ARCH into OUT ("== sm_XX" then ptxas's lines).
-- The front end runs once per distinct PTX: the PTX of compute_80, 86 and
-- 89 differ only in their .target line (the toolkit's headers branch on
-- __CUDA_ARCH__ only from 900, for bf16 conversions), so 86 and 89 take
-- 80's with the target rewritten; 90 gets its own.  Costs about half of a
-- full compile for the four archs.
local function ptx_arch(a) return tonumber(a) >= 90 and a or '80' end

function M.compile(src, out, archs)
  local nvcc = os.getenv('NVCC') or 'nvcc'
  local ptxas = nvcc:gsub('nvcc$', 'ptxas')
  local flags = os.getenv('CUDA_RES_FLAGS') or ''
  local tmp = out .. '.tmp'
  local parts, ptx = {}, {}
  for _, a in ipairs(archs) do
    local p = ptx_arch(a)
    if not ptx[p] then
      ptx[p] = ('%s.compute_%s.ptx'):format(tmp, p)
      local cmd = ('%s %s -arch=compute_%s -ptx %s -o %s'):format(nvcc, flags, p, sh_quote(src), sh_quote(ptx[p]))
      if not succeeds(cmd) then fail('front end failed: ' .. cmd) end
    end
    local target = ptx[p]
    if p ~= a then  -- the same PTX, targeted at this arch
      target = ('%s.sm_%s.ptx'):format(tmp, a)
      local s = read(ptx[p]):gsub('\n%.target sm_%d+', '\n.target sm_' .. a, 1)
      local f = assert(io.open(target, 'wb')); f:write(s); f:close()
    end
    local log = ('%s.sm_%s.txt'):format(tmp, a)
    local cmd = ('%s -arch=sm_%s -O3 -v %s -o /dev/null > %s 2>&1'):format(ptxas, a, sh_quote(target), sh_quote(log))
    local ok = succeeds(cmd)
    local text = read(log)
    os.remove(log)
    if target ~= ptx[p] then os.remove(target) end
    if not ok then io.stderr:write(text); fail('ptxas failed: ' .. cmd) end
    parts[#parts + 1] = '== sm_' .. a .. '\n' .. text
  end
  for _, f in pairs(ptx) do os.remove(f) end
  local f = assert(io.open(tmp, 'wb'))
  f:write('source ', src, '\n', table.concat(parts))
  f:close()
  assert(os.rename(tmp, out))
end

-- ------------------------------------------------------------------ reading
-- every kernel entry of a resource file: { arch, mangled, regs, smem (static), stack }
function M.parse_ptxas(text)
  local src = text:match('^source (%S+)')
  local entries, arch, cur = {}, nil, nil
  for line in text:gmatch('[^\n]+') do
    local a = line:match('^== sm_(%d+)')
    if a then arch = a end
    local name = line:match("Compiling entry function '([^']+)'")
    if name then
      cur = { arch = arch, mangled = name, regs = 0, smem = 0, stack = 0 }
      entries[#entries + 1] = cur
    end
    if cur then
      local regs = line:match('Used (%d+) registers')
      if regs then
        cur.regs = tonumber(regs)
        cur.smem = tonumber(line:match('(%d+) bytes smem')) or 0
        cur.stack = tonumber(line:match('(%d+) bytes cumulative stack size')) or 0
        cur = nil
      end
    end
  end
  return entries, src
end

-- demangled names of mangled ones (one c++filt for all)
local function demangle(names)
  if #names == 0 then return {} end
  local tmp = os.tmpname()
  local f = assert(io.open(tmp, 'wb'))
  f:write(table.concat(names, '\n'), '\n')
  f:close()
  local p = assert(io.popen('c++filt < ' .. sh_quote(tmp)))
  local out = {}
  for line in p:lines() do out[#out + 1] = line end
  p:close()
  os.remove(tmp)
  local res = {}
  for i, n in ipairs(names) do res[n] = out[i] or n end
  return res
end

-- a kernel's name without its return type, template arguments and parameters
function M.base_name(demangled)
  local s = demangled:gsub('^void%s+', '')
  return s:match('^([%w_]+)')
end

-- enum constants of the sources (NAME = integer expression), in order
function M.constants(texts)
  local env = {}
  for _, text in ipairs(texts) do
    for body in strip_comments(text):gmatch('enum%s*[%w_]*%s*{(.-)}') do
      for item in (body .. ','):gmatch('([^,]+),') do
        local k, e = item:match('^%s*([%w_]+)%s*=%s*(.-)%s*$')
        if k then env[k] = M.eval(e, env) end
      end
    end
  end
  return env
end

-- a C integer expression of literals and known constants, or nil
function M.eval(expr, env)
  local e = expr:gsub('%(%s*[%w_]+%s*%)%s*(%w)', '%1')     -- casts: (size_t)C, (int)x
  e = e:gsub('sizeof%s*%(%s*float%s*%)', '4'):gsub('sizeof%s*%(%s*double%s*%)', '8')
  e = e:gsub('(%d+)[uUlL]+', '%1')
  local unknown = false
  e = e:gsub('[%a_][%w_]*', function(id)
    if env[id] then return tostring(env[id]) end
    unknown = true
  end)
  if unknown then return nil end
  e = e:gsub('(%d+)%s*<<%s*(%d+)', function(a, b) return tostring(tonumber(a) * 2 ^ tonumber(b)) end)
  if e:find('[^%d%s%+%-%*/%%%(%)%.]') then return nil end
  local f = loadstring('return ' .. e)
  if not f then return nil end
  local ok, v = pcall(f)
  return ok and type(v) == 'number' and math.floor(v) or nil
end

-- splits a macro's argument list at its top-level commas
local function split_args(s)
  local args, depth, start = {}, 0, 1
  for i = 1, #s do
    local c = s:sub(i, i)
    if c == '(' or c == '[' or c == '{' then depth = depth + 1
    elseif c == ')' or c == ']' or c == '}' then depth = depth - 1
    elseif c == ',' and depth == 0 then
      args[#args + 1] = s:sub(start, i - 1)
      start = i + 1
    end
  end
  args[#args + 1] = s:sub(start)
  for i, a in ipairs(args) do args[i] = squeeze(a):match('^%s*(.-)%s*$') end
  return args
end

-- Kernels and launch sites of one source: kernels[name] = { bounds =
-- __launch_bounds__ expression or nil, optin = opts in to more shared
-- memory }, sites = { { kernel, block, smem, line } }
function M.scan_source(text)
  local code = strip_comments(text)
  local kernels, sites = {}, {}
  for name in code:gmatch('__global__%s+void%s+([%w_]+)%s*%(') do
    if name ~= '__launch_bounds__' then kernels[name] = {} end
  end
  for lb, name in code:gmatch('__global__%s+void%s+__launch_bounds__%s*(%b())%s*([%w_]+)%s*%(') do
    kernels[name] = { bounds = split_args(lb:sub(2, -2))[1] }  -- (max threads[, min blocks])
  end
  local pos = 1
  while true do
    local s, e = code:find('GL_LAUNCH%s*%(', pos)
    if not s then break end
    local body = code:match('%b()', e)
    local line = select(2, code:sub(1, s):gsub('\n', '')) + 1
    local args = split_args(body:sub(2, -2))
    if #args >= 5 and not code:sub(1, s - 1):match('#define%s*$') then
      local kernel = table.concat(args, ', ', 5)
      sites[#sites + 1] = { kernel = kernel:match('^([%w_]+)'), block = args[2], smem = args[3], line = line }
    end
    pos = e + #body
  end
  for name, k in pairs(kernels) do
    k.optin = code:find('cudaFuncSetAttribute%s*%(%s*' .. name .. '[%s<,]') ~= nil
  end
  return kernels, sites, squeeze(code)
end

-- ------------------------------------------------------------------ check
-- registers a block of `threads` holds: warps x registers per warp, rounded
-- up to the allocation unit
function M.block_registers(regs, threads)
  local warps = math.ceil(threads / 32)
  return warps * math.ceil(regs * 32 / M.REG_UNIT) * M.REG_UNIT
end

-- Checks resource files (their sources read beside them); returns the
-- failures (strings), the rows checked and a per-arch summary.
function M.check(files)
  local headers, sources, per_source = {}, {}, {}
  local dirs = {}
  for _, path in ipairs(files) do
    local entries, src = M.parse_ptxas(read(path))
    if not src then fail(path .. ': not a resource file (no source line)') end
    per_source[#per_source + 1] = { src = src, entries = entries, text = read(src), file = path }
    sources[#sources + 1] = per_source[#per_source].text
    local dir = src:match('^(.*)/[^/]+$') or '.'
    if not dirs[dir] then  -- the headers beside the sources (their constants come first)
      dirs[dir] = true
      local p = io.popen('ls ' .. sh_quote(dir) .. ' 2>/dev/null')
      for f in p:lines() do if f:match('%.cuh$') then headers[#headers + 1] = read(dir .. '/' .. f) end end
      p:close()
    end
  end
  for _, t in ipairs(sources) do headers[#headers + 1] = t end
  local env = M.constants(headers)
  local failures, rows, archs_seen = {}, 0, {}
  local closest = {}  -- per arch: the kernel whose block holds the most registers
  local function bad(fmt, ...) failures[#failures + 1] = fmt:format(...) end
  for _, ps in ipairs(per_source) do
    local kernels, sites, flat = M.scan_source(ps.text)
    local mangled = {}
    for _, e in ipairs(ps.entries) do mangled[#mangled + 1] = e.mangled end
    local names = demangle(mangled)
    -- per kernel name: the largest block and dynamic shared memory any site asks
    local launch = {}
    for _, st in ipairs(sites) do
      local k = kernels[st.kernel]
      local where = ('%s:%d'):format(ps.src, st.line)
      local L = launch[st.kernel] or { block = 0, smem = 0, where = where }
      launch[st.kernel] = L
      local b = M.eval(st.block, env)
      if not b and k and k.bounds then b = M.eval(k.bounds, env) end  -- a launch above it fails: trusted
      if not b and M.BLOCK_BOUNDS[st.kernel] then b = M.BLOCK_BOUNDS[st.kernel][1] end
      if not b then
        bad('%s: %s: cannot bound the block size "%s": give the kernel __launch_bounds__ or add it to BLOCK_BOUNDS in recipes/tools/cuda_resources.lua',
            where, st.kernel, st.block)
      else L.block = math.max(L.block, b) end
      local sm = M.eval(st.smem, env)
      if not sm then
        local g = M.SMEM_BOUNDS[st.kernel]
        if not g then
          bad('%s: %s: cannot bound the dynamic shared memory "%s": add its launcher\'s guard to SMEM_BOUNDS in recipes/tools/cuda_resources.lua',
              where, st.kernel, st.smem)
        elseif not flat:find(squeeze(g[2]), 1, true) then
          bad('%s: %s: the guard that bounds its dynamic shared memory is gone from %s: %s', where, st.kernel, ps.src, g[2])
        elseif g[1] == 'optin' then L.optin_guard = true
        else
          sm = M.eval(g[1], env)
          if not sm then bad('%s: %s: cannot evaluate the bound %s', where, st.kernel, g[1]) end
        end
      end
      if sm then L.smem = math.max(L.smem, sm) end
    end
    for _, e in ipairs(ps.entries) do
      local full = names[e.mangled]:gsub('^void%s+', '')
      local name = M.base_name(full)
      local A = M.ARCHS[e.arch]
      if not A then fail(('%s: no limits for sm_%s in ARCHS'):format(ps.file, tostring(e.arch))) end
      archs_seen[e.arch] = true
      rows = rows + 1
      local k, L = kernels[name], launch[name]
      local what = ('sm_%s %s'):format(e.arch, full)
      if not L then
        if k and k.bounds then
          L = { block = M.eval(k.bounds, env) or 1024, smem = 0 }
        else
          bad('%s: no launch site of %s in %s (GL_LAUNCH)', what, name, ps.src)
          L = { block = 1024, smem = 0 }
        end
      end
      local threads = L.block
      if k and k.bounds then
        local lb = M.eval(k.bounds, env)
        if lb and threads > lb then
          bad('%s: launched with up to %d threads, above its __launch_bounds__(%d) (%s)', what, threads, lb, L.where)
        end
      end
      if threads > 1024 then bad('%s: %d threads per block, the most is 1024 (%s)', what, threads, L.where) end
      if e.regs > A.max_regs then bad('%s: %d registers per thread, the most is %d', what, e.regs, A.max_regs) end
      local br = M.block_registers(e.regs, threads)
      local c = closest[e.arch] or {}
      closest[e.arch] = c
      if not c.regs or br > c.regs.n then
        c.regs = { n = br, what = ('%s (%d registers x %d threads)'):format(M.base_name(full), e.regs, threads) }
      end
      if br > A.regs then
        bad('%s: %d registers x %d threads = %d registers per block, sm_%s has %d (%s)', what, e.regs, threads, br,
            e.arch, A.regs, L.where or '')
      end
      if L.optin_guard then
        if e.smem > 0 then
          bad('%s: %d bytes of static shared memory, which its launcher\'s opt-in guard does not count', what, e.smem)
        end
      else
        local limit = (k and k.optin) and A.smem_optin or A.smem_default
        if e.smem + L.smem > limit then
          bad('%s: %d bytes of static + %d of dynamic shared memory, sm_%s allows %d per block%s (%s)', what, e.smem,
              L.smem, e.arch, limit, (k and k.optin) and '' or ' without the opt-in', L.where or '')
        end
      end
    end
  end
  local list, notes = {}, {}
  for a in pairs(archs_seen) do list[#list + 1] = a end
  table.sort(list)
  for i, a in ipairs(list) do
    local c = closest[a]
    if c and c.regs then
      notes[#notes + 1] = ('sm_%s: most registers per block %d of %d, %s'):format(a, c.regs.n, M.ARCHS[a].regs, c.regs.what)
    end
    list[i] = 'sm_' .. a
  end
  return failures, rows, list, notes
end

function M.main(argv)
  local cmd = argv[1]
  if cmd == 'compile' then
    if #argv < 4 then fail('usage: compile SRC OUT ARCH...') end
    local archs = {}
    for i = 4, #argv do archs[#archs + 1] = argv[i] end
    M.compile(argv[2], argv[3], archs)
  elseif cmd == 'check' then
    local files = {}
    for i = 2, #argv do files[#files + 1] = argv[i] end
    if #files == 0 then fail('usage: check RESOURCE_FILE...') end
    local failures, rows, archs, notes = M.check(files)
    for _, f in ipairs(failures) do print('does not fit: ' .. f) end
    for _, n in ipairs(notes) do print(n) end
    print(('cuda-resources: %d kernel instances x archs checked (%s) in %d sources: %s'):format(rows,
      table.concat(archs, ' '), #files, #failures == 0 and 'every one fits' or (#failures .. ' problems')))
    if #failures > 0 then os.exit(1) end
  else
    fail("expected 'compile' or 'check', got " .. tostring(cmd))
  end
end

if arg and arg[0] and arg[0]:match('cuda_resources%.lua$') then M.main(arg) end
return M
