/*
 * gc_local.c - experts the client computes itself (the cluster file's "local" section):
 * loaded from the model's safetensors into kn layers at open, computed with the kn engine
 * on the submitting thread while the servers work on their parts.
 *
 * This is the CPU stand-in for the GPU's hot experts: same contract (the slots of a layer
 * call that the owner map marks local), same numbers as a server of the same weight format,
 * since both pack with kn from the same files.
 */
#include <stdio.h>
#include <string.h>

#include "gpu_client/rpc/internal.h"

int gc__local_load(gc_cluster *c, uint8_t *local, mr_err *e) {
  mr_model_config cfg;
  mr_idset layers = {0}, experts = {0};
  mr_st *st = NULL;
  int rc = mr_config_load(&cfg, c->model_dir, e);
  if (rc) return mr_err_prefix(e, rc, "local experts: model %s", c->model_dir);
  rc = mr_idset_parse(&layers, c->file.local_layers, c->L, "cluster file local.layers", e);
  if (rc) goto out;
  rc = mr_idset_parse(&experts, c->file.local_experts, c->E, "cluster file local.experts", e);
  if (rc) goto out;

  kn_layer_desc d = {.hidden = c->H, .inter = c->I, .num_experts = c->E};
  d.format = c->opts.local_format == KN_FMT_COUNT ? c->fmt : c->opts.local_format;
  d.group = c->opts.local_group ? c->opts.local_group : (c->group ? c->group : 64);
  if (d.format != c->fmt || (d.format == KN_FMT_INT4 && d.group != c->group))
    mr_log(MR_LOG_WARN, "local experts use format %s (group %u) but the servers use %s: local "
           "and remote experts will not compute identical numbers", kn_format_name(d.format),
           d.group, c->weight_format);

  rc = mr_st_open(&st, c->model_dir, e);
  if (rc) goto out;
  /* In place needs the stored dtype to be the served format and one NUMA node; other
   * experts are packed (kn_layer_take_expert_st). */
  const bool map = c->opts.local_map_weights;
  if (map) mr_st_advise_hugepage(st); /* the reads below then come in 2 MiB folios */
  if (c->opts.shared_engine) {
    c->local_eng = c->opts.shared_engine;
  } else {
    rc = kn_engine_new(&c->local_eng, &c->opts.local_engine, e);
    if (rc) {
      mr_err_prefix(e, rc, "local experts: kernel engine");
      goto out;
    }
    c->own_local_eng = true;
  }
  c->local_layers = mr_calloc(c->L, sizeof *c->local_layers);
  if (!c->local_layers) {
    rc = mr_err_set(e, MR_ENOMEM, "local experts: out of memory");
    goto out;
  }
  uint64_t t0 = mr_now_ns();
  for (uint32_t l = 0; l < c->L; l++) {
    if (!mr_idset_has(&layers, l) || !mr_config_is_moe_layer(&cfg, l)) continue;
    rc = kn_layer_new(&c->local_layers[l], c->local_eng, &d, e);
    if (rc) {
      mr_err_prefix(e, rc, "local experts: layer %u", l);
      goto out;
    }
    for (uint32_t x = 0; x < c->E; x++) {
      if (!mr_idset_has(&experts, x)) continue;
      const mr_st_tensor *t[3], *sc[3];
      rc = mr_config_expert_tensors_q(&cfg, st, l, x, t, sc, e);
      if (rc) {
        mr_err_prefix(e, rc, "local experts: model %s", c->model_dir);
        goto out;
      }
      if (map) /* one read of the file's pages, in 2 MiB folios, whether mapped or packed */
        for (int p = 0; p < 3; p++) mr_st_populate(t[p]);
      bool borrowed;
      rc = kn_layer_take_expert_st(c->local_layers[l], x, t, sc, map, &borrowed, e); /* fp8 too */
      c->local_mapped += borrowed;
      if (rc) {
        mr_err_prefix(e, rc, "local experts: model %s", c->model_dir);
        goto out;
      }
      local[(size_t)l * c->E + x] = GC__LOCAL_LIB;
      c->local_pairs++;
    }
  }
  if (map && c->local_pairs && !c->local_mapped)
    mr_log(MR_LOG_WARN, "local experts: local_map_weights: none served in place (format %s, "
           "%u NUMA node(s); only a format the files store as is, on one node): all packed",
           kn_format_name(d.format), kn_engine_nodes(c->local_eng));
  mr_log(MR_LOG_INFO, "local experts: %llu (layer, expert) pairs as %s loaded in %.1f s, "
         "%llu in place (layers %s, experts %s)", (unsigned long long)c->local_pairs,
         kn_format_name(d.format), (double)(mr_now_ns() - t0) / 1e9,
         (unsigned long long)c->local_mapped, c->file.local_layers, c->file.local_experts);
out:
  if (c->local_mapped) { /* in-place experts read it until gc__local_free, even on failure */
    c->local_st = st;
    st = NULL;
  }
  mr_st_close(st);
  mr_idset_close(&layers);
  mr_idset_close(&experts);
  return rc;
}

int gc__local_forward(gc_cluster *c, gc_pending *p, uint32_t part, const void *x_rows,
                      mr_err *e) {
  const gc__part *pt = &p->plan.parts[part];
  const kn_layer *L = c->local_layers ? c->local_layers[p->layer] : NULL;
  MR_ASSERT(L); /* the owner map marks a pair local only where a layer was loaded */
  kn_moe_args a = {
      .n_tokens = pt->n_tokens,
      .top_k = p->plan.top_k,
      .ids = pt->ids,
      .weights = pt->weights,
      .x = x_rows,
      .x_dtype = p->dtype,
      .out = p->part_out[part],
  };
  pthread_mutex_lock(&c->local_lock);
  int rc = kn_moe_forward(c->local_eng, L, &a, NULL, e);
  pthread_mutex_unlock(&c->local_lock);
  return rc;
}

void gc__local_free(gc_cluster *c) {
  if (c->local_layers)
    for (uint32_t l = 0; l < c->L; l++) kn_layer_free(c->local_layers[l]);
  mr_free(c->local_layers);
  c->local_layers = NULL;
  mr_st_close(c->local_st); /* after the layers: in-place experts read it */
  c->local_st = NULL;
  c->local_mapped = 0;
  if (c->own_local_eng) kn_engine_free(c->local_eng);
  c->local_eng = NULL;
  c->own_local_eng = false;
}
