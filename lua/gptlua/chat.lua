-- gptlua.chat — conversations: the chat template (nanochat's special
-- tokens), `gptlua generate` and `gptlua chat`.
--
-- A conversation is {messages = {{role, content}, ...}}: an optional
-- 'system' message first, then 'user' and 'assistant' in turn, starting
-- with the user.  As tokens (nanochat's render_conversation):
--
--   <|bos|> <|user_start|> system + "\n\n" + user <|user_end|>
--           <|assistant_start|> assistant <|assistant_end|> <|user_start|> ...
--
-- and the mask that marks what a fine-tune learns: the assistant's tokens
-- and its <|assistant_end|>, nothing the user wrote.  A reply is generated
-- from the conversation so far plus <|assistant_start|> and ends at
-- <|assistant_end|> (or <|bos|>).
local gl = require 'gptlua'
local infer = require 'gptlua.infer'

local M = {}

local function fail(msg) error(msg, 0) end

-- the chat template's special tokens, in the order they are added to a tokenizer
M.SPECIALS = { '<|bos|>', '<|user_start|>', '<|user_end|>', '<|assistant_start|>', '<|assistant_end|>' }

-- the ids of the template's tokens {bos=, user_start=, ...}, or nil and the first missing name
function M.template_ids(tok)
  local ids = {}
  for _, name in ipairs(M.SPECIALS) do
    local id = tok:special_id(name)
    if not id then return nil, name end
    ids[name:match('^<|(.-)|>$')] = id
  end
  return ids
end

-- checks a conversation's shape; where names it in errors
function M.check_conversation(conv, where)
  local msgs = type(conv) == 'table' and conv.messages
  if type(msgs) ~= 'table' or #msgs == 0 then
    fail(('%s: expected {"messages": [{"role", "content"}, ...]} with at least one message'):format(where))
  end
  local want = 'user'
  for i, m in ipairs(msgs) do
    if type(m) ~= 'table' or type(m.content) ~= 'string' then
      fail(('%s: message %d: expected {"role", "content": a string}'):format(where, i))
    end
    local role = m.role
    if role == 'system' and i == 1 and #msgs > 1 and msgs[2].role == 'user' then
      -- merged into the first user message
    elseif role ~= want then
      fail(('%s: message %d: expected role "%s"%s, got %s'):format(where, i, want,
        i == 1 and ' (or "system" before the first user message)' or '', tostring(role)))
    else
      want = want == 'user' and 'assistant' or 'user'
    end
  end
  return msgs
end

-- render(tok, messages) -> ids, mask (1 where the token is the assistant's
-- to learn: its content and <|assistant_end|>; the mask of ids[i] says
-- whether ids[i] is a target)
function M.render(tok, messages, where)
  local sp, missing = M.template_ids(tok)
  if not sp then fail(('%s: the tokenizer has no %s (recipes/sft.lua adds the chat tokens)'):format(where or 'chat', missing)) end
  local ids, mask = { sp.bos }, { 0 }
  local function put(list, m) for _, id in ipairs(list) do ids[#ids + 1], mask[#mask + 1] = id, m end end
  local system
  for i, msg in ipairs(messages) do
    if msg.role == 'system' and i == 1 then system = msg.content
    elseif msg.role == 'user' then
      local text = system and (system .. '\n\n' .. msg.content) or msg.content
      system = nil
      put({ sp.user_start }, 0); put(tok:encode(text), 0); put({ sp.user_end }, 0)
    else
      put({ sp.assistant_start }, 0); put(tok:encode(msg.content), 1); put({ sp.assistant_end }, 1)
    end
  end
  return ids, mask
end

-- ------------------------------------------------------------ the commands

local SAMPLING = { temperature = 0.8, top_k = 0, top_p = 1, seed = 1337, max_tokens = 256, hf = false }

-- run and options from argv: the first bare word is the run
local function parse(args, defaults, usage, what)
  local run, rest = nil, {}
  for _, a in ipairs(args) do
    if a == '-h' or a == '--help' then io.write(usage) return nil end
    if a:sub(1, 1) ~= '-' and not run then run = a else rest[#rest + 1] = a end
  end
  if not run then fail(('%s: expected a run directory or checkpoint\n%s'):format(what, usage)) end
  local config = require 'gptlua.config'
  local o = config.merge(defaults, config.parse_args(rest, defaults, { prefix = what, hint = 'gptlua ' .. what .. ' --help lists them' }))
  if o.max_tokens < 1 or o.max_tokens ~= math.floor(o.max_tokens) then
    fail(('%s: --max_tokens must be a positive integer, got %s'):format(what, o.max_tokens))
  end
  infer.sampling_opts(o, what)
  return run, o
end

-- writes a token's bytes as they come (a special token: nothing)
local function streamer(tok)
  local specials = {}
  for _, id in pairs(tok.special_tokens or {}) do specials[id] = true end
  return function(id)
    if not specials[id] then io.write(tok:token_bytes(id)); io.stdout:flush() end
  end
end

-- Ctrl-C while f runs: f's should_stop turns true (the reply ends), instead of the process
local SIGINT = 2
local function interruptible(f)
  gl.lib.gl_signal_catch(SIGINT)
  gl.lib.gl_signal_take(SIGINT)
  local ok, res = pcall(f, function() return gl.lib.gl_signal_take(SIGINT) > 0 end)
  gl.lib.gl_signal_restore(SIGINT)
  if not ok then error(res, 0) end
  return res
end

local GENERATE_USAGE = [[
usage: gptlua generate RUN --prompt TEXT [--n=1] [--max_tokens=256] [--temperature=0.8] [--top_k=0] [--top_p=1] [--seed=1337] [--hf]
  RUN  a run (its latest checkpoint), its checkpoints/ or a checkpoint; with --hf a Hugging Face GPT-2 directory
  Samples --n continuations of the prompt with the KV-cache engine; one is printed as it is generated.
  A sample ends at the tokenizer's <|bos|> or <|endoftext|>, or after --max_tokens (or the context).
]]

function M.generate_main(args)
  local defaults = { prompt = '', n = 1 }
  for k, v in pairs(SAMPLING) do defaults[k] = v end
  local run, o = parse(args, defaults, GENERATE_USAGE, 'generate')
  if not run then return 0 end
  if o.n < 1 or o.n ~= math.floor(o.n) then fail(('generate: --n must be a positive integer, got %s'):format(o.n)) end
  local m = infer.load(run, { hf = o.hf, what = 'generate' })
  local tok = m.tokenizer
  local prompt = tok:encode(o.prompt)
  local doc = tok.bos_id or tok:special_id('<|endoftext|>')
  if doc then table.insert(prompt, 1, doc) end
  if #prompt == 0 then fail('generate: --prompt must encode to at least one token (this tokenizer has no <|bos|> to start from)') end
  local engine = infer.Engine.new(m.model, tok)
  local write = streamer(tok)
  io.write(o.prompt); io.stdout:flush()
  local rows = interruptible(function(should_stop)
    return engine:generate(prompt, { n = o.n, max_tokens = o.max_tokens, temperature = o.temperature, top_k = o.top_k,
      top_p = o.top_p, seed = o.seed, stop = { doc }, should_stop = should_stop, what = 'generate',
      on_token = o.n == 1 and function(_, id) write(id) end or nil })
  end)
  if o.n == 1 then io.write('\n')
  else
    for b, r in ipairs(rows) do
      if b > 1 then io.write(o.prompt) end
      for _, id in ipairs(r.ids) do write(id) end
      io.write('\n')
      if b < #rows then io.write('---------------\n') end
    end
  end
  return 0
end

local CHAT_USAGE = [[
usage: gptlua chat RUN [--temperature=0.8] [--top_k=0] [--top_p=1] [--seed=1337] [--max_tokens=256] [--system TEXT]
  A terminal chat with a fine-tuned model (recipes/sft.lua): the conversation is kept in the chat template.
  Ctrl-C stops a reply, Ctrl-D ends; /clear starts a new conversation.
]]

function M.main(args)
  local defaults = { system = '' }
  for k, v in pairs(SAMPLING) do defaults[k] = v end
  local run, o = parse(args, defaults, CHAT_USAGE, 'chat')
  if not run then return 0 end
  local m = infer.load(run, { hf = o.hf, what = 'chat' })
  local tok = m.tokenizer
  local sp, missing = M.template_ids(tok)
  if not sp then
    fail(('chat: %s\'s tokenizer has no %s: fine-tune it with recipes/sft.lua first'):format(run, missing))
  end
  local engine = infer.Engine.new(m.model, tok)
  local tty = GPTLUA and GPTLUA.isatty and GPTLUA.isatty(0) and GPTLUA.readline
  local read = tty and function(p) return GPTLUA.readline(p) end or function(p) io.write(p); io.stdout:flush(); return io.read('*l') end
  if tty then io.write(('chatting with %s (Ctrl-C stops a reply, Ctrl-D ends, /clear starts over)\n'):format(m.path)) end
  local messages = {}
  if o.system ~= '' then messages[1] = { role = 'system', content = o.system } end
  local write = streamer(tok)
  local turn = 0
  while true do
    local line = read('you> ')
    if line == nil then io.write('\n') break end
    if line == '/clear' then
      messages = o.system ~= '' and { { role = 'system', content = o.system } } or {}
      io.write('(a new conversation)\n')
    elseif line and line:match('%S') then
      messages[#messages + 1] = { role = 'user', content = line }
      local ids = M.render(tok, messages, 'chat')
      ids[#ids + 1] = sp.assistant_start
      local room = m.model.config.block_size - #ids
      if room < 1 then
        io.write(('(the conversation fills the context of %d tokens: /clear starts over)\n'):format(m.model.config.block_size))
        messages[#messages] = nil
      else
        turn = turn + 1
        io.write('assistant> '); io.stdout:flush()
        local rows = interruptible(function(should_stop)
          return engine:generate(ids, { max_tokens = math.min(o.max_tokens, room), temperature = o.temperature,
            top_k = o.top_k, top_p = o.top_p, seed = o.seed + turn - 1, stop = { sp.assistant_end, sp.bos },
            should_stop = should_stop, what = 'chat', on_token = function(_, id) write(id) end })
        end)
        local r = rows[1]
        if r.finish == 'interrupted' then io.write(' [stopped]') end
        io.write('\n')
        messages[#messages + 1] = { role = 'assistant', content = tok:decode(r.ids) }
      end
    end
  end
  return 0
end

return M
