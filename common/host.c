/*
 * host.c - the host's kernel settings that change moerpc's latency, and the CPU's name.
 *
 * Read once at start-up (the server before it loads, the client when it opens a cluster)
 * and turned into one WARN line per setting that costs moerpc, so that an operator sees
 * it where the cost shows (docs/deploy.md, "Host tuning", has the measurements):
 *
 *   - a KVM guest whose cpuidle haltpoll governor may not poll (guest_halt_poll_ns below
 *     the upstream 200 us): an idle vCPU halts at once, and waking a thread on it is a VM
 *     exit and an interrupt, not a store to a polled flag. A layer call wakes threads on
 *     other CPUs at least three times (the server's gRPC thread, its kernel workers, the
 *     client's waiting thread);
 *   - transparent huge pages "never": weights the engine asks to put in huge pages
 *     (madvise) stay in 4 KiB pages;
 *   - automatic NUMA balancing on a host with more than one node: the kernel unmaps pages
 *     now and then to see which node touches them, and moerpc places its weights itself.
 *
 * Nothing here writes a setting. Reads go through a root directory so that the unit tests
 * can give a made-up sysfs / procfs tree.
 */
#include "common/mr.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* root/rel opened for reading, or NULL: absent, unreadable, or not a regular file (a FIFO
 * or device in a --check-host=DIR tree must not block us; sysfs and procfs files are
 * regular). */
static FILE *open_file(const char *root, const char *rel) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", root, rel);
  int fd;
  mr_err e;
  if (mr_file_open_regular(path, &fd, NULL, &e) != 0) return NULL;
  FILE *f = fdopen(fd, "r");
  if (!f) close(fd);
  return f;
}

/* The first line of root/rel into buf (newline dropped); false when absent or empty. */
static bool read_line(const char *root, const char *rel, char *buf, size_t len) {
  FILE *f = open_file(root, rel);
  if (!f) return false;
  bool ok = fgets(buf, (int)len, f) != NULL;
  fclose(f);
  if (!ok) return false;
  buf[strcspn(buf, "\n")] = '\0';
  return buf[0] != '\0';
}

/* A decimal integer with nothing after it but blanks; false otherwise. */
static bool parse_i64(const char *s, int64_t *v) {
  char *end;
  long long x = strtoll(s, &end, 10);
  if (end == s) return false;
  while (*end == ' ' || *end == '\t') end++;
  if (*end) return false;
  *v = x;
  return true;
}

/* The selected mode of a sysfs choice list ("always [madvise] never" -> "madvise"). */
static void bracketed(const char *s, char *out, size_t len) {
  const char *a = strchr(s, '['), *b = a ? strchr(a, ']') : NULL;
  if (!a || !b) {
    snprintf(out, len, "%.*s", (int)(len - 1), s);
    return;
  }
  snprintf(out, len, "%.*s", (int)(b - a - 1), a + 1);
}

/* Nodes in a sysfs node list ("0", "0-3", "0,2-3"); 0 if it does not parse. */
static uint32_t count_list(const char *s) {
  uint32_t n = 0;
  while (*s) {
    char *end;
    unsigned long a = strtoul(s, &end, 10), b = a;
    if (end == s) return 0;
    if (*end == '-') {
      const char *t = end + 1;
      b = strtoul(t, &end, 10);
      if (end == t || b < a) return 0;
    }
    if (b - a >= 65536) return 0;
    n += (uint32_t)(b - a + 1);
    if (*end == ',') end++;
    else if (*end) return 0;
    s = end;
  }
  return n;
}

static void cpu_model(const char *root, char *buf, size_t len) {
  snprintf(buf, len, "unknown");
  FILE *f = open_file(root, "proc/cpuinfo");
  if (!f) return;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "model name", 10) != 0) continue;
    const char *v = strchr(line, ':');
    if (!v) break;
    v++;
    while (*v == ' ' || *v == '\t') v++;
    size_t n = strcspn(v, "\n\"\\");
    if (n) snprintf(buf, len, "%.*s", (int)n, v);
    break;
  }
  fclose(f);
}

void mr_host_cpu_model(char *buf, size_t len) { cpu_model("", buf, len); }

void mr_host_read(mr_host *h, const char *root) {
  if (!root || !root[0] || strcmp(root, "/") == 0) root = "";
  memset(h, 0, sizeof *h);
  h->halt_poll_ns = -1;
  h->numa_balancing = -1;
  cpu_model(root, h->cpu, sizeof h->cpu);
  char line[256];
  if (read_line(root, "sys/devices/system/cpu/cpuidle/current_driver", line, sizeof line))
    snprintf(h->idle_driver, sizeof h->idle_driver, "%.*s", (int)sizeof h->idle_driver - 1, line);
  /* current_governor exists with cpuidle.governor= switching; _ro otherwise */
  if (read_line(root, "sys/devices/system/cpu/cpuidle/current_governor", line, sizeof line) ||
      read_line(root, "sys/devices/system/cpu/cpuidle/current_governor_ro", line, sizeof line))
    snprintf(h->idle_governor, sizeof h->idle_governor, "%.*s", (int)sizeof h->idle_governor - 1,
             line);
  int64_t v;
  if (read_line(root, "sys/module/haltpoll/parameters/guest_halt_poll_ns", line, sizeof line) &&
      parse_i64(line, &v) && v >= 0)
    h->halt_poll_ns = v;
  if (read_line(root, "sys/kernel/mm/transparent_hugepage/enabled", line, sizeof line))
    bracketed(line, h->thp, sizeof h->thp);
  if (read_line(root, "proc/sys/kernel/numa_balancing", line, sizeof line) && parse_i64(line, &v) &&
      v >= 0 && v <= 255)
    h->numa_balancing = (int)v;
  if (read_line(root, "sys/devices/system/node/online", line, sizeof line))
    h->numa_nodes = count_list(line);
}

uint32_t mr_host_advice(const mr_host *h, char lines[][MR_HOST_LINE]) {
  uint32_t n = 0;
  if (strcmp(h->idle_governor, "haltpoll") == 0 && h->halt_poll_ns >= 0 &&
      h->halt_poll_ns < MR_HOST_HALT_POLL_NS)
    snprintf(lines[n++], MR_HOST_LINE,
             "host: the idle CPUs of this KVM guest halt without polling first "
             "(/sys/module/haltpoll/parameters/guest_halt_poll_ns = %lld, below %d): every "
             "wake-up of a thread on an idle CPU is then a VM exit (measured on such a guest: "
             "40 us against 3 us with polling, and the round trip of a small layer call 115 us "
             "against 34 us); write %d or more there (docs/deploy.md, \"Host tuning\")",
             (long long)h->halt_poll_ns, MR_HOST_HALT_POLL_NS, MR_HOST_HALT_POLL_NS);
  if (strcmp(h->thp, "never") == 0)
    snprintf(lines[n++], MR_HOST_LINE,
             "host: transparent huge pages are off (/sys/kernel/mm/transparent_hugepage/enabled "
             "= never): the weights stay in 4 KiB pages, and every weight read walks more page "
             "tables (measured: decode 8-14%% slower); write madvise there (moerpc asks for huge "
             "pages where it keeps weights) (docs/deploy.md, \"Host tuning\")");
  if (h->numa_balancing > 0 && (h->numa_balancing & 1) && h->numa_nodes > 1)
    snprintf(lines[n++], MR_HOST_LINE,
             "host: automatic NUMA balancing is on (/proc/sys/kernel/numa_balancing = %d) on %u "
             "NUMA nodes: the kernel unmaps pages now and then to see which node touches them "
             "(a fault on the next read of each) while moerpc places its weights on their nodes "
             "itself; sysctl kernel.numa_balancing=0 (docs/deploy.md, \"Host tuning\")",
             h->numa_balancing, h->numa_nodes);
  return n;
}

uint32_t mr_host_report(mr_buf *out, const mr_host *h) {
  char lines[MR_HOST_ADVICE_MAX][MR_HOST_LINE];
  uint32_t n = mr_host_advice(h, lines);
  mr_buf_printf(out, "host: cpu %s; cpuidle driver %s, governor %s", h->cpu,
                h->idle_driver[0] ? h->idle_driver : "unknown",
                h->idle_governor[0] ? h->idle_governor : "unknown");
  if (h->halt_poll_ns >= 0) mr_buf_printf(out, " (guest_halt_poll_ns %lld)", (long long)h->halt_poll_ns);
  mr_buf_printf(out, "; transparent huge pages %s; NUMA balancing ", h->thp[0] ? h->thp : "unknown");
  if (h->numa_balancing >= 0) mr_buf_printf(out, "%d", h->numa_balancing);
  else mr_buf_printf(out, "unknown");
  if (h->numa_nodes) mr_buf_printf(out, " on %u node%s", h->numa_nodes, h->numa_nodes == 1 ? "" : "s");
  mr_buf_printf(out, ": %s\n", n ? "to change:" : "nothing to change");
  for (uint32_t i = 0; i < n; i++) mr_buf_printf(out, "%s\n", lines[i]);
  return n;
}

int mr_host_report_at(mr_buf *out, const char *root, uint32_t *n_advice, mr_err *e) {
  struct stat st;
  if (root && (stat(root, &st) != 0 || !S_ISDIR(st.st_mode)))
    return mr_err_set(e, MR_EINVAL, "%s: not a directory", root);
  mr_host h;
  mr_host_read(&h, root);
  *n_advice = mr_host_report(out, &h);
  if (out->oom) return mr_err_set(e, MR_ENOMEM, "out of memory");
  return 0;
}

void mr_host_render(mr_buf *p) {
  mr_host h;
  mr_host_read(&h, NULL);
  char lines[MR_HOST_ADVICE_MAX][MR_HOST_LINE];
  uint32_t n = mr_host_advice(&h, lines);
  mr_prom_family(p, "moerpc_host_advice", MR_PROM_GAUGE,
                 "Host settings that cost moerpc latency, read at this scrape (moerpc-server "
                 "--check-host names them; docs/deploy.md, Host tuning).");
  mr_prom_u64(p, "moerpc_host_advice", NULL, n);
  char hp[24], nb[8];
  snprintf(hp, sizeof hp, "%lld", (long long)h.halt_poll_ns);
  snprintf(nb, sizeof nb, "%d", h.numa_balancing);
  mr_prom_family(p, "moerpc_host_info", MR_PROM_GAUGE,
                 "Always 1; the labels are the host settings read at this scrape (-1 or empty: "
                 "not there).");
  const char *l[] = {"cpuidle_governor", h.idle_governor, "guest_halt_poll_ns", hp, "thp", h.thp,
                     "numa_balancing", nb, NULL};
  mr_prom_u64(p, "moerpc_host_info", l, 1);
}

void mr_host_check(void) {
  static int logged; /* __atomic: the first caller reads and logs, later ones return */
  if (__atomic_exchange_n(&logged, 1, __ATOMIC_RELAXED)) return;
  mr_host h;
  mr_host_read(&h, NULL);
  char lines[MR_HOST_ADVICE_MAX][MR_HOST_LINE];
  uint32_t n = mr_host_advice(&h, lines);
  for (uint32_t i = 0; i < n; i++) mr_log(MR_LOG_WARN, "%s", lines[i]);
}
