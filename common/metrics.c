/*
 * metrics.c - the Prometheus text exposition writer (format 0.0.4) and lock-free
 * histograms (mr.h). Text layout of one family, as the spec has it:
 *
 *   # HELP moerpc_layer_compute_seconds Compute time of one request, by layer.
 *   # TYPE moerpc_layer_compute_seconds histogram
 *   moerpc_layer_compute_seconds_bucket{layer="3",le="5e-05"} 0
 *   ...
 *   moerpc_layer_compute_seconds_bucket{layer="3",le="+Inf"} 12
 *   moerpc_layer_compute_seconds_sum{layer="3"} 0.0042
 *   moerpc_layer_compute_seconds_count{layer="3"} 12
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mr.h"

static void mr__prom_putc(mr_buf *p, char c) { mr_buf_append(p, &c, 1); }
static void mr__prom_puts(mr_buf *p, const char *s) { mr_buf_append(p, s, strlen(s)); }


static bool mr__alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static bool mr__digit(char c) { return c >= '0' && c <= '9'; }

/* A metric name ([a-zA-Z_:][a-zA-Z0-9_:]*) or, colon false, a label name. */
static void mr__prom_name(mr_buf *p, const char *name, bool colon) {
  if (!name[0] || mr__digit(name[0])) mr__prom_putc(p, '_');
  for (const char *c = name; *c; c++)
    mr__prom_putc(p, mr__alpha(*c) || mr__digit(*c) || (colon && *c == ':') ? *c : '_');
}

/* Escapes backslash and newline, and with quote also the double quote. */
static void mr__prom_escaped(mr_buf *p, const char *s, bool quote) {
  for (const char *c = s; *c; c++) {
    if (*c == '\\') mr__prom_puts(p, "\\\\");
    else if (*c == '\n') mr__prom_puts(p, "\\n");
    else if (quote && *c == '"') mr__prom_puts(p, "\\\"");
    else mr__prom_putc(p, *c);
  }
}

void mr_prom_family(mr_buf *p, const char *name, mr_prom_type t, const char *help) {
  static const char *const types[] = {"counter", "gauge", "histogram"};
  mr__prom_puts(p, "# HELP ");
  mr__prom_name(p, name, true);
  mr__prom_putc(p, ' ');
  mr__prom_escaped(p, help ? help : "", false);
  mr__prom_puts(p, "\n# TYPE ");
  mr__prom_name(p, name, true);
  mr__prom_putc(p, ' ');
  mr__prom_puts(p, types[t]);
  mr__prom_putc(p, '\n');
}

/* Shortest text that reads back as v ("0.005", not "0.0050000000000000001"). */
static void mr__prom_num(char *buf, size_t len, double v) {
  if (isnan(v)) {
    snprintf(buf, len, "NaN");
  } else if (isinf(v)) {
    snprintf(buf, len, v > 0 ? "+Inf" : "-Inf");
  } else if (v == floor(v) && fabs(v) < 1e15) {
    snprintf(buf, len, "%.0f", v); /* 10, not 1e+01 */
  } else {
    for (int prec = 1; prec <= 17; prec++) {
      snprintf(buf, len, "%.*g", prec, v);
      if (strtod(buf, NULL) == v) return;
    }
  }
}

/* name{labels[,extra_k="extra_v"]} */
static void mr__prom_head(mr_buf *p, const char *name, const char *suffix,
                          const char *const *labels, const char *extra_k, const char *extra_v) {
  mr__prom_name(p, name, true);
  if (suffix) mr__prom_puts(p, suffix);
  bool any = false;
  for (size_t i = 0; labels && labels[i] && labels[i + 1]; i += 2) {
    mr__prom_putc(p, any ? ',' : '{');
    mr__prom_name(p, labels[i], false);
    mr__prom_puts(p, "=\"");
    mr__prom_escaped(p, labels[i + 1], true);
    mr__prom_putc(p, '"');
    any = true;
  }
  if (extra_k) {
    mr__prom_putc(p, any ? ',' : '{');
    mr__prom_puts(p, extra_k);
    mr__prom_puts(p, "=\"");
    mr__prom_puts(p, extra_v);
    mr__prom_putc(p, '"');
    any = true;
  }
  if (any) mr__prom_putc(p, '}');
  mr__prom_putc(p, ' ');
}

void mr_prom_double(mr_buf *p, const char *name, const char *const *labels, double v) {
  char num[40];
  mr__prom_num(num, sizeof num, v);
  mr__prom_head(p, name, NULL, labels, NULL, NULL);
  mr__prom_puts(p, num);
  mr__prom_putc(p, '\n');
}

void mr_prom_u64(mr_buf *p, const char *name, const char *const *labels, uint64_t v) {
  mr__prom_head(p, name, NULL, labels, NULL, NULL);
  mr_buf_printf(p, "%llu\n", (unsigned long long)v);
}

void mr_hist_init(mr_hist *h, const uint64_t *bounds, uint32_t n, double scale) {
  MR_ASSERT(n >= 1 && n <= MR_HIST_MAX_BUCKETS);
  memset(h, 0, sizeof *h);
  h->n = n;
  h->scale = scale;
  for (uint32_t i = 0; i < n; i++) {
    MR_ASSERT(i == 0 || bounds[i] > bounds[i - 1]);
    h->bounds[i] = bounds[i];
  }
}

void mr_hist_init_latency(mr_hist *h) {
  static const uint64_t us[] = {50,    100,   250,    500,    1000,   2500,   5000,
                                10000, 25000, 50000,  100000, 250000, 500000, 1000000};
  uint64_t ns[sizeof us / sizeof us[0]];
  for (size_t i = 0; i < sizeof us / sizeof us[0]; i++) ns[i] = us[i] * 1000u;
  mr_hist_init(h, ns, (uint32_t)(sizeof us / sizeof us[0]), 1e-9);
}

void mr_hist_observe(mr_hist *h, uint64_t v) {
  uint32_t lo = 0, hi = h->n; /* first bound >= v, or n */
  while (lo < hi) {
    uint32_t mid = (lo + hi) / 2;
    if (h->bounds[mid] >= v) hi = mid;
    else lo = mid + 1;
  }
  __atomic_fetch_add(&h->counts[lo], 1, __ATOMIC_RELAXED);
  __atomic_fetch_add(&h->sum, v, __ATOMIC_RELAXED);
}

void mr_prom_hist(mr_buf *p, const char *name, const char *const *labels, const mr_hist *h) {
  uint64_t cum = 0;
  char le[40];
  for (uint32_t i = 0; i <= h->n; i++) {
    cum += __atomic_load_n(&h->counts[i], __ATOMIC_RELAXED);
    /* 30e9 ns / 1e9 is 30 exactly, 30e9 * 1e-9 is not */
    const double inv = h->scale < 1 ? round(1.0 / h->scale) : 0;
    const bool whole = inv > 0 && fabs(inv * h->scale - 1.0) < 1e-12;
    if (i < h->n) mr__prom_num(le, sizeof le, whole ? (double)h->bounds[i] / inv : (double)h->bounds[i] * h->scale);
    else snprintf(le, sizeof le, "+Inf");
    mr__prom_head(p, name, "_bucket", labels, "le", le);
    mr_buf_printf(p, "%llu\n", (unsigned long long)cum);
  }
  char num[40];
  mr__prom_num(num, sizeof num, (double)__atomic_load_n(&h->sum, __ATOMIC_RELAXED) * h->scale);
  mr__prom_head(p, name, "_sum", labels, NULL, NULL);
  mr__prom_puts(p, num);
  mr__prom_putc(p, '\n');
  mr__prom_head(p, name, "_count", labels, NULL, NULL);
  mr_buf_printf(p, "%llu\n", (unsigned long long)cum);
}
