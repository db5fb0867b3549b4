-- `gptlua plot` (gptlua.observe.plot): the PNG it writes is decoded here
-- — signature, IHDR, the IDAT stream inflated by zlib (libz.so.1, part of
-- every Debian system), the scanline filters undone — and its pixels
-- counted: not blank, and one colour per run (gnuplot's line colours 1 and
-- 2), so several runs are really overlaid.  Bad input gets one line.
local ffi = require 'ffi'
local bit = require 'bit'
local H = require 'support.mpi'   -- sh: run a command from the root within a time limit
local EXE = H.EXE

local function tmpdir() local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d); return d end
local function write(path, s) local f = assert(io.open(path, 'wb')); f:write(s); f:close() end

-- ------------------------------------------------------------ PNG reader
if not pcall(ffi.typeof, 'struct gl_spec_z') then
  ffi.cdef [[ struct gl_spec_z { int unused; };
              int uncompress(uint8_t *dest, unsigned long *destLen, const uint8_t *source, unsigned long sourceLen); ]]
end
local zlib = ffi.load('libz.so.1')

local function be32(s, i) return ((s:byte(i) * 256 + s:byte(i + 1)) * 256 + s:byte(i + 2)) * 256 + s:byte(i + 3) end

-- {width, height, channels, px = function(x, y) -> r, g, b}
local function read_png(path)
  local f = assert(io.open(path, 'rb'))
  local s = f:read('*a')
  f:close()
  assert.equal('\137PNG\r\n\26\n', s:sub(1, 8))
  local i, idat, ihdr = 9, {}, nil
  while i <= #s do
    local len, kind = be32(s, i), s:sub(i + 4, i + 7)
    local data = s:sub(i + 8, i + 7 + len)
    if kind == 'IHDR' then ihdr = data elseif kind == 'IDAT' then idat[#idat + 1] = data end
    i = i + 12 + len
    if kind == 'IEND' then break end
  end
  assert.truthy(ihdr, 'no IHDR')
  local w, h, depth, ctype, interlace = be32(ihdr, 1), be32(ihdr, 5), ihdr:byte(9), ihdr:byte(10), ihdr:byte(13)
  assert.equal(8, depth)
  assert.equal(0, interlace)
  local ch = ({ [2] = 3, [6] = 4 })[ctype]
  assert.truthy(ch, 'colour type ' .. ctype)
  local z = table.concat(idat)
  local stride = w * ch
  local raw = ffi.new('uint8_t[?]', h * (stride + 1))
  local n = ffi.new('unsigned long[1]', h * (stride + 1))
  assert.equal(0, zlib.uncompress(raw, n, z, #z))
  assert.equal(h * (stride + 1), tonumber(n[0]))
  local img = ffi.new('uint8_t[?]', h * stride)
  for y = 0, h - 1 do  -- undo the filters (PNG spec, section 9)
    local ft = raw[y * (stride + 1)]
    local src, row, prev = raw + y * (stride + 1) + 1, img + y * stride, y > 0 and img + (y - 1) * stride or nil
    for x = 0, stride - 1 do
      local a = x >= ch and row[x - ch] or 0
      local b = prev and prev[x] or 0
      local c = (prev and x >= ch) and prev[x - ch] or 0
      local pred
      if ft == 0 then pred = 0 elseif ft == 1 then pred = a elseif ft == 2 then pred = b
      elseif ft == 3 then pred = math.floor((a + b) / 2)
      elseif ft == 4 then
        local p = a + b - c
        local pa, pb, pc = math.abs(p - a), math.abs(p - b), math.abs(p - c)
        pred = (pa <= pb and pa <= pc) and a or (pb <= pc and b or c)
      else error('bad filter ' .. ft) end
      row[x] = bit.band(src[x] + pred, 255)
    end
  end
  return { width = w, height = h, px = function(x, y)
    local o = y * stride + x * ch
    return img[o], img[o + 1], img[o + 2]
  end }
end

-- fraction of non-white pixels, and pixels near each of gnuplot's first
-- two line colours (148,0,211) and (0,158,115)
local function stats(png)
  local dark, c1, c2 = 0, 0, 0
  for y = 0, png.height - 1 do
    for x = 0, png.width - 1 do
      local r, g, b = png.px(x, y)
      if r < 250 or g < 250 or b < 250 then dark = dark + 1 end
      if math.abs(r - 148) + g + math.abs(b - 211) < 60 then c1 = c1 + 1 end
      if r + math.abs(g - 158) + math.abs(b - 115) < 60 then c2 = c2 + 1 end
    end
  end
  return dark / (png.width * png.height), c1, c2
end

-- metrics.jsonl of a run of `steps` steps (loss falling at `rate`), with
-- the fields another writer may add (timestamp, run id), an eval every 10
-- steps, one skipped step and one non-finite loss
local function fake_run(dir, steps, rate)
  os.execute('mkdir -p ' .. dir)
  local lines = {}
  for s = 1, steps do
    if s % 10 == 0 then
      lines[#lines + 1] = ('{"step":%d,"eval":true,"train_loss":%g,"val_loss":%g,"timestamp":%d,"run":"r"}'):format(
        s, 4 * math.exp(-rate * s), 4.1 * math.exp(-rate * s), 1700000000 + s)
    end
    if s == 7 then lines[#lines + 1] = '{"step":7,"skipped":true,"loss":"nan"}'
    else
      lines[#lines + 1] = ('{"step":%d,"loss":%s,"lr":%g,"grad_norm":%g,"tokens_per_sec":%g,"mfu":0.3,"ms_per_step":%g,"timestamp":%d}')
        :format(s, s == 12 and '"inf"' or ('%g'):format(4 * math.exp(-rate * s)), 1e-3 * math.min(1, s / 5),
          1 + 0.5 * math.sin(s), 5000 + 100 * math.cos(s), 1000 * 512 / (5000 + 100 * math.cos(s)), 1700000000 + s)
    end
  end
  write(dir .. '/metrics.jsonl', table.concat(lines, '\n') .. '\n')
end

describe('gptlua plot', function()
  local d = tmpdir()
  fake_run(d .. '/a', 60, 0.02)
  fake_run(d .. '/b', 40, 0.05)

  it('writes a PNG of six panels with every run overlaid in its own colour', function()
    local out, rc = H.sh(('%s plot %s/a %s/b --out=%s/cmp.png --size=900x700'):format(EXE, d, d, d), 60)
    assert.equal(0, rc, out)
    assert.truthy(out:find('plot: wrote ' .. d .. '/cmp.png', 1, true), out)
    local png = read_png(d .. '/cmp.png')
    assert.equal(900, png.width)
    assert.equal(700, png.height)
    local dark, c1, c2 = stats(png)
    assert.is_true(dark > 0.02 and dark < 0.6, 'non-white fraction ' .. dark)
    assert.is_true(c1 > 500, 'pixels of run a: ' .. c1)
    assert.is_true(c2 > 500, 'pixels of run b: ' .. c2)
    assert.is_nil(io.open(d .. '/cmp.png.tmp'))
  end)

  it('draws losses on a log scale, a one-point run as a point, and marks resumes and live changes', function()
    local plot = require 'gptlua.observe.plot'
    os.execute(('mkdir -p %s/one %s/marked'):format(d, d))
    write(d .. '/one/metrics.jsonl', '{"step":1,"loss":4.2,"lr":0.001}\n')
    write(d .. '/marked/metrics.jsonl', table.concat({
      '{"step":1,"loss":4.2}', '{"step":2,"loss":3.1}',
      '{"step":2,"event":"control","command":"set{ matrix_lr = 0.01 }","ok":true}',
      '{"step":2,"event":"control","command":"pause()","ok":true}',
      '{"step":3,"resumed":true,"from":"x"}', '{"step":3,"loss":2.9}', '{"step":4,"loss":2.5}' }, '\n') .. '\n')
    local runs = { plot.read_run(d .. '/one'), plot.read_run(d .. '/marked') }
    local script = plot.script(runs, d)
    local loss_panel = script:find("set title 'loss vs steps'", 1, true)
    assert.truthy(script:find('set logscale y', loss_panel, true), script)
    assert.truthy(script:find("run1_train.dat' using 1:3 with points", 1, true), script)
    assert.truthy(script:find("run2_train.dat' using 1:3 with lines", 1, true), script)
    assert.truthy(script:find('set arrow 1 from 2, graph 0 to 2, graph 1 nohead dt 3 lc 2', 1, true), script)
    assert.truthy(script:find("set label 1 'set' at 2,", 1, true), script)
    assert.truthy(script:find("set label 2 'resumed' at 3,", 1, true), script)
    assert.is_nil(script:find('set arrow 3', 1, true), script)   -- pause() changes nothing
    local out, rc = H.sh(('%s plot %s/one %s/marked --out=%s/m.png'):format(EXE, d, d, d), 60)
    assert.equal(0, rc, out)
  end)

  it('plots one run into its directory by default, in one colour, and prints a text plot when asked', function()
    local out, rc = H.sh(('%s plot %s/a --terminal'):format(EXE, d), 60)
    assert.equal(0, rc, out)
    assert.truthy(out:find('plot: wrote ' .. d .. '/a/plot.png', 1, true), out)
    assert.truthy(out:find('loss', 1, true) and out:find('a train', 1, true), out)
    local png = read_png(d .. '/a/plot.png')
    assert.equal(1200, png.width)
    assert.equal(900, png.height)
    local _, c1, c2 = stats(png)
    assert.is_true(c1 > 500, 'pixels of run a: ' .. c1)
    assert.equal(0, c2)
  end)

  it('refuses a missing run, a broken record and a non-PNG output with one line', function()
    local cases = {
      { d .. '/none', 'plot: ' .. d .. '/none has no metrics.jsonl (expected a run directory or a metrics.jsonl file)' },
      { d .. '/bad', 'plot: ' .. d .. '/bad/metrics.jsonl:2: expected a JSON record, got "{\\"step\\":2,"' },
      { d .. '/a --out=' .. d .. '/x.jpg', 'plot: --out expected a .png file, got ' .. d .. '/x.jpg' },
      { d .. '/a --size=5x5', 'plot: --size expected WxH in pixels (200x150 to 10000x10000), got 5x5' },
      { '', 'plot: expected at least one run directory' },
    }
    os.execute('mkdir -p ' .. d .. '/bad')
    write(d .. '/bad/metrics.jsonl', '{"step":1,"loss":3}\n{"step":2,\n')
    for _, c in ipairs(cases) do
      local out, rc = H.sh(('%s plot %s'):format(EXE, c[1]), 60)
      assert.equal(1, rc, out)
      assert.equal(c[2], (out:match('^[^\n]*')), out)
      assert.falsy(out:find('traceback', 1, true), out)
    end
    assert.is_nil(io.open(d .. '/x.jpg'))
  end)
end)
