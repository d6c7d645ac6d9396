/*
 * es_load.c - loading the owned experts of a model into kn_layers.
 *
 * Order, chosen so that every mistake is reported before minutes of loading are spent:
 *   1. config.json; the --layers and --experts sets against it; --max-tokens against the
 *      gRPC message size it implies;
 *   2. open the safetensors (mmap), fingerprint the model;
 *   3. check every owned tensor's presence, dtype and shape (headers only, milliseconds);
 *   4. create the kn_engine (threads, NUMA) and one kn_layer per owned layer;
 *   5. pack each owned expert into its layer, logging progress at most once a second
 *      (with --map-weights, where the format stores the weights as they are and there is
 *      one NUMA node: check each expert's weights in place instead and serve them from
 *      the mapping, which es-map-read streams in ahead of the check, in 2 MiB folios);
 *   6. unmap the files: the layers hold their own (packed, NUMA-placed) copies (with
 *      --map-weights: keep the mapping until es__unload, after the layers).
 * Steps 1-4 are es__load_prepare, in es_server_new, before the port is bound; steps 5-6 are
 * es__load_weights, on the loader thread of es_server_run while the port already answers
 * health (docs/DESIGN.md 3.6).
 * Only owned experts are ever touched, so a server owning 1/8 of a model reads 1/8 of it.
 *
 * MOERPC_TEST_LOAD_DELAY_MS (tests only, see tests/README.md): sleeps that long after each
 * expert is packed, so that a test can watch a tiny model load.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "expert_server/internal.h"

/* Prefixes e->msg with "where: " and recodes a file error: it is the model's fault, not a
 * flag's, so MR_EINVAL (kept for flags only, see es.h) becomes MR_EFORMAT. Returns the code. */
static int es__file_err(mr_err *e, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int es__file_err(mr_err *e, int rc, const char *fmt, ...) {
  char where[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(where, sizeof where, fmt, ap);
  va_end(ap);
  if (rc == MR_EINVAL) rc = MR_EFORMAT;
  mr_err_prefix(e, rc, "%s", where);
  if (e) e->code = rc;
  return rc;
}

/* Formats the MoE layers of c as an id-set spec, for error messages. */
static void es__moe_layers_str(const mr_model_config *c, char *buf, size_t len) {
  mr_idlist w;
  mr_idlist_init(&w, buf, len);
  for (uint32_t l = 0; l < c->num_layers; l++)
    if (c->is_moe[l]) mr_idlist_add(&w, l);
  mr_idlist_end(&w, true);
}

/* Resolves --layers: "all" means every MoE layer; an explicit set must name MoE layers only. */
static int es__resolve_layers(es_server *s, mr_err *e) {
  const mr_model_config *c = &s->cfg;
  char moe[256];
  mr_idset parsed;
  int rc = mr_idset_parse(&parsed, s->layers_spec, c->num_layers, "--layers", e);
  if (rc) return MR_EINVAL;
  rc = mr_idset_init(&s->owned_layers, c->num_layers);
  if (rc) goto out_close_parsed;
  bool all = strcmp(s->layers_spec, "all") == 0;
  for (uint32_t l = 0; l < c->num_layers; l++) {
    if (!mr_idset_has(&parsed, l)) continue;
    if (c->is_moe[l]) {
      mr_idset_add(&s->owned_layers, l);
    } else if (!all) {
      es__moe_layers_str(c, moe, sizeof moe);
      rc = mr_err_set(e, MR_EINVAL,
                      "--layers %s: layer %" PRIu32 " is not a MoE layer of this model "
                      "(its MoE layers are %s)",
                      s->layers_spec, l, moe[0] ? moe : "none");
      goto out_close_parsed;
    }
  }
  if (mr_idset_count(&s->owned_layers) == 0)
    rc = mr_err_set(e, MR_EINVAL, "--layers %s selects no MoE layer (the model has %" PRIu32
                    " MoE layers of %" PRIu32 ")",
                    s->layers_spec, mr_config_num_moe_layers(c), c->num_layers);
out_close_parsed:
  mr_idset_close(&parsed);
  return rc;
}

/* The largest message either side may send, from max_tokens (pr_forward_max_bytes); gRPC
 * counts message sizes in an int. */
static int es__message_limit(es_server *s, mr_err *e) {
  const mr_model_config *c = &s->cfg;
  uint64_t bytes = pr_forward_max_bytes(s->opts.max_tokens, c->hidden_size, c->num_experts);
  if (bytes > (uint64_t)INT_MAX) {
    uint64_t per_token = pr_forward_token_bytes(c->hidden_size, c->num_experts);
    return mr_err_set(e, MR_EINVAL,
                      "--max-tokens %" PRIu32 " is too large for this model: a request could be "
                      "%" PRIu64 " bytes (hidden_size %" PRIu32 ", num_experts %" PRIu32
                      "), over the 2 GiB gRPC message limit; at most %" PRIu64 " tokens",
                      s->opts.max_tokens, bytes, c->hidden_size, c->num_experts,
                      ((uint64_t)INT_MAX - PR_FORWARD_FRAMING_BYTES) / per_token);
  }
  s->max_message_bytes = (int)bytes;
  return 0;
}

static kn_format es__format_of_dtype(mr_dtype dt) {
  return dt == MR_DTYPE_F32 ? KN_FMT_F32 : dt == MR_DTYPE_F16 ? KN_FMT_F16 : KN_FMT_BF16;
}

/* Progress of step 5: one log line a second at most, plus the final one. */
typedef struct es_progress {
  uint64_t t0_ns, last_ns;
  uint64_t tensors_done, tensors_total;
  uint64_t bytes_done, bytes_total;
} es_progress;

static void es__progress_log(es_progress *p, bool final) {
  uint64_t now = mr_now_ns();
  if (!final && now - p->last_ns < 1000000000ull) return;
  p->last_ns = now;
  double s = (double)(now - p->t0_ns) / 1e9;
  double gb = (double)p->bytes_done / 1e9, gb_total = (double)p->bytes_total / 1e9;
  double rate = s > 0 ? gb / s : 0;
  if (final) {
    mr_log(MR_LOG_INFO, "loading: done, %" PRIu64 "/%" PRIu64 " tensors, %.2f GB in %.3f s (%.2f GB/s)",
           p->tensors_done, p->tensors_total, gb, s, rate);
  } else {
    double eta = rate > 0 ? (gb_total - gb) / rate : 0;
    mr_log(MR_LOG_INFO, "loading: %" PRIu64 "/%" PRIu64 " tensors, %.2f/%.2f GB, %.2f GB/s, ETA %.0f s",
           p->tensors_done, p->tensors_total, gb, gb_total, rate, eta);
  }
}

/* Step 3: finds the three tensors of (layer, expert), checks dtype and shape. */
static int es__expect_expert(es_server *s, const mr_st *st, uint32_t l, uint32_t x,
                             const mr_st_tensor *t[3], const mr_st_tensor *sc[3], mr_err *e) {
  int rc = mr_config_expert_tensors_q(&s->cfg, st, l, x, t, sc, e);
  return rc ? es__file_err(e, rc, "model %s", s->model_dir) : 0;
}

bool es__mem_available(uint64_t *bytes) {
  FILE *f = fopen("/proc/meminfo", "r");
  if (!f) return false;
  char line[256];
  unsigned long long kb;
  bool found = false;
  while (!found && fgets(line, sizeof line, f)) found = sscanf(line, "MemAvailable: %llu kB", &kb) == 1;
  fclose(f);
  if (found) *bytes = (uint64_t)kb * 1024u;
  return found;
}

void es__loading_msg(es_server *s, char *buf, size_t len) {
  snprintf(buf, len, "loading: %llu of %llu tensors (%.2f of %.2f GB) loaded; not serving yet",
           (unsigned long long)atomic_load(&s->load_tensors_done),
           (unsigned long long)s->load_tensors_total,
           (double)atomic_load(&s->load_bytes_done) / 1e9, (double)s->load_bytes_total / 1e9);
}

int es__load_prepare(es_server *s, mr_err *e) {
  mr_model_config *c = &s->cfg;
  mr_st *st = NULL;
  int rc = mr_config_load(c, s->model_dir, e);
  if (rc) return es__file_err(e, rc, "--model %s", s->model_dir);

  if ((rc = es__resolve_layers(s, e))) return rc;
  rc = mr_idset_parse(&s->owned_experts, s->experts_spec, c->num_experts, "--experts", e);
  if (rc) return MR_EINVAL;
  if (mr_idset_count(&s->owned_experts) == 0)
    return mr_err_set(e, MR_EINVAL, "--experts %s selects no expert (the model has %" PRIu32 ")",
                      s->experts_spec, c->num_experts);
  if ((rc = es__message_limit(s, e))) return rc;

  rc = mr_st_open(&st, s->model_dir, e);
  if (rc) return es__file_err(e, rc, "--model %s", s->model_dir);
  rc = mr_model_fingerprint(s->model_dir, st, s->fingerprint, e);
  if (rc) {
    rc = es__file_err(e, rc, "--model %s: fingerprint", s->model_dir);
    goto out_close_st;
  }

  /* Step 3: every tensor before any packing. */
  uint32_t n_layers = mr_idset_count(&s->owned_layers);
  uint32_t n_experts = mr_idset_count(&s->owned_experts);
  es_progress prog = {.tensors_total = 3ull * n_layers * n_experts};
  mr_dtype stored = MR_DTYPE_UNSPECIFIED;
  bool stored_fp8 = false;
  for (uint32_t l = 0; l < c->num_layers; l++) {
    if (!mr_idset_has(&s->owned_layers, l)) continue;
    for (uint32_t x = 0; x < c->num_experts; x++) {
      if (!mr_idset_has(&s->owned_experts, x)) continue;
      const mr_st_tensor *t[3], *sc[3];
      if ((rc = es__expect_expert(s, st, l, x, t, sc, e))) goto out_close_st;
      if (sc[0]) stored_fp8 = true; /* F8_E4M3 with block scales (t[0]->dtype unspecified) */
      else if (stored == MR_DTYPE_UNSPECIFIED) stored = t[0]->dtype;
      prog.bytes_total += t[0]->nbytes + t[1]->nbytes + t[2]->nbytes;
    }
  }
  /* Without --quant the weights stay as stored: fp8-b128 for an FP8 checkpoint. --quant
   * fp8 on a float checkpoint quantizes at load; --quant bf16/int8/int4 on an FP8 one
   * dequantizes (w = e4m3 * scale_inv) and re-quantizes (kn_layer_load_expert_st). */
  s->format = s->opts.quant_set ? s->opts.quant
              : stored_fp8      ? KN_FMT_FP8
                                : es__format_of_dtype(stored);
  s->group = s->format == KN_FMT_INT4 ? s->opts.group : 0;
  kn_format_wire_name(s->format, s->group, s->weight_format, sizeof s->weight_format);
  const bool as_stored = stored_fp8 ? s->format == KN_FMT_FP8 : s->format == es__format_of_dtype(stored);
  if (s->opts.map_weights && !as_stored)
    mr_log(MR_LOG_WARN, "--map-weights: the experts are served as %s, not as stored (%s): "
           "they are packed as usual", s->weight_format, stored_fp8 ? "fp8" : mr_dtype_name(stored));

  /* Step 4. */
  kn_engine_opts eo = {.isa = KN_ISA_COUNT, .threads = s->opts.threads, .numa = s->numa};
  /* MOERPC_TEST_FORCE_SPLIT=N (tests only): N weight slices on a one-node host, so that the
   * multi-node layout (and a cache written under another split) can be tested here. */
  const char *split = getenv("MOERPC_TEST_FORCE_SPLIT");
  if (split && split[0]) {
    eo.force_split = (uint32_t)strtoul(split, NULL, 10);
    if (eo.force_split > 64) eo.force_split = 64;
    mr_log(MR_LOG_WARN, "MOERPC_TEST_FORCE_SPLIT=%" PRIu32 ": weights split as if on that many "
           "NUMA nodes, for a test", eo.force_split);
  }
  rc = kn_engine_new(&s->eng, &eo, e);
  if (rc) goto out_close_st; /* MR_EINVAL names --threads / --numa / MOERPC_ISA */
  s->layers = mr_calloc(c->num_layers, sizeof *s->layers);
  s->owned = mr_calloc(c->num_layers, sizeof *s->owned);
  if (!s->layers || !s->owned) {
    rc = mr_err_set(e, MR_ENOMEM, "out of memory for %" PRIu32 " layer slots", c->num_layers);
    goto out_close_st;
  }
  kn_layer_desc d = {.hidden = c->hidden_size, .inter = c->moe_intermediate,
                     .num_experts = c->num_experts, .format = s->format, .group = s->group};
  bool map_decided = false;
  for (uint32_t l = 0; l < c->num_layers; l++) {
    if (!mr_idset_has(&s->owned_layers, l)) continue;
    rc = kn_layer_new(&s->layers[l], s->eng, &d, e);
    if (rc) {
      /* The shape comes from the model, the format from --quant/--group: name both. */
      char group[32] = "";
      if (s->format == KN_FMT_INT4) snprintf(group, sizeof group, " --group %" PRIu32, s->group);
      rc = mr_err_prefix(e, rc, "--quant %s%s for layer %" PRIu32 " (hidden %" PRIu32
                         ", intermediate %" PRIu32 ")",
                         kn_format_name(s->format), group, l, c->hidden_size, c->moe_intermediate);
      goto out_close_st;
    }
    s->owned[l] = &s->owned_experts;
    /* Every layer has the same shape, format and engine: the first one decides. */
    if (s->opts.map_weights && !map_decided) {
      map_decided = true;
      s->map_in_place = stored_fp8 ? kn_layer_can_borrow_fp8(s->layers[l])
                                   : kn_layer_can_borrow(s->layers[l], stored);
      if (!s->map_in_place && as_stored)
        mr_log(MR_LOG_WARN, "--map-weights: the experts are split over %" PRIu32 " NUMA nodes "
               "(each slice on its node): they are packed as usual", kn_engine_nodes(s->eng));
    }
  }

  s->limits = (es_limits){.num_layers = c->num_layers, .num_experts = c->num_experts,
                          .hidden_size = c->hidden_size, .max_tokens = s->opts.max_tokens,
                          .max_top_k = es_max_top_k(c->top_k, c->num_experts),
                          .is_moe = c->is_moe, .owned = s->owned};
  s->load_tensors_total = prog.tensors_total;
  s->load_bytes_total = prog.bytes_total;
  const char *delay = getenv("MOERPC_TEST_LOAD_DELAY_MS");
  if (delay && delay[0]) {
    s->load_delay_ms = (uint32_t)strtoul(delay, NULL, 10);
    if (s->load_delay_ms > 60000) s->load_delay_ms = 60000;
    mr_log(MR_LOG_WARN, "MOERPC_TEST_LOAD_DELAY_MS=%" PRIu32 ": loading slowed down for a test",
           s->load_delay_ms);
  }
  s->st = st;
  return 0;
out_close_st:
  mr_st_close(st);
  return rc;
}

/* Starts the disk read of the owned expert after (l, x) (in load order) while (l, x) is
 * packed: from a cold page cache, the read then overlaps the conversion. */
static void es__prefetch_next(es_server *s, const mr_st *st, uint32_t l, uint32_t x) {
  const mr_model_config *c = &s->cfg;
  for (x++;; x++) {
    if (x >= c->num_experts) {
      x = 0;
      do l++; while (l < c->num_layers && !s->layers[l]);
      if (l >= c->num_layers) return;
    }
    if (!mr_idset_has(&s->owned_experts, x)) continue;
    const mr_st_tensor *t[3], *sc[3];
    if (mr_config_expert_tensors_q(c, st, l, x, t, sc, NULL) != 0) return;
    for (int p = 0; p < 3; p++) {
      mr_st_prefetch(t[p]);
      mr_st_prefetch(sc[p]);
    }
    return;
  }
}

/* es-map-read (--map-weights): reads the owned experts' tensors in load order through the
 * huge-page-advised mapping, ahead of the finite check that follows it on the engine's
 * workers, so that a cold start streams the disk in 2 MiB folios (mapped 2 MiB at a time
 * for decode) where a WILLNEED readahead would bring 4 KiB pages. Stops with the load. */
typedef struct es_map_reader {
  es_server *s;
  atomic_bool stop; /* the load ended early */
} es_map_reader;

static void *es__map_read_main(void *arg) {
  es_map_reader *r = arg;
  es_server *s = r->s;
  const mr_model_config *c = &s->cfg;
  pthread_setname_np(pthread_self(), "es-map-read");
  for (uint32_t l = 0; l < c->num_layers; l++) {
    if (!s->layers[l]) continue;
    for (uint32_t x = 0; x < c->num_experts && !atomic_load(&r->stop) && !atomic_load(&s->load_abort); x++) {
      if (!mr_idset_has(&s->owned_experts, x)) continue;
      const mr_st_tensor *t[3], *sc[3];
      if (mr_config_expert_tensors_q(c, s->st, l, x, t, sc, NULL) != 0) return NULL;
      for (int p = 0; p < 3; p++) mr_st_populate(t[p]);
    }
  }
  return NULL;
}

int es__load_weights(es_server *s, bool cached, mr_err *e) {
  mr_model_config *c = &s->cfg;
  mr_st *st = s->st;
  uint64_t t0 = s->load_t0_ns ? s->load_t0_ns : mr_now_ns();
  int rc = 0;
  uint32_t n_layers = mr_idset_count(&s->owned_layers);
  uint32_t n_experts = mr_idset_count(&s->owned_experts);
  es_progress prog = {.tensors_total = s->load_tensors_total, .bytes_total = s->load_bytes_total};

  /* Experts read in place: 2 MiB mappings of the file's pages where the kernel gives them
   * (decode streams the weights: 4 KiB entries cost 10-25 % of a T = 16 call here). */
  pthread_t reader;
  es_map_reader mr = {.s = s};
  atomic_init(&mr.stop, false);
  bool reader_started = false;
  if (s->map_in_place && !cached) {
    mr_st_advise_hugepage(st);
    reader_started = pthread_create(&reader, NULL, es__map_read_main, &mr) == 0;
  }
  /* Step 5, unless the loader mapped every owned expert from the weight cache (cached). */
  prog.t0_ns = prog.last_ns = mr_now_ns();
  for (uint32_t l = 0; l < c->num_layers && !cached; l++) {
    if (!s->layers[l]) continue;
    for (uint32_t x = 0; x < c->num_experts; x++) {
      if (!mr_idset_has(&s->owned_experts, x)) continue;
      const mr_st_tensor *t[3], *sc[3];
      if ((rc = es__expect_expert(s, st, l, x, t, sc, e))) goto out_close_st;
      if (!s->map_in_place) es__prefetch_next(s, st, l, x);
      /* In place: one read (the finite check), no copy; an expert that cannot be (another
       * dtype, block scales, misaligned in its file) is packed like the rest. */
      bool borrowed;
      rc = kn_layer_take_expert_st(s->layers[l], x, t, sc, s->map_in_place, &borrowed, e);
      s->n_mapped += borrowed;
      if (rc) {
        rc = es__file_err(e, rc, "loading layer %" PRIu32 " expert %" PRIu32 " from %s", l, x,
                          t[0]->file);
        goto out_close_st;
      }
      s->n_experts_loaded++;
      prog.tensors_done += 3;
      prog.bytes_done += t[0]->nbytes + t[1]->nbytes + t[2]->nbytes;
      atomic_store_explicit(&s->load_tensors_done, prog.tensors_done, memory_order_relaxed);
      atomic_store_explicit(&s->load_bytes_done, prog.bytes_done, memory_order_relaxed);
      es__progress_log(&prog, false);
      for (uint32_t slept = 0; slept < s->load_delay_ms && !atomic_load(&s->load_abort); slept += 5)
        usleep(5000);
      if (atomic_load(&s->load_abort)) {
        rc = mr_err_set(e, MR_ECANCELED, "loading stopped by the drain after %" PRIu64 " of %" PRIu64
                        " tensors", prog.tensors_done, prog.tensors_total);
        goto out_close_st;
      }
    }
    s->weight_bytes += kn_layer_bytes(s->layers[l]);
  }
  if (!cached) es__progress_log(&prog, true);

  char isa[64];
  snprintf(isa, sizeof isa, "%s for %s", kn_isa_name(kn_engine_isa(s->eng, s->format)),
           kn_format_name(s->format));
  char how[96] = "";
  if (cached) snprintf(how, sizeof how, " (mapped from the weight cache)");
  else if (s->n_mapped)
    snprintf(how, sizeof how, " (%" PRIu64 " of %" PRIu32 " served in place from the model's files)",
             s->n_mapped, s->n_experts_loaded);
  mr_log(MR_LOG_INFO,
         "loaded: %" PRIu32 " experts (%" PRIu32 " per layer) in %" PRIu32 " layers, %.2f GB %s "
         "in %.2f s%s, format %s, isa %s, %" PRIu32 " threads on %" PRIu32 " NUMA node(s), model %s",
         s->n_experts_loaded, n_experts, n_layers, (double)s->weight_bytes / 1e9,
         s->n_mapped == s->n_experts_loaded && s->n_mapped ? "mapped" : "packed",
         (double)(mr_now_ns() - t0) / 1e9, how, s->weight_format, isa, kn_engine_threads(s->eng),
         kn_engine_nodes(s->eng), s->fingerprint);
  rc = 0;
out_close_st:
  if (reader_started) {
    atomic_store(&mr.stop, true); /* done, or failed: it stops after its expert */
    pthread_join(reader, NULL);
  }
  /* Experts served in place read this mapping until the layers go (es__unload). */
  if (s->n_mapped) {
    es__keep_st(s, st);
    st = NULL;
  }
  mr_st_close(st);
  s->st = NULL;
  return rc;
}

void es__keep_st(es_server *s, mr_st *st) {
  mr_st **k = mr_realloc(s->st_kept, (s->n_st_kept + 1) * sizeof *k);
  if (!k) {
    /* Out of memory for one pointer: the mapping then stays until exit, unclosed (closing
     * it would pull the weights from under the experts that read them). */
    mr_log(MR_LOG_WARN, "out of memory keeping a model mapping's handle: it stays mapped until exit");
    return;
  }
  k[s->n_st_kept++] = st;
  s->st_kept = k;
}

void es__unload(es_server *s) {
  mr_st_close(s->st);
  s->st = NULL;
  if (s->layers) {
    for (uint32_t l = 0; l < s->cfg.num_layers; l++) kn_layer_free(s->layers[l]);
    mr_free(s->layers);
    s->layers = NULL;
  }
  /* After the layers: their in-place experts read these. */
  for (uint32_t i = 0; i < s->n_st_kept; i++) mr_st_close(s->st_kept[i]);
  mr_free(s->st_kept);
  s->st_kept = NULL;
  s->n_st_kept = 0;
  mr_free(s->owned);
  s->owned = NULL;
  kn_engine_free(s->eng);
  s->eng = NULL;
  if (s->owned_layers.bits) mr_idset_close(&s->owned_layers);
  if (s->owned_experts.bits) mr_idset_close(&s->owned_experts);
}
