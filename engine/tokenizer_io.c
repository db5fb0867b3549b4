/* tokenizer_io.c — tokenizer files: tiktoken's format (base64 token bytes,
 * space, rank, per line) plus a JSON sidecar for the type, pattern and special
 * tokens.  Writes are atomic (temp + rename); loading checks every line. */
#include <cjson/cJSON.h>
#include <errno.h>
#include "tokenizer_internal.h"

/* ------------------------------------------------------------ files */

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static void b64_encode(const uint8_t *s, int64_t n, char *out) {
  int64_t i = 0;
  for (; i + 2 < n; i += 3) {
    uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8 | s[i + 2];
    *out++ = B64[v >> 18]; *out++ = B64[(v >> 12) & 63]; *out++ = B64[(v >> 6) & 63]; *out++ = B64[v & 63];
  }
  if (i < n) {
    uint32_t v = (uint32_t)s[i] << 16 | (i + 1 < n ? (uint32_t)s[i + 1] << 8 : 0);
    *out++ = B64[v >> 18]; *out++ = B64[(v >> 12) & 63];
    *out++ = i + 1 < n ? B64[(v >> 6) & 63] : '=';
    *out++ = '=';
  }
  *out = 0;
}

/* decodes n base64 chars into out; returns the byte count or -1 */
static int64_t b64_decode(const char *s, int64_t n, uint8_t *out) {
  if (n % 4) return -1;
  int64_t w = 0;
  for (int64_t i = 0; i < n; i += 4) {
    uint32_t v = 0; int pad = 0;
    for (int k = 0; k < 4; k++) {
      char c = s[i + k]; int d;
      if (c >= 'A' && c <= 'Z') d = c - 'A';
      else if (c >= 'a' && c <= 'z') d = c - 'a' + 26;
      else if (c >= '0' && c <= '9') d = c - '0' + 52;
      else if (c == '+') d = 62;
      else if (c == '/') d = 63;
      else if (c == '=' && i + 4 == n && k >= 2) { d = 0; pad++; }
      else return -1;
      if (pad && c != '=') return -1;
      v = v << 6 | (uint32_t)d;
    }
    out[w++] = (uint8_t)(v >> 16);
    if (pad < 2) out[w++] = (uint8_t)(v >> 8);
    if (pad < 1) out[w++] = (uint8_t)v;
  }
  return w;
}

/* write to path.tmp, then rename: readers never see half a file */
static int write_atomic(const char *fn, const char *path, const char *data, int64_t n) {
  size_t pl = strlen(path);
  char *tmp = malloc(pl + 5);
  if (!tmp) return gl_error("%s: out of memory", fn);
  memcpy(tmp, path, pl); memcpy(tmp + pl, ".tmp", 5);
  FILE *f = fopen(tmp, "wb");
  if (!f) { int e = errno; free(tmp); return gl_error("%s: cannot write '%s': %s", fn, path, strerror(e)); }
  int ok = fwrite(data, 1, (size_t)n, f) == (size_t)n;
  ok = (fclose(f) == 0) && ok;
  if (!ok || rename(tmp, path) != 0) {
    int e = errno; remove(tmp); free(tmp);
    return gl_error("%s: cannot write '%s': %s", fn, path, strerror(e));
  }
  free(tmp);
  return GL_OK;
}

/* the whole file, NUL-terminated; NULL with *missing = 1 if it does not exist */
static char *read_file(const char *fn, const char *path, int64_t *len, int *missing) {
  *missing = 0;
  FILE *f = fopen(path, "rb");
  if (!f) {
    if (errno == ENOENT) { *missing = 1; return NULL; }
    return gl_error_null("%s: cannot open '%s': %s", fn, path, strerror(errno));
  }
  char *buf = NULL; int64_t n = 0, cap = 0;
  for (;;) {
    if (GROW(buf, cap, n + 65536 + 1)) { fclose(f); free(buf); return gl_error_null("%s: out of memory reading '%s'", fn, path); }
    size_t r = fread(buf + n, 1, 65536, f);
    n += (int64_t)r;
    if (r < 65536) break;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) { free(buf); return gl_error_null("%s: read error on '%s'", fn, path); }
  buf[n] = 0;
  *len = n;
  return buf;
}

static char *sidecar_path(const char *path) {
  size_t pl = strlen(path);
  char *p = malloc(pl + 6);
  if (p) { memcpy(p, path, pl); memcpy(p + pl, ".json", 6); }
  return p;
}

int gl_tok_save(const gl_tokenizer *t, const char *path) {
  const char *fn = "gl_tok_save";
  GL_TRY(check_tok(fn, t));
  if (!path) return gl_error("%s: path expected, got NULL", fn);
  /* ranks file */
  int64_t cap = 0, n = 0;
  for (int32_t i = 0; i < t->n_ordinary; i++) cap += (t->tok_len[i] + 2) / 3 * 4 + 14;
  char *buf = malloc((size_t)cap + 1);
  int32_t maxlen = 0;
  for (int32_t i = 0; i < t->n_ordinary; i++) if (t->tok_len[i] > maxlen) maxlen = t->tok_len[i];
  char *enc = malloc((size_t)(maxlen + 2) / 3 * 4 + 1);
  if (!buf || !enc) { free(buf); free(enc); return gl_error("%s: out of memory", fn); }
  for (int32_t i = 0; i < t->n_ordinary; i++) {
    b64_encode(t->blob + t->tok_off[i], t->tok_len[i], enc);
    n += sprintf(buf + n, "%s %d\n", enc, i);
  }
  free(enc);
  int rc = write_atomic(fn, path, buf, n);
  free(buf);
  if (rc) return rc;
  /* sidecar */
  cJSON *j = cJSON_CreateObject();
  cJSON_AddStringToObject(j, "format", "gptlua-tokenizer");
  cJSON_AddNumberToObject(j, "version", 1);
  cJSON_AddStringToObject(j, "type", t->is_char ? "char" : "bpe");
  if (t->pattern) cJSON_AddStringToObject(j, "pattern", t->pattern);
  else cJSON_AddNullToObject(j, "pattern");
  cJSON_AddStringToObject(j, "unicode_version", t->unicode_version);
  cJSON_AddNumberToObject(j, "vocab_size", t->n_ordinary + t->n_special);
  cJSON *sp = cJSON_AddObjectToObject(j, "special_tokens");
  for (int32_t i = t->n_ordinary; i < t->n_ordinary + t->n_special; i++) {
    char *name = strndup((const char *)t->blob + t->tok_off[i], (size_t)t->tok_len[i]);
    if (name) cJSON_AddNumberToObject(sp, name, i);
    free(name);
  }
  char *text = cJSON_Print(j);
  cJSON_Delete(j);
  char *jpath = sidecar_path(path);
  if (!text || !jpath) { free(text); free(jpath); return gl_error("%s: out of memory", fn); }
  rc = write_atomic(fn, jpath, text, (int64_t)strlen(text));
  free(text); free(jpath);
  return rc;
}

/* A ranks file without its sidecar names no split pattern, and the wrong
   one silently gives other ids (GPT-2's files split "10000" whole, GPT-4's
   pattern as 100|00).  tiktoken's standard encodings are recognised by
   their ranks: the 256 single bytes first, then as many ranks as the
   encoding has (r50k_base, GPT-2's: 50256; cl100k_base: 100256;
   o200k_base: 199998; patterns as tiktoken_ext/openai_public.py gives
   them).  Anything else is refused: its sidecar (or the pattern) must say
   how it splits. */
static const char R50K_PATTERN[] =
  "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char O200K_PATTERN[] =
  "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
  "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
  "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char *gl_tok_r50k_pattern(void) { return R50K_PATTERN; }
const char *gl_tok_o200k_pattern(void) { return O200K_PATTERN; }

static const struct { const char *name; int64_t n_ranks; const char *pattern; } STANDARD[] = {
  {"r50k_base", 50256, R50K_PATTERN}, {"cl100k_base", 100256, GPT4_PATTERN}, {"o200k_base", 199998, O200K_PATTERN},
};

static const char *standard_pattern(const char *text, int64_t *n_ranks) {
  int64_t n = 0, singles = 0;
  uint8_t buf[8];
  for (const char *p = text; *p;) {
    const char *eol = strchr(p, '\n');
    if (!eol) eol = p + strlen(p);
    const char *sp = memchr(p, ' ', (size_t)(eol - p));
    size_t line = (size_t)(eol - p);
    if (line > 0 && eol[-1] == '\r') line--;  /* (a first line that is empty has no eol[-1]) */
    if (line > 0) {
      if (n < 256 && sp && sp - p <= 4 && b64_decode(p, sp - p, buf) == 1) singles++;
      n++;
    }
    p = *eol ? eol + 1 : eol;
  }
  *n_ranks = n;
  if (singles == 256)
    for (size_t i = 0; i < sizeof STANDARD / sizeof STANDARD[0]; i++)
      if (n == STANDARD[i].n_ranks) return STANDARD[i].pattern;
  return NULL;
}

static gl_tokenizer *load(const char *fn, const char *path, const char *pattern_given) {
  if (!path) return gl_error_null("%s: path expected, got NULL", fn);
  int64_t len, jlen; int missing;
  char *text = read_file(fn, path, &len, &missing);
  if (!text) return missing ? gl_error_null("%s: '%s' does not exist", fn, path) : NULL;
  /* sidecar: type, pattern, specials */
  char *jpath = sidecar_path(path);
  if (!jpath) { free(text); return gl_error_null("%s: out of memory", fn); }
  char *jtext = read_file(fn, jpath, &jlen, &missing);
  if (!jtext && !missing) { free(text); free(jpath); return NULL; }
  int is_char = 0;
  char *pattern = NULL;         /* NULL with a sidecar: none; without: the standard encoding's */
  int unknown = 0;              /* a bare file of no standard encoding */
  int64_t bare_ranks = 0;
  int n_special = 0;
  char **snames = NULL; int32_t *sids = NULL;
  gl_tokenizer *t = NULL;
  uint8_t *bytes = NULL;
  cJSON *j = NULL;
  if (jtext) {
    j = cJSON_Parse(jtext);
    if (!j || !cJSON_IsObject(j)) { gl_error("%s: '%s' is not valid JSON", fn, jpath); goto fail; }
    cJSON *ty = cJSON_GetObjectItemCaseSensitive(j, "type");
    if (cJSON_IsString(ty)) {
      if (strcmp(ty->valuestring, "char") == 0) is_char = 1;
      else if (strcmp(ty->valuestring, "bpe") != 0) { gl_error("%s: '%s': type expected \"bpe\" or \"char\", got \"%s\"", fn, jpath, ty->valuestring); goto fail; }
    }
    cJSON *pat = cJSON_GetObjectItemCaseSensitive(j, "pattern");
    if (cJSON_IsString(pat)) pattern = pat->valuestring;
    else if (pat && !cJSON_IsNull(pat)) { gl_error("%s: '%s': pattern expected a string or null", fn, jpath); goto fail; }
    cJSON *sp = cJSON_GetObjectItemCaseSensitive(j, "special_tokens");
    if (sp && !cJSON_IsObject(sp)) { gl_error("%s: '%s': special_tokens expected an object", fn, jpath); goto fail; }
    n_special = sp ? cJSON_GetArraySize(sp) : 0;
    snames = calloc((size_t)n_special + 1, sizeof(char *));
    sids = calloc((size_t)n_special + 1, sizeof(int32_t));
    if (!snames || !sids) { gl_error("%s: out of memory", fn); goto fail; }
    int k = 0;
    for (cJSON *it = sp ? sp->child : NULL; it; it = it->next, k++) {
      if (!cJSON_IsNumber(it) || !(it->valuedouble >= 0 && it->valuedouble <= INT32_MAX) ||
          it->valuedouble != (double)(int32_t)it->valuedouble) {
        gl_error("%s: '%s': special token '%s' expected an integer id in [0, 2^31)", fn, jpath, it->string);
        goto fail;
      }
      snames[k] = it->string; sids[k] = (int32_t)it->valuedouble;
    }
    /* order the specials by id */
    for (int a = 1; a < n_special; a++)
      for (int b = a; b > 0 && sids[b] < sids[b - 1]; b--) {
        int32_t ti = sids[b]; sids[b] = sids[b - 1]; sids[b - 1] = ti;
        char *tn = snames[b]; snames[b] = snames[b - 1]; snames[b - 1] = tn;
      }
  } else if (!pattern_given) {
    /* an unknown bare file is refused once its lines are read (a broken
       line is the better message) */
    pattern = (char *)standard_pattern(text, &bare_ranks);
    unknown = pattern == NULL;
  }
  if (pattern_given) pattern = (char *)pattern_given;
  t = tok_new(fn, pattern ? pattern : "", is_char);
  if (!t) goto fail;
  bytes = malloc((size_t)len + 1);
  if (!bytes) { gl_error("%s: out of memory", fn); goto fail; }
  if (j) { /* files from before this field: the tables are unknown, say this build's */
    cJSON *uv = cJSON_GetObjectItemCaseSensitive(j, "unicode_version");
    if (uv && (!cJSON_IsString(uv) || strlen(uv->valuestring) >= sizeof t->unicode_version)) {
      gl_error("%s: '%s': unicode_version expected a version string such as \"15.0.0\"", fn, jpath); goto fail;
    }
    if (uv) strcpy(t->unicode_version, uv->valuestring);
  }
  /* pass 1: every token's bytes, ranks dense from 0 */
  {
    int64_t line = 0;
    for (char *p = text; *p;) {
      char *eol = strchr(p, '\n');
      if (!eol) eol = p + strlen(p);
      line++;
      char *q = eol;
      if (q > p && q[-1] == '\r') q--;
      if (q > p) {
        char *sp = memchr(p, ' ', (size_t)(q - p));
        char *end = NULL;
        long long rank = sp ? strtoll(sp + 1, &end, 10) : -1;
        if (!sp || end != q) { gl_error("%s: '%s' line %lld: expected \"<base64> <rank>\"", fn, path, (long long)line); goto fail; }
        int64_t nb = b64_decode(p, sp - p, bytes);
        if (nb <= 0) { gl_error("%s: '%s' line %lld: invalid base64", fn, path, (long long)line); goto fail; }
        if (rank != t->n_ordinary) {
          gl_error("%s: '%s' line %lld: rank %lld, expected %d (ranks must be dense and in order)", fn, path,
                   (long long)line, rank, t->n_ordinary);
          goto fail;
        }
        if (tok_push(t, bytes, nb, -1, -1) < 0) { gl_error("%s: out of memory", fn); goto fail; }
        t->n_ordinary++;
        if (nb == 1) {
          if (t->byte_id[bytes[0]] >= 0) {
            gl_error("%s: '%s' line %lld: byte 0x%02x is token %d already", fn, path, (long long)line, bytes[0], t->byte_id[bytes[0]]);
            goto fail;
          }
          t->byte_id[bytes[0]] = (int32_t)rank;
        } else if (is_char) {
          gl_error("%s: '%s' line %lld: a char tokenizer has single-byte tokens only", fn, path, (long long)line);
          goto fail;
        }
      }
      p = *eol ? eol + 1 : eol;
    }
    if (t->n_ordinary == 0) {
      gl_error("%s: '%s' holds no tokens (vocabulary 0): expected lines \"<base64> <rank>\"", fn, path);
      goto fail;
    }
  }
  /* pass 2: each multi-byte token's merge, by rank (tokenizer.c) */
  if (tok_derive_merges(fn, path, t)) goto fail;
  if (unknown) {
    gl_error("%s: '%s' has no sidecar '%s' to say how text is split, and its %lld ranks are not one of tiktoken's "
             "standard encodings (r50k_base 50256, cl100k_base 100256, o200k_base 199998): give the pattern "
             "(tokenizer.load(path, {pattern = ...})) or write the sidecar", fn, path, jpath, (long long)bare_ranks);
    goto fail;
  }
  /* specials: ids must follow the ordinary tokens */
  for (int k = 0; k < n_special; k++) {
    if (sids[k] != t->n_ordinary + k) {
      gl_error("%s: '%s': special token '%s' has id %d, expected %d", fn, jpath, snames[k], sids[k], t->n_ordinary + k);
      goto fail;
    }
  }
  if (tok_add_specials(fn, t, n_special, (const char *const *)snames)) goto fail;
  free(text); free(jtext); free(jpath); free(bytes); free(snames); free(sids);
  cJSON_Delete(j);
  return t;
fail:
  gl_tok_free(t);
  free(text); free(jtext); free(jpath); free(bytes); free(snames); free(sids);
  cJSON_Delete(j);
  return NULL;
}

gl_tokenizer *gl_tok_load(const char *path) { return load("gl_tok_load", path, NULL); }
gl_tokenizer *gl_tok_load_pattern(const char *path, const char *pattern) {
  if (!pattern) return gl_error_null("gl_tok_load_pattern: pattern expected, got NULL");
  return load("gl_tok_load_pattern", path, pattern);
}
