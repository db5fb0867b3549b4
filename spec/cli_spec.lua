-- The gptlua executable: options, scripts, errors, and the REPL over a pipe.
local root = GPTLUA.root
local exe = GPTLUA.exe  -- specs run from the tree root (run() cds there)

local function run(cmd, stdin)
  local inp = os.tmpname()
  local f = io.open(inp, 'w'); f:write(stdin or ''); f:close()
  local out, err = os.tmpname(), os.tmpname()
  local ok, _, code = os.execute(('cd %s && %s < %s > %s 2> %s'):format(root, cmd, inp, out, err))
  local function slurp(p) local h = io.open(p); local s = h:read('*a'); h:close(); os.remove(p); return s end
  os.remove(inp)
  local status = type(ok) == 'number' and ok / 256 or code
  return slurp(out), slurp(err), status
end

describe('gptlua executable', function()
  it('prints its version and help', function()
    local out, _, st = run(exe .. ' -V')
    assert.equal(0, st)
    assert.truthy(out:match('^gptlua %d+%.%d+%.%d+'))
    out = run(exe .. ' --help')
    assert.truthy(out:find('usage: gptlua', 1, true))
    assert.truthy(out:find('examples:', 1, true))
  end)
  it('runs -e code and scripts with arg set as lua does', function()
    local out = run(exe .. [[ -e 'print(1 + 1)']])
    assert.equal('2\n', out)
    local script = os.tmpname()
    local f = io.open(script, 'w'); f:write('print(arg[0] ~= nil, arg[1], arg[2], select("#", ...))'); f:close()
    out = run(exe .. ' ' .. script .. ' a b')
    assert.equal('true\ta\tb\t2\n', out)
    os.remove(script)
  end)
  it('reports a script error as file:line: message with a traceback and exits 1', function()
    local script = os.tmpname() .. '.lua'
    local f = io.open(script, 'w'); f:write('local x = 1\nerror("boom")\n'); f:close()
    local _, err, st = run(exe .. ' ' .. script)
    assert.equal(1, st)
    assert.truthy(err:find(script .. ':2: boom', 1, true))
    assert.truthy(err:find('stack traceback', 1, true))
    os.remove(script)
  end)
  it('turns engine errors into Lua errors at the caller line', function()
    local _, err, st = run(exe .. [[ -e 'local gl = require "gptlua"
local t = gl.zeros({2, 3})
local v = t:view(4, 4)']])
    assert.equal(1, st)
    assert.truthy(err:find('(command line):3: view: shape {4,4} has 16 elements, tensor has 6', 1, true))
  end)
  it('reports the BLAS library and the kernels it runs', function()
    local out = run('OPENBLAS_CORETYPE=Haswell ' .. exe .. [[ -e 'print(require("gptlua").blas_info())']])
    assert.truthy(out:match('^OpenBLAS [%d.]+ .*%(Haswell kernels%)'), out)
  end)
  it('reports a user error in one line without a traceback, and with one under -v', function()
    for _, c in ipairs({
      { ' recipes/shakespeare.lua --lerning_rate=1', 'config: unknown key --lerning_rate (did you mean --learning_rate?)\n' },
      { ' recipes/shakespeare.lua --max_iters abc', 'config: --max_iters expects a finite number, got "abc"\n' },
      { ' recipes/shakespeare.lua --lr=1e-3', 'config: unknown key --lr (did you mean --learning_rate?)\n' },
      { ' recipes/shakespeare.lua --warmup_steps=5', 'config: unknown key --warmup_steps (did you mean --warmup_iters?)\n' },
      { ' recipes/shakespeare.lua --device=gpu',
        "config: device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu' (did you mean --device=cuda?)\n" },
      { ' recipes/shakespeare.lua --device=cuda:0', 'config: device cuda:0 requested but no CUDA device is available (use --device=cpu)\n' },
      { ' recipes/shakespeare.lua --data_path=/nonexistent.txt --max_iters=1',
        'config: data_path /nonexistent.txt not found (expected a file)\n' },
      { ' /nonexistent.lua', 'gptlua: cannot open /nonexistent.lua' },
      { ' recipes/prepare.lua --inptu=x', 'prepare: unknown key --inptu (did you mean --input?)\n' },
      { ' recipes/prepare.lua --val-fractoin=x', 'prepare: unknown key --val-fractoin (did you mean --val-fraction?)\n' },
      { ' recipes/prepare.lua --val-fraction=x', 'prepare: --val-fraction expects a finite number, got "x"\n' },
      { ' recipes/sample.lua --temprature 1', 'sample: unknown key --temprature (did you mean --temperature?)\n' },
    }) do
      if not (c[1]:find('cuda') and require('gptlua').cuda_available()) then
        local _, err, st = run(exe .. c[1])
        assert.equal(1, st, c[1])
        assert.equal(1, select(2, err:gsub('\n', '')), c[1] .. ': ' .. err)
        assert.equal(1, err:find(c[2], 1, true), c[1] .. ': ' .. err)
      end
    end
    local _, err, st = run(exe .. ' -v recipes/shakespeare.lua --lerning_rate=1')
    assert.equal(1, st)
    assert.truthy(err:find('did you mean --learning_rate?)\nstack traceback:', 1, true), err)
    assert.truthy(err:find('config.lua:%d+: in function'), err)
    -- a bug (an error with a position in the library) keeps its traceback
    _, err, st = run(exe .. [[ -e 'require("gptlua.config").merge(5)']])
    assert.equal(1, st)
    assert.truthy(err:find('stack traceback', 1, true), err)
  end)
  -- each a process of its own: one line on stderr naming the key and what
  -- it expects, exit 1, never a traceback
  it('refuses bad values of the data keys and bad recipes in one line naming the key', function()
    local tmp = os.tmpname()
    os.remove(tmp)
    os.execute('mkdir -p ' .. tmp)
    local function recipe(name, text)
      local f = io.open(tmp .. '/' .. name, 'w'); f:write(text); f:close()
      return tmp .. '/' .. name
    end
    local wrong_type = recipe('wrong_type.lua', 'return { batch_size = { 1, 2 } }\n')
    local error_table = recipe('error_table.lua', 'local x = 1\nerror({})\n')
    local hook_error = recipe('hook_error.lua', 'return { max_iters = 1, build_model = function() error({ 1 }) end }\n')
    local short = ' --max_iters=1 --eval_interval=0 --sample_length=0 --n_layer=1 --device=cpu --out_dir=' .. tmp
    for _, c in ipairs({
      { ' recipes/shakespeare.lua --val_fraction=-0.5' .. short, 'config: val_fraction must be in [0, 1), got -0.5\n' },
      { ' recipes/shakespeare.lua --data_path=/tmp' .. short, 'config: data_path /tmp is a directory, expected a file\n' },
      { ' recipes/shakespeare.lua --data=shards --data_dir=/nonexistent' .. short,
        'config: data_dir /nonexistent not found (expected a directory)\n' },
      { ' recipes/shakespeare.lua --data=shards --data_dir=recipes/shakespeare.lua' .. short,
        'config: data_dir recipes/shakespeare.lua is a file, expected a directory\n' },
      { ' recipes/shakespeare.lua --vocab_size=10' .. short,
        "gl_loader_add_tokens: tokens[1] = 18, expected in [0, 10) (the vocab_size the loader was given: the model's)\n" },
      { ' ' .. wrong_type .. ' --device=cpu', 'config: batch_size must be a number, got a table\n' },
      { ' ' .. error_table, error_table .. ':2: error raised with a table instead of a message (error() takes a string)\n' },
      { ' ' .. hook_error .. short, hook_error .. ':1: error raised with a table instead of a message (error() takes a string)\n' },
    }) do
      local _, err, st = run(exe .. c[1])
      assert.equal(1, st, c[1])
      assert.equal(c[2], err, c[1])
    end
    -- a thread count past the cores is capped, with a line saying so (OpenMP would start them all)
    local out, err, st = run(exe .. ' recipes/shakespeare.lua --threads=99999999' .. short)
    assert.equal(0, st, err)
    local cores = require('gptlua').num_cores()
    assert.truthy(out:find(('config: threads 99999999 is more than the %d cores of this machine: using %d\n')
      :format(cores, cores), 1, true), out)
    assert.truthy(out:find(('(%d threads)'):format(cores), 1, true), out)
    os.execute('rm -rf ' .. tmp)
  end)
  it('suggests the nearest key, or none when none is near', function()
    local config, train = require 'gptlua.config', require 'gptlua.train'
    for typed, want in pairs({ lerning_rate = 'learning_rate', max_iter = 'max_iters', batchsize = 'batch_size',
                               learning = 'learning_rate', ['fsdp.prefetc'] = 'fsdp.prefetch', nlayer = 'n_layer' }) do
      assert.equal(want, config.suggest(typed, train.defaults), typed)
    end
    assert.is_nil(config.suggest('zzz', train.defaults))
    local _, err = config.try_parse_args({ '--zzz=1' }, train.defaults)
    assert.equal('config: unknown key --zzz (gptlua RECIPE --help lists the keys)', err)
  end)
  it('takes --key value as --key=value, and a boolean flag alone or with a boolean word', function()
    local config, train = require 'gptlua.config', require 'gptlua.train'
    local o = config.parse_args({ '--max_iters', '5', '--bias', 'false', '--quiet', '--resume', '--min_lr', '-1',
                                  '--name', 'x y', '--fsdp.prefetch', 'no', '--decay_lr' }, train.defaults)
    assert.same({ max_iters = 5, bias = false, quiet = true, resume = true, min_lr = -1, name = 'x y',
                  fsdp = { prefetch = false }, decay_lr = true }, o)
    assert.same({ resume = 'step_0000010' }, config.parse_args({ '--resume', 'step_0000010' }, train.defaults))
    local _, err = config.try_parse_args({ '--max_iters', '--quiet' }, train.defaults)
    assert.equal('config: --max_iters needs a value (--max_iters=N)', err)
    _, err = config.try_parse_args({ '--quiet', 'maybe' }, train.defaults)
    assert.equal('config: cannot parse argument "maybe" (expected --key=value or --key value)', err)
    -- the same through the executable: trainer, prepare.lua, sample.lua
    local _, e2, st = run(exe .. ' recipes/shakespeare.lua --max_iters 0')
    assert.equal(1, st)
    assert.truthy(e2:find('config: max_iters must be an integer in [1,', 1, true), e2)
    _, e2, st = run(exe .. ' recipes/prepare.lua --input data/tinyshakespeare.txt --tokenizer char --vocab-size 0 --out x')
    assert.equal(1, st)
    assert.truthy(e2:find('prepare: --vocab-size must be an integer >= 1, got 0', 1, true), e2)
    _, e2, st = run(exe .. ' recipes/sample.lua --n abc')
    assert.equal(1, st)
    assert.truthy(e2:find('sample: --n expects a finite number, got "abc"', 1, true), e2)
    local o2, e3, st3 = run(exe .. ' --plan recipes/shakespeare.lua --world 2 --dist fsdp --margin 0.2')
    assert.equal(0, st3, e3)
    assert.truthy(o2:find('policy fsdp on 2 ranks', 1, true), o2)
    assert.truthy(o2:find('with a 20% margin', 1, true), o2)
  end)
  it('lists a recipe\'s keys with type, value and description for RECIPE --help', function()
    local out, err, st = run(exe .. ' recipes/shakespeare.lua --help')
    assert.equal(0, st, err)
    assert.truthy(out:find('^usage: gptlua recipes/shakespeare.lua'), out)
    assert.truthy(out:find("\n  %-%-learning_rate +number +0%.001 +optimizer 'adamw': the peak learning rate"), out)
    assert.truthy(out:find("\n  %-%-name +string +'shakespeare' +run name"), out)  -- the recipe's value
    assert.truthy(out:find('\n  %-%-fsdp%.prefetch +boolean +true'), out)
    for _, tool in ipairs({ 'prepare', 'sample' }) do
      out, err, st = run(exe .. ' recipes/' .. tool .. '.lua --help')
      assert.equal(0, st, err)
      assert.truthy(out:find('^usage: gptlua recipes/' .. tool .. '.lua'), out)
    end
  end)
  it('describes every trainer key in one line, and nothing else', function()
    local config, train, docs = require 'gptlua.config', require 'gptlua.train', require 'gptlua.config_keys'
    local seen = {}
    for _, k in ipairs(config.key_paths(train.defaults)) do
      assert.truthy(type(docs[k]) == 'string' and docs[k] ~= '' and not docs[k]:find('\n'), 'no description for ' .. k)
      seen[k] = true
    end
    for k in pairs(docs) do assert.truthy(seen[k], 'a description of no key: ' .. k) end
  end)
  it('runs a subcommand from its one-line entry in the table', function()
    local cli = require 'gptlua.cli'
    package.loaded['spec_fake_sub'] = { main = function(args) return 40 + #args end }
    cli.subcommands.fake = { module = 'spec_fake_sub', help = 'a spec\'s subcommand' }
    assert.equal(42, cli.main({ [0] = 'gptlua', 'fake', 'a', 'b' }))
    assert.truthy(cli.usage():find('gptlua fake +a spec\'s subcommand'))
    cli.subcommands.fake = nil
  end)
  it('rejects unknown options', function()
    local _, err, st = run(exe .. ' --bogus')
    assert.equal(1, st)
    assert.truthy(err:find('unknown option --bogus', 1, true))
  end)
  it('fails a script that returns neither a recipe, an exit status nor nothing, naming it and what it returned', function()
    for _, c in ipairs({ { 'return "oops"', "returned the string 'oops', expected a recipe" },
                         { 'return true', 'returned true, expected a recipe' },
                         { 'return false', 'returned false, expected a recipe' } }) do
      local script = os.tmpname() .. '.lua'
      local f = io.open(script, 'w'); f:write(c[1]); f:close()
      local _, err, st = run(exe .. ' ' .. script)
      assert.equal(1, st, c[1])
      assert.truthy(err:find('gptlua: ' .. script .. ' ' .. c[2], 1, true), err)
      os.remove(script)
    end
    local script = os.tmpname() .. '.lua'
    local f = io.open(script, 'w'); f:write('return 3'); f:close()
    local _, _, st = run(exe .. ' ' .. script)
    assert.equal(3, st)
    os.remove(script)
  end)
end)

describe('REPL over a pipe', function()
  it('prints expression values, keeps state, and pretty-prints tensors', function()
    local out, err, st = run(exe, 'x = 40\nx + 2\nlocal t = gl.ones({2, 2})\ngl.ones({2})\n')
    assert.equal(0, st, err)
    assert.truthy(out:find('42', 1, true))
    assert.truthy(out:find('tensor([1.0000, 1.0000])\n[float32 tensor of size 2]', 1, true), out)
  end)
  it('continues unfinished statements over several lines', function()
    local out = run(exe, 'function f(a)\n  return a * 2\nend\nf(21)\nfor i = 1, 2 do\nprint("i", i)\nend\n')
    assert.truthy(out:find('42', 1, true))
    assert.truthy(out:find('i\t2', 1, true))
  end)
  it('prints errors with a traceback, keeps going, and exits 1 when a statement failed', function()
    local out, err, st = run(exe, 'error("oops")\n1 + 1\n')
    assert.equal(1, st)
    assert.truthy(err:find('oops', 1, true))
    assert.truthy(out:find('2', 1, true))
    _, err, st = run(exe, 'x = \n')
    assert.equal(1, st)
    assert.truthy(err:find('unfinished statement', 1, true), err)
    _, err, st = run(exe, 'x = = 1\n2\n')
    assert.equal(1, st)
    assert.truthy(err:find("unexpected symbol near '='", 1, true), err)
    _, _, st = run(exe, 'x = 1\nx + 1\n')
    assert.equal(0, st)
  end)
  it('prints help: help(), ?f and f? (signature, doc, where), help(module)', function()
    local out, err, st = run(exe, '?gl.matmul\nx = gl.ones({2})\n?x:narrow\nhelp(gl.Tensor.add_)\nhelp()\n')
    assert.equal(0, st, err)
    assert.truthy(out:find('gl.matmul(a: tensor, b: tensor)\n', 1, true), out)
    assert.truthy(out:find('gl.matmul(a: tensor, b: tensor)\n  matmul(a, b): matrix product', 1, true), out)
    assert.truthy(out:find('defined at lua/gptlua/ops_math.lua:', 1, true), out)
    assert.truthy(out:find('Tensor:narrow(dim: integer, start: integer, length: integer)', 1, true), out)
    -- the comment block above the definition is the doc
    assert.truthy(out:find('Tensor:add_(b: scalar, alpha: number?)\n  in-place (no autograd)', 1, true), out)
    assert.truthy(out:find('Ctrl-C', 1, true) and out:find('gl: %d+ members'), out)
    -- a factory's function (exp) and one of a run of one-liners (ones) find their comment
    out = run(exe, '?gl.exp\n?gl.ones\n')
    assert.truthy(out:find('gl.exp(x: tensor)\n  differentiable unary op', 1, true), out)
    assert.truthy(out:find('gl.ones(shape: shape, opts: opts?)\n  zeros(shape, opts), ones(shape, opts)', 1, true), out)
    out = run(exe, 'help(require "gptlua.optim")\n')
    assert.truthy(out:find('^gptlua.optim'), out)  -- the module's opening comment
  end)
  it('finds a doc comment for every checked gl function and Tensor method', function()
    local gl, help = require 'gptlua', require 'gptlua.help'
    for kind, t in pairs({ ops = gl, methods = gl.Tensor }) do
      for name in pairs(gl.signatures[kind]) do
        if type(t[name]) == 'function' then
          assert.truthy(#help.doc(t[name]) > 0, ('%s %s has no comment above its definition'):format(kind, name))
        end
      end
    end
  end)
  it('lists a module by group, not 20 entries and ...', function()
    local out = run(exe, 'gl\n')
    local n = tonumber(out:match('^gl: (%d+) members'))
    assert.truthy(n and n > 60, out)
    assert.truthy(out:find('\n  creation +arange, full, ones'), out)
    assert.truthy(out:find('\n  matrix products +[%w_, ]*matmul'), out)
    assert.falsy(out:find('...', 1, true), out)
    for name in pairs(require('gptlua')) do  -- every member is listed
      assert.truthy(out:find('[ ,]' .. name .. '[,\n =]'), name)
    end
    -- a data table: sorted, one entry a line when long; nested ones say how many they left out
    out = run(exe, 't = {}\nfor i = 1, 30 do t["k" .. string.format("%02d", i)] = i end\nt\n{t}\n{1, "a", x = true}\n')
    assert.truthy(out:find('^{\n  k01 = 1,\n  k02 = 2,\n.*  k30 = 30\n}\n'), out)
    assert.truthy(out:find('\n{\n  {k01 = 1, k02 = 2, [^\n]*k20 = 20, %.%.%. %(10 more%)}\n}\n'), out)
    assert.truthy(out:find('\n{1, "a", x = true}\n', 1, true), out)
  end)
  it('enters the REPL after a script with -i, its globals in scope', function()
    local script = os.tmpname()
    local f = io.open(script, 'w'); f:write('answer = 6 * 7\n'); f:close()
    local out = run(exe .. ' -i ' .. script, 'answer\n')
    assert.truthy(out:find('42', 1, true))
    os.remove(script)
  end)
  it('shows the wall time of slow statements', function()
    local out = run(exe, 'require("gptlua.repl").time_threshold = 0\n1\n')
    assert.truthy(out:find('%(%d+%.%d+ s%)'))
  end)
end)

describe('README', function()
  -- a fresh user types the commands as shown: each make target exists, each
  -- script exists, each recipe key is one the trainer knows
  it('shows only commands that exist: make targets, scripts, gptlua options and recipe keys', function()
    local f = assert(io.open(root .. '/README.md')); local readme = f:read('*a'); f:close()
    f = assert(io.open(root .. '/Makefile')); local makefile = f:read('*a'); f:close()
    local config, train = require 'gptlua.config', require 'gptlua.train'
    local n = 0
    for line in readme:gmatch('[^\n]+') do
      local cmd = line:match('^    (make [^#]-)%s*$') or line:match('^    (make [^#]-)%s+#') or
                  line:match('^    (gptlua[^#]-)%s*$') or line:match('^    (gptlua[^#]-)%s+#')
      if cmd then
        n = n + 1
        local words = {}  -- split at spaces, "quoted text" kept whole
        for w in cmd:gsub('"([^"]*)"', function(q) return (q:gsub(' ', '\0')) end):gmatch('%S+') do
          words[#words + 1] = (w:gsub('%z', ' '))
        end
        if words[1] == 'make' then
          for i = 2, #words do
            if not words[i]:find('=', 1, true) then
              assert.truthy(makefile:find('\n' .. words[i]:gsub('%-', '%%-') .. ':'), 'no make target ' .. words[i])
            end
          end
        else
          local i = 2
          while words[i] and words[i]:sub(1, 1) == '-' do
            assert.truthy(({ ['-n'] = 1, ['-i'] = 0, ['--plan'] = 0, ['-e'] = 1 })[words[i]], cmd)
            i = i + 1 + (({ ['-n'] = 1, ['-e'] = 1 })[words[i]] or 0)
          end
          local script = words[i]
          if script and require('gptlua.cli').subcommands[script] then
            script = nil  -- a subcommand (gptlua plot ...), not a file
          end
          if script then
            assert.truthy(io.open(root .. '/' .. script), 'no script ' .. script)
            local args = { unpack(words, i + 1) }
            if script == 'recipes/shakespeare.lua' then
              local plan_only = cmd:find('--plan', 1, true)
              local keys = {}
              for _, a in ipairs(args) do if not (plan_only and a:match('^%-%-world')) then keys[#keys + 1] = a end end
              assert.truthy(config.try_parse_args(keys, train.defaults), cmd)
            elseif script == 'recipes/sample.lua' then
              local _, e2, st = run(exe .. ' ' .. script .. ' --help')
              assert.equal(0, st, e2)
            end
          end
        end
      end
    end
    assert.truthy(n >= 12, 'found ' .. n .. ' commands')
  end)
end)

describe('make install', function()
  it('installs a gptlua that finds its library and Lua tree without environment variables', function()
    local prefix = os.tmpname(); os.remove(prefix)
    local build = GPTLUA.libdir:match('([^/]+)$')
    local cuda = require('gptlua').lib.gl_cuda_built() == 1 and '' or 'CUDA=0'
    local out, err, st = run(('make -s install PREFIX=%s BUILD=%s ' .. cuda .. ' >/dev/null 2>&1 && env -i %s/bin/gptlua -e ' ..
      [['local gl = require "gptlua"; print(gl.version, gl.ones({2}):sum():item(), io.open(gl.root .. "/data/tinyshakespeare.txt") ~= nil)']]):format(
      prefix, build, prefix))
    assert.equal(0, st, err)
    assert.truthy(out:match('^%d+%.%d+%.%d+\t2\ttrue'), out .. err)
    os.execute('rm -rf ' .. prefix)
  end)
end)
