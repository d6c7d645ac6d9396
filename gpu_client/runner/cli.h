/*
 * gpu_client/runner/cli.h - the subcommands of moerpc-client that live outside main.c
 * (cli_model.c: the whole-model runner's generate / logits / bench; cli_serve.c: serve;
 * cli_text.c: tokenize / detokenize / chat-template). Each takes the
 * subcommand's argv (argv[0] = its name) and returns the exit status (0 ok, 1 failure,
 * 2 usage error).
 */
#ifndef GC_CLI_H
#define GC_CLI_H

#include <getopt.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu_client/runner/model.h"
#include "gpu_client/runner/text.h"

int gc__cli_generate(int argc, char **argv);
int gc__cli_logits(int argc, char **argv);
int gc__cli_bench(int argc, char **argv);
int gc__cli_serve(int argc, char **argv);
/* cli_text.c: the text tools (no weights loaded) */
int gc__cli_tokenize(int argc, char **argv);
int gc__cli_detokenize(int argc, char **argv);
int gc__cli_chat_template(int argc, char **argv);
/* One flag of a subcommand: 1 = taken, 0 = not this handler's, -1 = bad value (printed). */
typedef int (*gc__cli_opt_fn)(void *ctx, int opt, const char *arg);
/* getopt_long over argv[1..] (argv[0] is the subcommand): each flag goes to first, then to
 * second when first does not take it. help_opt prints help (0 or 3 strings, NULL-free)
 * and returns 1; a bad, incomplete or unknown flag or a stray argument prints one line
 * naming it and returns 2; otherwise 0. */
int gc__cli_getopt(int argc, char **argv, const struct option *lo, int help_opt,
                   const char *const help[3], gc__cli_opt_fn first, void *first_ctx,
                   gc__cli_opt_fn second, void *second_ctx);
/* Parses flag's value s as a decimal integer in lo..hi into *out; otherwise prints
 * "moerpc-client: FLAG = \"S\", must be an integer in LO..HI" and returns false. */
bool gc__cli_u64(const char *flag, const char *s, uint64_t lo, uint64_t hi, uint64_t *out);
bool gc__cli_u32(const char *flag, const char *s, uint32_t lo, uint32_t hi, uint32_t *out);
/* ---- the flags every model subcommand takes (cli_model.c) ------------------------------------
 *
 * A subcommand lists MODEL_OPTIONS and its own entries in its getopt table, starts from
 * gc__cli_init, and parses with gc__cli_parse: the model's flags (and generate's sampling
 * and text flags) land in gc__mcli; any other option goes to own(ctx, opt, arg), which
 * returns 1 taken, 0 unknown, -1 bad value (after printing why). Own options use values
 * from 3000 on. */
#define CLI_MAX_TEXTS 256u
enum {
  MO_MODEL = 2000, MO_CLUSTER, MO_PLACEMENT, MO_LOCAL, MO_DEFER, MO_MAXSEQ, MO_BATCH,
  MO_THREADS, MO_ISA, MO_NUMA, MO_FORMAT, MO_DENSE, MO_WIRE, MO_DEADLINE, MO_CONNECT, MO_LOG,
  MO_QUIET, MO_HELP, MO_PROMPT, MO_MAXNEW, MO_TEMP, MO_TOPP, MO_SEED, MO_IDS, MO_OUT, MO_JSON,
  MO_PLEN, MO_DECODE, MO_REPEATS, MO_COMPARE, MO_METRICS, MO_RWINDOW, MO_RSTATS, MO_WATCH,
  MO_BACKEND, MO_DEVICE, MO_TP, MO_TEXT, MO_CHAT, MO_SYSTEM, MO_STOP, MO_TEMPLATE, MO_TOPK,
  MO_MAP, MO_SPIN
};

#define MODEL_OPTIONS                                                                    \
  {"model", required_argument, NULL, MO_MODEL},                                          \
      {"cluster", required_argument, NULL, MO_CLUSTER},                                  \
      {"placement", required_argument, NULL, MO_PLACEMENT},                              \
      {"watch-placement", no_argument, NULL, MO_WATCH},                                  \
      {"local-experts", required_argument, NULL, MO_LOCAL},                              \
      {"max-deferred", required_argument, NULL, MO_DEFER},                               \
      {"max-seq", required_argument, NULL, MO_MAXSEQ},                                   \
      {"threads", required_argument, NULL, MO_THREADS},                                  \
      {"backend", required_argument, NULL, MO_BACKEND},                                  \
      {"device", required_argument, NULL, MO_DEVICE},                                    \
      {"tp", required_argument, NULL, MO_TP},                                            \
      {"isa", required_argument, NULL, MO_ISA},                                          \
      {"numa", required_argument, NULL, MO_NUMA},                                        \
      {"format", required_argument, NULL, MO_FORMAT},                                    \
      {"map-weights", no_argument, NULL, MO_MAP},                                        \
      {"dense-format", required_argument, NULL, MO_DENSE},                               \
      {"wire", required_argument, NULL, MO_WIRE},                                        \
      {"deadline-ms", required_argument, NULL, MO_DEADLINE},                             \
      {"connect-timeout-ms", required_argument, NULL, MO_CONNECT},                       \
      {"wait-spin-us", required_argument, NULL, MO_SPIN},                                \
      {"log", required_argument, NULL, MO_LOG}, {"quiet", no_argument, NULL, MO_QUIET},  \
      {"metrics-listen", required_argument, NULL, MO_METRICS},                           \
      {"routing-window", required_argument, NULL, MO_RWINDOW},                           \
      {"routing-stats", required_argument, NULL, MO_RSTATS},                             \
      {"help", no_argument, NULL, MO_HELP}

typedef struct gc__mcli {
  gc_model_opts mo;
  const char *prompt, *ids, *out, *compare;
  const char *texts[CLI_MAX_TEXTS], *chats[CLI_MAX_TEXTS], *stops[GC_TEXT_MAX_STOPS];
  uint32_t n_texts, n_chats, n_stops;
  const char *system, *chat_template;
  uint32_t batch, max_new, prompt_len, decode, repeats;
  bool batch_set, json;
  gc_sampling smp;
  const char *metrics_listen; /* --metrics-listen, NULL = off */
  const char *routing_stats;  /* --routing-stats FILE, NULL = off */
} gc__mcli;
extern const char gc__cli_model_help[];

void gc__cli_init(gc__mcli *c);
/* getopt_long over argv: 0 = run, 1 = --help printed (usage, own_help, the model flags),
 * 2 = usage error (printed). */
int gc__cli_parse(int argc, char **argv, const struct option *lo, const char *usage, const char *own_help,
                  gc__mcli *c, int (*own)(void *ctx, int opt, const char *arg), void *ctx);
/* Opens the model of c (printing the error); with --metrics-listen, starts its responder. */
int gc__cli_open_model(gc__mcli *c, gc_model **m);
/* Writes --routing-stats, stops the responder, closes m (NULL is fine); 0, or 1 on failure. */
int gc__cli_close_model(const gc__mcli *c, gc_model *m);
/* GET /routing (moerpc-stats JSON of the routing window) and GET /placement on h. */
int gc__cli_model_routes(mr_http_server *h, gc_model *m, mr_err *e);

#endif /* GC_CLI_H */
