/*
 * main.c - moerpc-server: flags -> es_server_opts -> es_server_new / run / free.
 *
 * Exit codes: 0 after a clean drain, 1 on a runtime failure (or a second signal during the
 * drain), 2 on a usage error, 3 after a drain in which accepted requests went unanswered. Every flag is checked here, in the form it was typed, with a
 * message naming the flag and the limit; the checks that need the model (--experts ids
 * against num_experts, --layers against the MoE layers, --max-tokens against the message
 * size) are made by es_server_new, which reports them as MR_EINVAL, also exit code 2.
 */
#include <errno.h>
#include <stdarg.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "expert_server/es.h"

#define PROG "moerpc-server"

static void usage(FILE *f) {
  fprintf(f,
          "usage: " PROG " --model DIR --experts SPEC [options]\n"
          "\n"
          "Serves the routed experts SPEC of the MoE layers of the model in DIR over gRPC\n"
          "(moerpc.v1.ExpertService: Hello, Forward, Stats; grpc.health.v1.Health/Check).\n"
          "The port answers health while the weights load: service \"moerpc.v1.Liveness\" is\n"
          "SERVING while the process is up; \"\" and \"moerpc.v1.ExpertService\" (readiness) only\n"
          "once every owned expert is loaded, and no more once a drain began.\n"
          "\n"
          "  --model DIR              HF model directory (config.json + *.safetensors)\n"
          "  --experts SPEC           experts served in every served layer: \"all\" or ids and\n"
          "                           ranges, e.g. 0-7,12\n"
          "  --layers SPEC            layers served (default all = every MoE layer)\n"
          "  --listen HOST:PORT       address to listen on (default " ES_DEFAULT_LISTEN
          "; [v6]:PORT for IPv6;\n"
          "                           port 0 = any free port, logged at start)\n"
          "  --threads N              kernel worker threads, 0 = one per core (default 0)\n"
          "  --weight-cache DIR       packed-weight cache: map DIR's packed weights when they\n"
          "                           were made for this model, format, CPU layout, NUMA split\n"
          "                           and owned set, else pack from the model and write them\n"
          "                           there once serving (docs/DESIGN.md section 23)\n"
          "  --verify-cache           check the cache's checksums before readiness (default:\n"
          "                           in the background once serving)\n"
          "  --map-weights            serve the experts in place from the model's files (read-\n"
          "                           only mapping, no copy) when they are stored as served\n"
          "                           (bf16/f16/f32, or fp8 codes with their block scales; no\n"
          "                           --quant, one NUMA node): ready after one finite-check\n"
          "                           read, and the page cache is the only copy.\n"
          "                           The files must not change while serving (a rewrite in\n"
          "                           place is SIGBUS or wrong weights) and their pages can be\n"
          "                           evicted under memory pressure. Not with --weight-cache\n"
          "                           (nothing to cache); otherwise packed as usual\n"
          "  --numa auto|N|LIST       NUMA nodes: auto, a node count, or a list like 0,1 (default auto)\n"
          "  --max-tokens N           most tokens in one request, 1..%u (default %u)\n"
          "  --quant FMT              weight format: bf16|f16|f32|int8|int4|fp8 (default: as\n"
          "                           stored; fp8 = fp8-b128, e4m3 with 128x128 block scales: an\n"
          "                           FP8 checkpoint (quantization_config fp8) keeps its codes,\n"
          "                           a float one is quantized at load (for benchmarks); an FP8\n"
          "                           checkpoint with bf16|int8|int4 is dequantized and\n"
          "                           re-quantized at load)\n"
          "  --group N                int4 group size along K: 32|64|128 (default %u; int4 only)\n"
          "  --grpc-threads N         gRPC completion-queue threads, 1..%u (default 1)\n"
          "  --drain-timeout-ms N     on SIGTERM/SIGINT, how long to wait for accepted requests,\n"
          "                           0..%u (default %u)\n"
          "  --max-inflight-bytes N   bytes held for requests and unsent replies, server-wide;\n"
          "                           past it streams wait under flow control (default auto: a\n"
          "                           quarter of the memory available after loading, 256 MiB..8 GiB;\n"
          "                           suffixes K, M, G)\n"
          "  --max-streams N          Forward streams open at once, 1..%u (default auto: one\n"
          "                           per 4 MiB of the budget, %u..%u); more get\n"
          "                           RESOURCE_EXHAUSTED. Each open stream's HTTP/2 window (an\n"
          "                           eighth of budget / N, 64 KiB..1 MiB) and state count\n"
          "                           in the budget\n"
          "  --stall-timeout-ms N     cut a stream whose client has not read a reply for this\n"
          "                           long, 0..%u, 0 = never (default %u)\n"
          "  --tls-cert FILE          serve TLS with this PEM certificate chain (needs --tls-key)\n"
          "  --tls-key FILE           the PEM private key of --tls-cert\n"
          "  --tls-client-ca FILE     mTLS: require a client certificate signed by these PEM roots\n"
          "  --auth-token-file FILE   require \"authorization: Bearer <token>\" on Hello, Stats and\n"
          "                           Forward; FILE holds the token (1..%d printable bytes, one\n"
          "                           trailing newline allowed); health stays open. Also\n"
          "                           enables the control RPCs LoadExperts / LoadStatus /\n"
          "                           UnloadExperts (live placement, moerpc-place apply), which\n"
          "                           are refused PERMISSION_DENIED without it\n"
          "  --max-expert-memory N    refuse a LoadExperts that would make the packed expert\n"
          "                           weights exceed N bytes (suffixes K, M, G; default: only\n"
          "                           MemAvailable minus 512 MiB limits it)\n"
          "  --unload-grace S         an UnloadExperts takes the pairs out of Hello at once but\n"
          "                           serves them on until no open Forward stream has used them,\n"
          "                           at most S seconds, 0..%u (default %u; 0 = free at once)\n"
          "  --insecure               allow plaintext on a non-loopback --listen address (without\n"
          "                           it, only 127.0.0.0/8, ::1 and localhost serve plaintext)\n"
          "  --metrics-listen HOST:PORT  serve Prometheus metrics at http://HOST:PORT/metrics\n"
          "                           (default off; PORT alone binds 127.0.0.1; port 0 = any\n"
          "                           free port, logged at start); up before the weights load,\n"
          "                           with the loading progress; also /healthz and /readyz\n"
          "  --metrics-token-file FILE  /metrics requires \"Authorization: Bearer <token>\" (the\n"
          "                           token in FILE); /healthz and /readyz stay open. Without it\n"
          "                           a non-loopback --metrics-listen is logged at WARN\n"
          "  --log-level L            error|warn|info|debug (default info, or env MOERPC_LOG)\n"
          "  --check-host[=DIR]       print the host settings that change moerpc's latency\n"
          "                           (cpuidle halt polling on a VM, transparent huge pages,\n"
          "                           NUMA balancing) and what to change, then exit: 0 when\n"
          "                           nothing, 1 otherwise (docs/deploy.md, \"Host tuning\");\n"
          "                           DIR: read DIR/sys and DIR/proc (an image). The server\n"
          "                           logs the same advice as WARN lines at start\n"
          "  --help                   this text\n"
          "\n"
          "Environment (kernels/README.md): MOERPC_ISA=ref|avx2|avx512|amx picks the kernels'\n"
          "instruction set (one this CPU lacks is refused; default: the best it has whose\n"
          "kernels pass the start-up self-test);\n"
          "MOERPC_SPIN_US=N, 0..100000, how long idle engine threads spin before sleeping\n"
          "(default 50): a server on cores of its own can spin through the client's time\n"
          "between calls and skip the threads' wake-ups; one sharing the client's cores\n"
          "would take them from the client (docs/BENCHMARKS.md, \"Where a same-core layer's\n"
          "0.5 ms goes\"); MOERPC_AMX_MIN_TOKENS, MOERPC_SELFTEST=on|off.\n"
          "\n"
          "Exit status: 0 after a clean drain, 1 on a runtime failure or a second signal during\n"
          "the drain, 2 on a usage error, 3 after a drain that left accepted requests unanswered.\n",
          ES_MAX_MAX_TOKENS, ES_DEFAULT_MAX_TOKENS, ES_DEFAULT_GROUP, ES_MAX_GRPC_THREADS,
          ES_MAX_DRAIN_TIMEOUT_MS, ES_DEFAULT_DRAIN_TIMEOUT_MS, ES_MAX_MAX_STREAMS,
          ES_AUTO_STREAMS_MIN, ES_AUTO_STREAMS_MAX, ES_MAX_STALL_TIMEOUT_MS, ES_DEFAULT_STALL_TIMEOUT_MS,
          MR_SECRET_MAX_BYTES, ES_MAX_UNLOAD_GRACE_S, ES_DEFAULT_UNLOAD_GRACE_S);
}

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_error(const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, PROG ": ");
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n(see " PROG " --help)\n");
  return 2;
}

/* Parses a byte count with an optional K/M/G suffix (powers of 1024) in lo..hi. */
static bool parse_bytes(const char *flag, const char *s, uint64_t lo, uint64_t hi, uint64_t *out) {
  char *end = NULL;
  errno = 0;
  if (!s[0] || s[0] == '-' || s[0] == '+' || s[0] == ' ') goto bad;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno) goto bad;
  unsigned shift = 0;
  if (*end == 'K' || *end == 'k') shift = 10;
  else if (*end == 'M' || *end == 'm') shift = 20;
  else if (*end == 'G' || *end == 'g') shift = 30;
  if (shift) end++;
  if (*end || (shift && v > (UINT64_MAX >> shift))) goto bad;
  v <<= shift;
  if (v < lo || v > hi) {
    usage_error("%s %s: must be in %" PRIu64 "..%" PRIu64 " bytes", flag, s, lo, hi);
    return false;
  }
  *out = v;
  return true;
bad:
  usage_error("%s \"%s\": must be a byte count like 1073741824, 512M or 4G", flag, s);
  return false;
}

/* Parses a decimal number in lo..hi for flag; returns false after printing the error. */
static bool parse_u32(const char *flag, const char *s, uint32_t lo, uint32_t hi, uint32_t *out) {
  char *end = NULL;
  errno = 0;
  if (!s[0] || s[0] == '-' || s[0] == '+' || s[0] == ' ') goto bad;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || *end) goto bad;
  if (v < lo || v > hi) {
    usage_error("%s %s: must be in %" PRIu32 "..%" PRIu32, flag, s, lo, hi);
    return false;
  }
  *out = (uint32_t)v;
  return true;
bad:
  usage_error("%s \"%s\": not a number, must be a decimal integer in %" PRIu32 "..%" PRIu32, flag, s,
              lo, hi);
  return false;
}

/* HOST:PORT or [V6]:PORT, port 0..65535. gRPC resolves the host when binding. */
static bool check_listen(const char *s, const char *flag) {
  const char *colon;
  if (s[0] == '[') {
    const char *close = strchr(s, ']');
    if (!close || close == s + 1 || close[1] != ':') {
      usage_error("%s \"%s\": must be HOST:PORT or [IPV6]:PORT", flag, s);
      return false;
    }
    colon = close + 1;
  } else {
    colon = strrchr(s, ':');
    if (!colon || colon == s) {
      usage_error("%s \"%s\": must be HOST:PORT (e.g. 127.0.0.1:50051)", flag, s);
      return false;
    }
  }
  uint32_t port;
  char what[64];
  snprintf(what, sizeof what, "%s port", flag);
  return parse_u32(what, colon + 1, 0, 65535, &port);
}

/* auto, a node count (1..1024), or a list of node ids with at least one comma or range. */
static bool check_numa(const char *s) {
  if (strcmp(s, "auto") == 0) return true;
  if (!strpbrk(s, ",-")) {
    uint32_t n;
    return parse_u32("--numa", s, 1, 1024, &n);
  }
  mr_idset set;
  mr_err e;
  if (mr_idset_parse(&set, s, 1024, "--numa", &e) != 0) {
    usage_error("%s (a node list is ids/ranges below 1024, e.g. 0,1)", e.msg);
    return false;
  }
  uint32_t n = mr_idset_count(&set);
  mr_idset_close(&set);
  if (n == 0) {
    usage_error("--numa \"%s\": lists no node", s);
    return false;
  }
  return true;
}

enum {
  OPT_MODEL = 1000, OPT_LISTEN, OPT_EXPERTS, OPT_LAYERS, OPT_THREADS, OPT_MAX_TOKENS, OPT_QUANT,
  OPT_GROUP, OPT_NUMA, OPT_GRPC_THREADS, OPT_DRAIN, OPT_LOG_LEVEL, OPT_TLS_CERT, OPT_TLS_KEY,
  OPT_TLS_CLIENT_CA, OPT_AUTH_TOKEN_FILE, OPT_INSECURE, OPT_HELP, OPT_MAX_INFLIGHT, OPT_MAX_EXPERT_MEMORY,
  OPT_MAX_STREAMS, OPT_STALL, OPT_METRICS_LISTEN, OPT_METRICS_TOKEN, OPT_UNLOAD_GRACE,
  OPT_WEIGHT_CACHE, OPT_VERIFY_CACHE, OPT_MAP_WEIGHTS, OPT_CHECK_HOST
};

/* --check-host[=DIR]: the host's settings and the advice they get (common/host.c), on
 * stdout; exit 0 when there is nothing to change, 1 otherwise. DIR: read DIR/sys and
 * DIR/proc (a chroot or an image) instead of the running host's. */
static int check_host(const char *root) {
  mr_buf out;
  mr_buf_init(&out);
  uint32_t n = 0;
  mr_err e;
  int rc = mr_host_report_at(&out, root, &n, &e);
  if (rc == 0) fputs(out.buf, stdout);
  mr_buf_close(&out);
  if (rc == MR_EINVAL) return usage_error("--check-host=%s", e.msg);
  if (rc) fprintf(stderr, PROG ": --check-host: %s\n", e.msg);
  return rc || n ? 1 : 0;
}

int main(int argc, char **argv) {
  static const struct option longopts[] = {
      {"model", required_argument, NULL, OPT_MODEL},
      {"listen", required_argument, NULL, OPT_LISTEN},
      {"experts", required_argument, NULL, OPT_EXPERTS},
      {"layers", required_argument, NULL, OPT_LAYERS},
      {"threads", required_argument, NULL, OPT_THREADS},
      {"max-tokens", required_argument, NULL, OPT_MAX_TOKENS},
      {"quant", required_argument, NULL, OPT_QUANT},
      {"group", required_argument, NULL, OPT_GROUP},
      {"numa", required_argument, NULL, OPT_NUMA},
      {"grpc-threads", required_argument, NULL, OPT_GRPC_THREADS},
      {"drain-timeout-ms", required_argument, NULL, OPT_DRAIN},
      {"max-inflight-bytes", required_argument, NULL, OPT_MAX_INFLIGHT},
      {"max-expert-memory", required_argument, NULL, OPT_MAX_EXPERT_MEMORY},
      {"max-streams", required_argument, NULL, OPT_MAX_STREAMS},
      {"stall-timeout-ms", required_argument, NULL, OPT_STALL},
      {"unload-grace", required_argument, NULL, OPT_UNLOAD_GRACE},
      {"log-level", required_argument, NULL, OPT_LOG_LEVEL},
      {"metrics-listen", required_argument, NULL, OPT_METRICS_LISTEN},
      {"metrics-token-file", required_argument, NULL, OPT_METRICS_TOKEN},
      {"weight-cache", required_argument, NULL, OPT_WEIGHT_CACHE},
      {"verify-cache", no_argument, NULL, OPT_VERIFY_CACHE},
      {"map-weights", no_argument, NULL, OPT_MAP_WEIGHTS},
      {"tls-cert", required_argument, NULL, OPT_TLS_CERT},
      {"tls-key", required_argument, NULL, OPT_TLS_KEY},
      {"tls-client-ca", required_argument, NULL, OPT_TLS_CLIENT_CA},
      {"auth-token-file", required_argument, NULL, OPT_AUTH_TOKEN_FILE},
      {"insecure", no_argument, NULL, OPT_INSECURE},
      {"help", no_argument, NULL, OPT_HELP},
      {"check-host", optional_argument, NULL, OPT_CHECK_HOST},
      {NULL, 0, NULL, 0},
  };
  es_server_opts o;
  es_server_opts_init(&o);
  bool group_set = false;
  mr_log_set_component("server");
  opterr = 0;
  for (;;) {
    int longidx = 0;
    int c = getopt_long(argc, argv, ":", longopts, &longidx);
    if (c == -1) break;
    switch (c) {
    case OPT_MODEL: o.model_dir = optarg; break;
    case OPT_LISTEN:
      if (!check_listen(optarg, "--listen")) return 2;
      o.listen = optarg;
      break;
    case OPT_EXPERTS: o.experts = optarg; break;
    case OPT_LAYERS: o.layers = optarg; break;
    case OPT_THREADS:
      if (!parse_u32("--threads", optarg, 0, ES_MAX_THREADS, &o.threads)) return 2;
      break;
    case OPT_MAX_TOKENS:
      if (!parse_u32("--max-tokens", optarg, 1, ES_MAX_MAX_TOKENS, &o.max_tokens)) return 2;
      break;
    case OPT_QUANT:
      if (kn_format_parse(optarg, &o.quant) != 0)
        return usage_error("--quant \"%s\": must be bf16, f16, f32, int8, int4 or fp8", optarg);
      o.quant_set = true;
      break;
    case OPT_GROUP:
      if (!parse_u32("--group", optarg, 32, 128, &o.group)) return 2;
      if (o.group != 32 && o.group != 64 && o.group != 128)
        return usage_error("--group %s: must be 32, 64 or 128", optarg);
      group_set = true;
      break;
    case OPT_NUMA:
      if (!check_numa(optarg)) return 2;
      o.numa = optarg;
      break;
    case OPT_GRPC_THREADS:
      if (!parse_u32("--grpc-threads", optarg, 1, ES_MAX_GRPC_THREADS, &o.grpc_threads)) return 2;
      break;
    case OPT_DRAIN:
      if (!parse_u32("--drain-timeout-ms", optarg, 0, ES_MAX_DRAIN_TIMEOUT_MS, &o.drain_timeout_ms))
        return 2;
      break;
    case OPT_MAX_EXPERT_MEMORY:
      if (!parse_bytes("--max-expert-memory", optarg, 1, (uint64_t)1 << 50, &o.max_expert_memory))
        return 2;
      break;
    case OPT_MAX_INFLIGHT:
      if (!parse_bytes("--max-inflight-bytes", optarg, (uint64_t)1 << 20, (uint64_t)1 << 50,
                       &o.max_inflight_bytes))
        return 2;
      break;
    case OPT_MAX_STREAMS:
      if (!parse_u32("--max-streams", optarg, 1, ES_MAX_MAX_STREAMS, &o.max_streams)) return 2;
      break;
    case OPT_STALL:
      if (!parse_u32("--stall-timeout-ms", optarg, 0, ES_MAX_STALL_TIMEOUT_MS, &o.stall_timeout_ms))
        return 2;
      break;
    case OPT_UNLOAD_GRACE:
      if (!parse_u32("--unload-grace", optarg, 0, ES_MAX_UNLOAD_GRACE_S, &o.unload_grace_s))
        return 2;
      break;
    case OPT_METRICS_LISTEN: /* a port alone binds loopback (common/http.c) */
      if (strspn(optarg, "0123456789") != strlen(optarg) && !check_listen(optarg, "--metrics-listen")) return 2;
      if (!optarg[0] || (strspn(optarg, "0123456789") == strlen(optarg) && (strlen(optarg) > 5 || atoi(optarg) > 65535)))
        return usage_error("--metrics-listen \"%s\": a port must be 0..65535", optarg);
      o.metrics_listen = optarg;
      break;
    case OPT_LOG_LEVEL: {
      int level;
      if (mr_log_parse_level(optarg, &level) != 0)
        return usage_error("--log-level \"%s\": must be error, warn, info or debug", optarg);
      mr_log_set_level(level);
      break;
    }
    case OPT_TLS_CERT: o.tls_cert = optarg; break;
    case OPT_TLS_KEY: o.tls_key = optarg; break;
    case OPT_TLS_CLIENT_CA: o.tls_client_ca = optarg; break;
    case OPT_AUTH_TOKEN_FILE: o.auth_token_file = optarg; break;
    case OPT_METRICS_TOKEN: o.metrics_token_file = optarg; break;
    case OPT_WEIGHT_CACHE: o.weight_cache = optarg; break;
    case OPT_VERIFY_CACHE: o.verify_cache = true; break;
    case OPT_MAP_WEIGHTS: o.map_weights = true; break;
    case OPT_INSECURE: o.insecure = true; break;
    case OPT_HELP: usage(stdout); return 0;
    case OPT_CHECK_HOST: return check_host(optarg);
    case ':': return usage_error("%s needs a value", argv[optind - 1]);
    default: return usage_error("unknown option \"%s\"", argv[optind - 1]);
    }
  }
  if (optind < argc) return usage_error("unexpected argument \"%s\"", argv[optind]);
  if (!o.model_dir) return usage_error("--model DIR is required");
  if (!o.experts) return usage_error("--experts SPEC is required (\"all\" or ids like 0-7,12)");
  if (o.verify_cache && !o.weight_cache) return usage_error("--verify-cache needs --weight-cache DIR");
  if (o.map_weights && o.weight_cache)
    return usage_error("--map-weights serves the model's files in place: there is nothing for "
                       "--weight-cache DIR to hold; give one of the two");
  if (group_set && !(o.quant_set && o.quant == KN_FMT_INT4))
    return usage_error("--group applies to --quant int4 only");

  mr_host_check(); /* a WARN line per host setting that costs the round trips */
  mr_err e;
  mr_err_clear(&e);
  es_server *s = NULL;
  int rc = es_server_new(&s, &o, &e);
  if (rc == MR_EINVAL) return usage_error("%s", e.msg);
  if (rc) {
    mr_log(MR_LOG_ERROR, "cannot start: %s (%s)", e.msg, mr_err_name(rc));
    return 1;
  }
  rc = es_server_run(s, &e);
  if (rc == MR_ECANCELED) {
    /* A second signal: exit now, without waiting for anything (es.h). */
    fflush(NULL);
    _exit(1);
  }
  if (rc) mr_log(MR_LOG_ERROR, "serving failed: %s (%s)", e.msg, mr_err_name(rc));
  uint64_t lost = rc ? 0 : es_server_unanswered(s);
  es_server_free(s);
  return rc ? 1 : lost ? 3 : 0;
}
