/*
 * test_host.c - common/host.c: the host settings read from made-up sysfs / procfs trees
 * (every file absent, malformed, or as a KVM guest, a bare-metal host and a multi-node host
 * write it), the advice each setting gets and the ones that get none, and the real host's
 * read (whatever it holds, the CPU's name is known and the advice agrees with the fields).
 */
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/mr.h"
#include "tests/unit/mt.h"

static char root[64];

static void root_cleanup(void) {
  char cmd[96];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
  if (root[0] && system(cmd) != 0) fprintf(stderr, "cleanup of %s failed\n", root);
  root[0] = '\0';
}

/* A fresh empty tree; returns its path. */
static const char *tree(void) {
  if (root[0]) root_cleanup();
  snprintf(root, sizeof root, "/tmp/mr-test-host-XXXXXX");
  MT_TRUE(mkdtemp(root) != NULL);
  mt_defer(root_cleanup);
  return root;
}

/* Writes root/rel (making its folders) with text. */
static void put(const char *rel, const char *text) {
  char path[256];
  snprintf(path, sizeof path, "%s/%s", root, rel);
  for (char *p = path + strlen(root) + 1; (p = strchr(p, '/')); p++) {
    *p = '\0';
    (void)mkdir(path, 0755);
    *p = '/';
  }
  FILE *f = fopen(path, "w");
  MT_TRUE(f != NULL);
  fputs(text, f);
  fclose(f);
}

/* What a KVM guest like the project's CI host shows. */
static void kvm_guest(const char *poll_ns) {
  put("proc/cpuinfo", "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) "
                      "Processor\nflags\t\t: fpu\n\nprocessor\t: 1\nmodel name\t: Intel(R) Xeon(R) Processor\n");
  put("sys/devices/system/cpu/cpuidle/current_driver", "haltpoll\n");
  put("sys/devices/system/cpu/cpuidle/current_governor", "haltpoll\n");
  put("sys/module/haltpoll/parameters/guest_halt_poll_ns", poll_ns);
  put("sys/kernel/mm/transparent_hugepage/enabled", "always [madvise] never\n");
  put("proc/sys/kernel/numa_balancing", "0\n");
  put("sys/devices/system/node/online", "0\n");
}

MT_TEST(empty_tree_is_all_unknown_and_no_advice) {
  mr_host h;
  mr_host_read(&h, tree());
  MT_EQ_STR(h.cpu, "unknown");
  MT_EQ_STR(h.idle_driver, "");
  MT_EQ_STR(h.idle_governor, "");
  MT_EQ_INT(h.halt_poll_ns, -1);
  MT_EQ_STR(h.thp, "");
  MT_EQ_INT(h.numa_balancing, -1);
  MT_EQ_U64(h.numa_nodes, 0);
  char lines[MR_HOST_ADVICE_MAX][MR_HOST_LINE];
  MT_EQ_U64(mr_host_advice(&h, lines), 0);
}

MT_TEST(kvm_guest_that_halts_at_once_gets_the_halt_poll_advice) {
  tree();
  kvm_guest("0\n");
  mr_host h;
  mr_host_read(&h, root);
  MT_EQ_STR(h.cpu, "Intel(R) Xeon(R) Processor");
  MT_EQ_STR(h.idle_driver, "haltpoll");
  MT_EQ_STR(h.idle_governor, "haltpoll");
  MT_EQ_INT(h.halt_poll_ns, 0);
  MT_EQ_STR(h.thp, "madvise");
  MT_EQ_INT(h.numa_balancing, 0);
  MT_EQ_U64(h.numa_nodes, 1);
  char lines[MR_HOST_ADVICE_MAX][MR_HOST_LINE];
  MT_EQ_U64(mr_host_advice(&h, lines), 1);
  MT_CONTAINS(lines[0], "/sys/module/haltpoll/parameters/guest_halt_poll_ns = 0, below 200000");
  MT_CONTAINS(lines[0], "write 200000 or more");
  MT_CONTAINS(lines[0], "Host tuning");
  /* Just below the limit still halts too soon; at it, and above, nothing to say. */
  kvm_guest("199999");
  mr_host_read(&h, root);
  MT_EQ_U64(mr_host_advice(&h, lines), 1);
  MT_CONTAINS(lines[0], "= 199999, below 200000");
  kvm_guest("200000\n");
  mr_host_read(&h, root);
  MT_EQ_INT(h.halt_poll_ns, 200000);
  MT_EQ_U64(mr_host_advice(&h, lines), 0);
  kvm_guest("1000000\n");
  mr_host_read(&h, root);
  MT_EQ_U64(mr_host_advice(&h, lines), 0);
}

MT_TEST(halt_poll_limit_matters_only_under_the_haltpoll_governor) {
  tree();
  kvm_guest("0\n");
  /* menu governor: guest_halt_poll_ns is not what decides (the module may still be loaded) */
  put("sys/devices/system/cpu/cpuidle/current_governor", "menu\n");
  mr_host h;
  mr_host_read(&h, root);
  MT_EQ_STR(h.idle_governor, "menu");
  char lines[MR_HOST_ADVICE_MAX][MR_HOST_LINE];
  MT_EQ_U64(mr_host_advice(&h, lines), 0);
  /* kernels without governor switching have only current_governor_ro */
  tree();
  kvm_guest("0\n");
  char gov[256];
  snprintf(gov, sizeof gov, "%s/sys/devices/system/cpu/cpuidle/current_governor", root);
  MT_EQ_INT(unlink(gov), 0);
  put("sys/devices/system/cpu/cpuidle/current_governor_ro", "haltpoll\n");
  mr_host_read(&h, root);
  MT_EQ_STR(h.idle_governor, "haltpoll");
  MT_EQ_U64(mr_host_advice(&h, lines), 1);
}

MT_TEST(bare_metal_host_gets_no_advice) {
  tree();
  put("proc/cpuinfo", "model name\t: AMD EPYC 9654 96-Core Processor\n");
  put("sys/devices/system/cpu/cpuidle/current_driver", "acpi_idle\n");
  put("sys/devices/system/cpu/cpuidle/current_governor_ro", "menu\n");
  put("sys/kernel/mm/transparent_hugepage/enabled", "[always] madvise never\n");
  put("proc/sys/kernel/numa_balancing", "0\n");
  put("sys/devices/system/node/online", "0-1\n");
  mr_host h;
  mr_host_read(&h, root);
  MT_EQ_STR(h.cpu, "AMD EPYC 9654 96-Core Processor");
  MT_EQ_STR(h.thp, "always");
  MT_EQ_U64(h.numa_nodes, 2);
  char lines[MR_HOST_ADVICE_MAX][MR_HOST_LINE];
  MT_EQ_U64(mr_host_advice(&h, lines), 0);
}

MT_TEST(thp_never_and_numa_balancing_on_many_nodes_get_advice) {
  tree();
  kvm_guest("0\n");
  put("sys/kernel/mm/transparent_hugepage/enabled", "always madvise [never]\n");
  put("proc/sys/kernel/numa_balancing", "1\n");
  put("sys/devices/system/node/online", "0-3,6\n");
  mr_host h;
  mr_host_read(&h, root);
  MT_EQ_STR(h.thp, "never");
  MT_EQ_INT(h.numa_balancing, 1);
  MT_EQ_U64(h.numa_nodes, 5);
  char lines[MR_HOST_ADVICE_MAX][MR_HOST_LINE];
  MT_EQ_U64(mr_host_advice(&h, lines), 3);
  MT_CONTAINS(lines[0], "guest_halt_poll_ns");
  MT_CONTAINS(lines[1], "transparent_hugepage/enabled = never");
  MT_CONTAINS(lines[1], "write madvise there");
  MT_CONTAINS(lines[2], "numa_balancing = 1) on 5 NUMA nodes");
  MT_CONTAINS(lines[2], "sysctl kernel.numa_balancing=0");
  for (int i = 0; i < 3; i++) MT_TRUE(strlen(lines[i]) < MR_HOST_LINE - 1); /* not cut short */
  /* memory tiering alone (2) is not the balancing that samples pages; 3 is both */
  put("proc/sys/kernel/numa_balancing", "2\n");
  mr_host_read(&h, root);
  MT_EQ_U64(mr_host_advice(&h, lines), 2);
  put("proc/sys/kernel/numa_balancing", "3\n");
  mr_host_read(&h, root);
  MT_EQ_U64(mr_host_advice(&h, lines), 3);
  /* one node: nothing to balance */
  put("sys/devices/system/node/online", "0\n");
  mr_host_read(&h, root);
  MT_EQ_U64(mr_host_advice(&h, lines), 2);
}

MT_TEST(malformed_files_are_unknown_not_advice) {
  tree();
  kvm_guest("lots\n");
  put("proc/sys/kernel/numa_balancing", "1x\n");
  put("sys/devices/system/node/online", "3-1\n");
  put("sys/kernel/mm/transparent_hugepage/enabled", "\n");
  put("proc/cpuinfo", "model name\t:\n");
  mr_host h;
  mr_host_read(&h, root);
  MT_EQ_INT(h.halt_poll_ns, -1);
  MT_EQ_INT(h.numa_balancing, -1);
  MT_EQ_U64(h.numa_nodes, 0);
  MT_EQ_STR(h.thp, "");
  MT_EQ_STR(h.cpu, "unknown");
  char lines[MR_HOST_ADVICE_MAX][MR_HOST_LINE];
  MT_EQ_U64(mr_host_advice(&h, lines), 0);
  put("sys/module/haltpoll/parameters/guest_halt_poll_ns", "-5\n");
  put("sys/devices/system/node/online", "0,,1\n");
  mr_host_read(&h, root);
  MT_EQ_INT(h.halt_poll_ns, -1);
  MT_EQ_U64(h.numa_nodes, 0);
  /* a quote or backslash in the CPU's name would break the JSON records that carry it */
  put("proc/cpuinfo", "model name\t: Odd \"CPU\" \\ name\n");
  mr_host_read(&h, root);
  MT_EQ_STR(h.cpu, "Odd ");
}

MT_TEST(report_is_a_summary_line_then_the_advice) {
  tree();
  kvm_guest("0\n");
  mr_host h;
  mr_host_read(&h, root);
  mr_buf b;
  mr_buf_init(&b);
  MT_EQ_U64(mr_host_report(&b, &h), 1);
  MT_FALSE(b.oom);
  MT_CONTAINS(b.buf, "host: cpu Intel(R) Xeon(R) Processor; cpuidle driver haltpoll, governor haltpoll "
                     "(guest_halt_poll_ns 0); transparent huge pages madvise; NUMA balancing 0 on 1 "
                     "node: to change:\nhost: the idle CPUs of this KVM guest");
  MT_EQ_INT(b.buf[b.len - 1], '\n');
  mr_buf_close(&b);
  mr_host_read(&h, tree()); /* nothing known */
  mr_buf_init(&b);
  MT_EQ_U64(mr_host_report(&b, &h), 0);
  MT_EQ_STR(b.buf, "host: cpu unknown; cpuidle driver unknown, governor unknown; transparent huge "
                   "pages unknown; NUMA balancing unknown: nothing to change\n");
  mr_buf_close(&b);
}

MT_TEST(real_host_reads_and_advice_agrees) {
  mr_host_check(); /* logs what it finds, once */
  mr_host_check();
  mr_host h;
  mr_host_read(&h, NULL);
  char cpu[128];
  mr_host_cpu_model(cpu, sizeof cpu);
  MT_EQ_STR(cpu, h.cpu);
  char lines[MR_HOST_ADVICE_MAX][MR_HOST_LINE];
  uint32_t n = mr_host_advice(&h, lines);
  bool halts = strcmp(h.idle_governor, "haltpoll") == 0 && h.halt_poll_ns >= 0 &&
               h.halt_poll_ns < MR_HOST_HALT_POLL_NS;
  bool thp_off = strcmp(h.thp, "never") == 0;
  bool balancing = h.numa_balancing > 0 && (h.numa_balancing & 1) && h.numa_nodes > 1;
  MT_EQ_U64(n, (uint64_t)halts + thp_off + balancing);
  mr_host again;
  mr_host_read(&again, NULL);
  MT_EQ_INT(again.halt_poll_ns, h.halt_poll_ns);
  MT_EQ_STR(again.idle_driver, h.idle_driver);
}

MT_MAIN()
