/*
 * test_cluster.c - cluster file reader, mr_file_read and mr_file_write_atomic: good files, defaults, and each
 * kind of bad field (checking the code AND that the message names the field and limit).
 */
#include "common/internal.h"
#include "tests/unit/mt.h"

#include <sys/stat.h>

static mr_cluster_file cf; /* ~84 KiB: static rather than on the stack */

static int parse(const char *json, mr_err *e) {
  mr_err_clear(e);
  return mr_cluster_parse(&cf, json, strlen(json), "c.json", e);
}

MT_TEST(full_file) {
  mr_err e;
  MT_OK(parse("{\"model\": \"/models/q3\", \"deadline_ms\": 250,\n"
              " \"servers\": [{\"name\": \"s0\", \"address\": \"127.0.0.1:50051\"},\n"
              "             {\"name\": \"gpu-box_2.a\", \"address\": \"[::1]:50052\"},\n"
              "             {\"name\": \"s2\", \"address\": \"node-7.example:1\"},\n"
              "             {\"name\": \"s3\", \"address\": \"[fe80::1:2]:65535\"}],\n"
              " \"local\": {\"layers\": \"0-3,7\", \"experts\": \"0-3\"}}",
              &e),
        &e);
  MT_EQ_STR(cf.model, "/models/q3");
  MT_EQ_INT(cf.deadline_ms, 250);
  MT_EQ_INT(cf.n_servers, 4);
  MT_EQ_STR(cf.servers[0].name, "s0");
  MT_EQ_STR(cf.servers[0].address, "127.0.0.1:50051");
  MT_EQ_STR(cf.servers[1].name, "gpu-box_2.a");
  MT_EQ_STR(cf.servers[1].address, "[::1]:50052");
  MT_EQ_STR(cf.servers[3].address, "[fe80::1:2]:65535");
  MT_EQ_STR(cf.local_layers, "0-3,7");
  MT_EQ_STR(cf.local_experts, "0-3");
}

MT_TEST(defaults) {
  mr_err e;
  MT_OK(parse("{\"servers\":[{\"name\":\"a\",\"address\":\"localhost:9\"}]}", &e), &e);
  MT_EQ_STR(cf.model, "");
  MT_EQ_INT(cf.deadline_ms, 5000);
  MT_EQ_INT(cf.n_servers, 1);
  MT_EQ_STR(cf.local_layers, "");
  MT_EQ_STR(cf.local_experts, "");
  /* Experts without layers mean every layer. */
  MT_OK(parse("{\"servers\":[{\"name\":\"a\",\"address\":\"h:9\"}],\"local\":{\"experts\":\"1\"}}",
              &e),
        &e);
  MT_EQ_STR(cf.local_layers, "all");
  MT_EQ_STR(cf.local_experts, "1");
  MT_OK(parse("{\"servers\":[{\"name\":\"a\",\"address\":\"h:9\"}],\"local\":{}}", &e), &e);
  MT_EQ_STR(cf.local_layers, "");
}

MT_TEST(servers_errors) {
  mr_err e;
  MT_EQ_INT(parse("{}", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "c.json: required field servers is missing");
  MT_EQ_INT(parse("{\"servers\": []}", &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "servers has 0 entries, must have 1..256");
  MT_EQ_INT(parse("{\"servers\": {\"name\":\"a\"}}", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "servers = an object, must be an array");
  MT_EQ_INT(parse("{\"servers\": [\"127.0.0.1:1\"]}", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "servers[0] = \"127.0.0.1:1\", must be an object");
  MT_EQ_INT(parse("{\"servers\": [{\"address\":\"h:1\"}]}", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "servers[0].name = (missing), must be a string");
  MT_EQ_INT(parse("{\"servers\": [{\"name\":\"a\",\"address\":\"h:1\"},{\"name\":7,"
                  "\"address\":\"h:2\"}]}",
                  &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "servers[1].name = 7");
  MT_EQ_INT(parse("{\"servers\": [{\"name\":\"\",\"address\":\"h:1\"}]}", &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "servers[0].name is empty");
  char buf[512];
  snprintf(buf, sizeof buf, "{\"servers\": [{\"name\":\"%064d\",\"address\":\"h:1\"}]}", 0);
  MT_EQ_INT(parse(buf, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "servers[0].name is 64 characters long, at most 63");
  snprintf(buf, sizeof buf, "{\"servers\": [{\"name\":\"%063d\",\"address\":\"h:1\"}]}", 0);
  MT_OK(parse(buf, &e), &e);
  MT_EQ_INT(parse("{\"servers\": [{\"name\":\"a b\",\"address\":\"h:1\"}]}", &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "servers[0].name = \"a b\", character ' ' is not allowed");
  MT_EQ_INT(parse("{\"servers\": [{\"name\":\"a\",\"address\":\"h:1\",\"port\":1}]}", &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "unknown key \"port\" in servers[0]");
}

MT_TEST(address_errors) {
  struct {
    const char *addr;
    int code;
    const char *msg;
  } cases[] = {
      {"127.0.0.1", MR_EINVAL, "must be host:port"},
      {":50051", MR_EINVAL, "must be host:port"},
      {"h:0", MR_ERANGE, "port must be a number in 1..65535"},
      {"h:65536", MR_ERANGE, "port must be a number in 1..65535"},
      {"h:", MR_ERANGE, "port must be a number in 1..65535"},
      {"h:12a", MR_EINVAL, "port must be a number in 1..65535"},
      {"h:-1", MR_EINVAL, "port must be a number in 1..65535"},
      {"h:9999999999", MR_EINVAL, "port must be a number"},
      {"::1:50051", MR_EINVAL, "IPv6 addresses go in brackets"},
      {"[::1]50051", MR_EINVAL, "must be written [addr]:port"},
      {"[]:1", MR_EINVAL, "must be written [addr]:port"},
      {"[::g]:1", MR_EINVAL, "character 'g' is not allowed in an IPv6 address"},
      {"ho st:1", MR_EINVAL, "character ' ' is not allowed in a host name"},
      {"http://h:1", MR_EINVAL, "character ':' is not allowed"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char buf[256];
    mr_err e;
    snprintf(buf, sizeof buf, "{\"servers\": [{\"name\":\"a\",\"address\":\"%s\"}]}",
             cases[i].addr);
    int rc = parse(buf, &e);
    if (rc != cases[i].code) fprintf(stderr, "address %s\n", cases[i].addr);
    MT_EQ_INT(rc, cases[i].code);
    MT_CONTAINS(e.msg, "servers[0].address");
    MT_CONTAINS(e.msg, cases[i].addr);
    MT_CONTAINS(e.msg, cases[i].msg);
  }
}

MT_TEST(duplicates) {
  mr_err e;
  MT_EQ_INT(parse("{\"servers\": [{\"name\":\"a\",\"address\":\"h:1\"},"
                  "{\"name\":\"a\",\"address\":\"h:2\"}]}",
                  &e),
            MR_EINVAL);
  MT_CONTAINS(e.msg, "servers[1].name = \"a\" is also servers[0].name");
  MT_EQ_INT(parse("{\"servers\": [{\"name\":\"a\",\"address\":\"H:1\"},"
                  "{\"name\":\"b\",\"address\":\"h:2\"},{\"name\":\"c\",\"address\":\"h:1\"}]}",
                  &e),
            MR_EINVAL);
  MT_CONTAINS(e.msg, "servers[2].address = \"h:1\" is also servers[0].address");
  /* Duplicate JSON keys are typos too. */
  MT_EQ_INT(parse("{\"servers\": [{\"name\":\"a\",\"address\":\"h:1\"}], \"deadline_ms\": 1,"
                  " \"deadline_ms\": 2}",
                  &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "key \"deadline_ms\" appears twice");
}

static void many_servers(char *buf, size_t len, int n) {
  size_t o = (size_t)snprintf(buf, len, "{\"servers\": [");
  for (int i = 0; i < n; i++)
    o += (size_t)snprintf(buf + o, len - o, "%s{\"name\":\"s%d\",\"address\":\"h:%d\"}",
                          i ? "," : "", i, i + 1);
  snprintf(buf + o, len - o, "]}");
}

MT_TEST(too_many_servers) {
  static char buf[64 * 1024];
  mr_err e;
  many_servers(buf, sizeof buf, 257);
  MT_EQ_INT(parse(buf, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "servers has 257 entries, must have 1..256");
  many_servers(buf, sizeof buf, 256);
  MT_OK(parse(buf, &e), &e);
  MT_EQ_INT(cf.n_servers, 256);
  MT_EQ_STR(cf.servers[255].address, "h:256");
}

MT_TEST(top_level_errors) {
  mr_err e;
  const char *srv = "\"servers\":[{\"name\":\"a\",\"address\":\"h:1\"}]";
  char buf[512];
  snprintf(buf, sizeof buf, "{%s, \"deadline_msec\": 100}", srv);
  MT_EQ_INT(parse(buf, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "c.json: unknown key \"deadline_msec\" in the top level");
  MT_CONTAINS(e.msg, "\"deadline_ms\""); /* lists the allowed keys */
  snprintf(buf, sizeof buf, "{%s, \"deadline_ms\": 0}", srv);
  MT_EQ_INT(parse(buf, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "deadline_ms = 0, must be an integer in 1..600000");
  snprintf(buf, sizeof buf, "{%s, \"deadline_ms\": 600001}", srv);
  MT_EQ_INT(parse(buf, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "deadline_ms = 600001");
  snprintf(buf, sizeof buf, "{%s, \"deadline_ms\": 600000}", srv);
  MT_OK(parse(buf, &e), &e);
  MT_EQ_INT(cf.deadline_ms, 600000);
  snprintf(buf, sizeof buf, "{%s, \"failover_ms\": 300}", srv);
  MT_OK(parse(buf, &e), &e);
  MT_EQ_INT(cf.failover_ms, 300);
  snprintf(buf, sizeof buf, "{%s}", srv);
  MT_OK(parse(buf, &e), &e);
  MT_EQ_INT(cf.failover_ms, 0); /* absent: the client's default */
  snprintf(buf, sizeof buf, "{%s, \"failover_ms\": 0}", srv);
  MT_EQ_INT(parse(buf, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "failover_ms = 0, must be an integer in 1..600000");
  snprintf(buf, sizeof buf, "{%s, \"failover_ms\": 1.5}", srv);
  MT_TRUE(parse(buf, &e) != 0);
  MT_CONTAINS(e.msg, "failover_ms");
  snprintf(buf, sizeof buf, "{%s, \"failover\": 100}", srv);
  MT_EQ_INT(parse(buf, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "unknown key \"failover\" in the top level");
  snprintf(buf, sizeof buf, "{%s, \"deadline_ms\": \"5s\"}", srv);
  MT_EQ_INT(parse(buf, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "deadline_ms = \"5s\"");
  snprintf(buf, sizeof buf, "{%s, \"model\": 3}", srv);
  MT_EQ_INT(parse(buf, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "model = 3, must be a string");
  snprintf(buf, sizeof buf, "{%s, \"model\": \"\"}", srv);
  MT_EQ_INT(parse(buf, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "model is empty");
  MT_EQ_INT(parse("[]", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "top level is an array, must be a JSON object");
  MT_EQ_INT(parse("{\"servers\": [", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "c.json: invalid JSON at byte 12 (line 1)");
  MT_EQ_INT(parse("{\n\n  ]", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "line 3");
  MT_EQ_INT(cf.n_servers, 0); /* cleared on failure */
}

MT_TEST(local_errors) {
  mr_err e;
  const char *srv = "\"servers\":[{\"name\":\"a\",\"address\":\"h:1\"}]";
  char buf[512];
  snprintf(buf, sizeof buf, "{%s, \"local\": \"0-3\"}", srv);
  MT_EQ_INT(parse(buf, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "local = \"0-3\", must be an object");
  snprintf(buf, sizeof buf, "{%s, \"local\": {\"experts\": \"0-x\"}}", srv);
  MT_EQ_INT(parse(buf, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "c.json: local.experts: bad token \"0-x\"");
  snprintf(buf, sizeof buf, "{%s, \"local\": {\"layers\": \"5-2\", \"experts\": \"1\"}}", srv);
  MT_EQ_INT(parse(buf, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "local.layers: range \"5-2\" is reversed");
  snprintf(buf, sizeof buf, "{%s, \"local\": {\"layers\": \"1024\", \"experts\": \"1\"}}", srv);
  MT_EQ_INT(parse(buf, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "local.layers: id 1024");
  snprintf(buf, sizeof buf, "{%s, \"local\": {\"experts\": [1,2]}}", srv);
  MT_EQ_INT(parse(buf, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "local.experts = an array, must be a string");
  snprintf(buf, sizeof buf, "{%s, \"local\": {\"expert\": \"1\"}}", srv);
  MT_EQ_INT(parse(buf, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "unknown key \"expert\" in local");
}

MT_TEST(load_and_file_read) {
  char dir[] = "/tmp/mr-test-cl-XXXXXX";
  MT_TRUE(mkdtemp(dir) != NULL);
  char path[256];
  snprintf(path, sizeof path, "%s/cluster.json", dir);
  FILE *f = fopen(path, "w");
  MT_TRUE(f != NULL);
  fputs("{\"servers\":[{\"name\":\"a\",\"address\":\"127.0.0.1:7000\"}]}\n", f);
  fclose(f);
  mr_err e = {0};
  int rc_ok = mr_cluster_load(&cf, path, &e);
  uint32_t n = cf.n_servers;
  char *text = NULL;
  size_t len = 0;
  int rc_small = mr_file_read(path, 10, &text, &len, &e);
  char msg_small[512];
  snprintf(msg_small, sizeof msg_small, "%s", e.msg);
  int rc_dir = mr_file_read(dir, 1 << 20, &text, &len, &e);
  char msg_dir[512];
  snprintf(msg_dir, sizeof msg_dir, "%s", e.msg);
  int rc_read = mr_file_read(path, 1 << 20, &text, &len, &e);
  unlink(path);
  int rc_missing = mr_cluster_load(&cf, path, &e);
  rmdir(dir);
  MT_EQ_INT(rc_ok, 0);
  MT_EQ_INT(n, 1);
  MT_EQ_INT(rc_small, MR_ERANGE);
  MT_CONTAINS(msg_small, "exceeds the limit of 10 bytes");
  MT_EQ_INT(rc_dir, MR_EINVAL);
  MT_CONTAINS(msg_dir, "not a regular file");
  MT_EQ_INT(rc_read, 0);
  MT_EQ_U64(len, strlen(text));
  MT_EQ_INT(text[len], '\0');
  MT_CONTAINS(text, "127.0.0.1:7000");
  mr_free(text);
  MT_EQ_INT(rc_missing, MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "cluster.json");
}

MT_TEST(tls_and_token_keys) {
  mr_err e;
  MT_OK(parse("{\"servers\":[{\"name\":\"a\",\"address\":\"127.0.0.1:9\"}],"
              "\"tls\":{\"ca\":\"ca.pem\",\"cert\":\"c.pem\",\"key\":\"c.key\","
              "\"server_name\":\"experts.example\"},\"token_file\":\"/run/tok\"}",
              &e),
        &e);
  MT_TRUE(cf.tls);
  MT_EQ_STR(cf.tls_ca, "ca.pem");
  MT_EQ_STR(cf.tls_cert, "c.pem");
  MT_EQ_STR(cf.tls_key, "c.key");
  MT_EQ_STR(cf.tls_server_name, "experts.example");
  MT_EQ_STR(cf.token_file, "/run/tok");
  /* Every key inside is optional: an empty object means TLS with the default roots. */
  MT_OK(parse("{\"servers\":[{\"name\":\"a\",\"address\":\"h:9\"}],\"tls\":{}}", &e), &e);
  MT_TRUE(cf.tls);
  MT_EQ_STR(cf.tls_ca, "");
  MT_EQ_STR(cf.token_file, "");
  /* No section: plaintext, no token. */
  MT_OK(parse("{\"servers\":[{\"name\":\"a\",\"address\":\"h:9\"}]}", &e), &e);
  MT_FALSE(cf.tls);
}

MT_TEST(tls_and_token_errors) {
  mr_err e;
  const char *srv = "\"servers\":[{\"name\":\"a\",\"address\":\"h:9\"}]";
  char j[512];
  snprintf(j, sizeof j, "{%s,\"tls\":{\"ca\":\"a\",\"verify\":false}}", srv);
  MT_EQ_INT(parse(j, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "verify");
  MT_CONTAINS(e.msg, "tls");
  snprintf(j, sizeof j, "{%s,\"tls\":\"yes\"}", srv);
  MT_EQ_INT(parse(j, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "tls = \"yes\", must be an object");
  snprintf(j, sizeof j, "{%s,\"tls\":{\"cert\":\"c.pem\"}}", srv);
  MT_EQ_INT(parse(j, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "tls.cert is given without tls.key");
  snprintf(j, sizeof j, "{%s,\"tls\":{\"key\":\"c.key\"}}", srv);
  MT_EQ_INT(parse(j, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "tls.key is given without tls.cert");
  snprintf(j, sizeof j, "{%s,\"tls\":{\"ca\":7}}", srv);
  MT_EQ_INT(parse(j, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "tls.ca = 7, must be a string");
  snprintf(j, sizeof j, "{%s,\"tls\":{\"ca\":\"\"}}", srv);
  MT_EQ_INT(parse(j, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "tls.ca is empty");
  snprintf(j, sizeof j, "{%s,\"tls\":{\"server_name\":\"a b\"}}", srv);
  MT_EQ_INT(parse(j, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "tls.server_name = \"a b\", character ' '");
  snprintf(j, sizeof j, "{%s,\"token_file\":[]}", srv);
  MT_EQ_INT(parse(j, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "token_file = ");
  snprintf(j, sizeof j, "{%s,\"token_file\":\"\"}", srv);
  MT_EQ_INT(parse(j, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "token_file is empty");
  snprintf(j, sizeof j, "{%s,\"token\":\"secret\"}", srv); /* the token itself: never */
  MT_EQ_INT(parse(j, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "token");
  /* A path longer than the field holds names the field and the limit. */
  char big[1200];
  memset(big, 'a', 1100);
  big[1100] = '\0';
  char jj[1400];
  snprintf(jj, sizeof jj, "{%s,\"tls\":{\"ca\":\"%s\"}}", srv, big);
  MT_EQ_INT(parse(jj, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "tls.ca is 1100 characters long, at most 1023");
}

/* A FIFO named as a cluster (or any) file is refused at once instead of blocking the open. */
MT_TEST(fifo_refused_without_blocking) {
  char dir[] = "/tmp/mr-test-fifo-XXXXXX";
  MT_TRUE(mkdtemp(dir) != NULL);
  char path[256];
  snprintf(path, sizeof path, "%s/cluster.json", dir);
  MT_EQ_INT(mkfifo(path, 0600), 0);
  alarm(10); /* a regression would block in open(): the alarm turns it into a failure */
  mr_err e = {0};
  int rc = mr_cluster_load(&cf, path, &e);
  char msg[512];
  snprintf(msg, sizeof msg, "%s", e.msg);
  char *text = NULL;
  int rc2 = mr_file_read("/dev/null", 100, &text, NULL, &e);
  char msg2[512];
  snprintf(msg2, sizeof msg2, "%s", e.msg);
  alarm(0);
  unlink(path);
  rmdir(dir);
  MT_EQ_INT(rc, MR_EINVAL);
  MT_CONTAINS(msg, "cluster.json: not a regular file (a FIFO)");
  MT_EQ_INT(rc2, MR_EINVAL);
  MT_CONTAINS(msg2, "/dev/null: not a regular file (a character device)");
}

/* The planning keys: optional, defaults for old files, strict values. */
MT_TEST(planning_keys) {
  mr_err e;
  MT_OK(parse("{\"servers\":[{\"name\":\"a\",\"address\":\"h:1\",\"expert_memory\":\"64G\","
              "\"numa_nodes\":2,\"speed\":1.5},"
              "{\"name\":\"b\",\"address\":\"h:2\",\"expert_memory\":123456},"
              "{\"name\":\"c\",\"address\":\"h:3\",\"expert_memory\":\"512MiB\",\"speed\":0.25},"
              "{\"name\":\"d\",\"address\":\"h:4\"}]}", &e), &e);
  MT_EQ_INT(cf.servers[0].expert_memory, 64ull << 30);
  MT_EQ_INT(cf.servers[0].numa_nodes, 2);
  MT_TRUE(cf.servers[0].speed == 1.5);
  MT_EQ_INT(cf.servers[1].expert_memory, 123456);
  MT_EQ_INT(cf.servers[1].numa_nodes, 0);
  MT_TRUE(cf.servers[1].speed == 1.0);
  MT_EQ_INT(cf.servers[2].expert_memory, 512ull << 20);
  MT_TRUE(cf.servers[2].speed == 0.25);
  MT_EQ_INT(cf.servers[3].expert_memory, 0);
  MT_TRUE(cf.servers[3].speed == 1.0);
  static const struct { const char *srv, *want; int rc; } bad[] = {
      {"\"expert_memory\":0", "servers[0].expert_memory = 0", MR_ERANGE},
      {"\"expert_memory\":-5", "servers[0].expert_memory", MR_ERANGE},
      {"\"expert_memory\":1.5", "servers[0].expert_memory = 1.5", MR_ERANGE},
      {"\"expert_memory\":\"\"", "servers[0].expert_memory = \"\", must be a byte count", MR_EINVAL},
      {"\"expert_memory\":\"64X\"", "servers[0].expert_memory = \"64X\", must be a byte count", MR_EINVAL},
      {"\"expert_memory\":\"1.5G\"", "must be a byte count", MR_EINVAL},
      {"\"expert_memory\":\"G\"", "must be a byte count", MR_EINVAL},
      {"\"expert_memory\":\"64GB2\"", "must be a byte count", MR_EINVAL},
      {"\"expert_memory\":\"2048T\"", "at most 2^50 bytes", MR_ERANGE},
      {"\"expert_memory\":\"99999999999999999999999\"", "at most 2^50 bytes", MR_ERANGE},
      {"\"expert_memory\":true", "servers[0].expert_memory", MR_EFORMAT},
      {"\"numa_nodes\":0", "servers[0].numa_nodes = 0", MR_ERANGE},
      {"\"numa_nodes\":65", "servers[0].numa_nodes = 65", MR_ERANGE},
      {"\"numa_nodes\":\"2\"", "servers[0].numa_nodes", MR_EFORMAT},
      {"\"speed\":0", "servers[0].speed = 0, must be a number > 0", MR_ERANGE},
      {"\"speed\":-1", "servers[0].speed = -1", MR_ERANGE},
      {"\"speed\":1e7", "<= 1e6", MR_ERANGE},
      {"\"speed\":\"fast\"", "servers[0].speed = \"fast\"", MR_EFORMAT},
      {"\"speeed\":1", "unknown key \"speeed\"", MR_EFORMAT},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char json[512];
    snprintf(json, sizeof json, "{\"servers\":[{\"name\":\"a\",\"address\":\"h:1\",%s}]}",
             bad[i].srv);
    int rc = parse(json, &e);
    fprintf(stderr, "  %zu: %s\n", i, e.msg);
    MT_EQ_INT(rc, bad[i].rc);
    MT_CONTAINS(e.msg, bad[i].want);
  }
  uint64_t v = 0;
  MT_OK(mr_size_parse("1k", "x", &v, &e), &e);
  MT_EQ_INT(v, 1024);
  MT_OK(mr_size_parse("1P", "x", &v, &e), &e);
  MT_EQ_INT(v, 1ull << 50);
  MT_EQ_INT(mr_size_parse("2P", "--gpu-bytes", &v, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "--gpu-bytes = \"2P\"");
}

/* mr_file_write_atomic replaces a regular file whole, but never renames over a device or a
 * symlink: "-o /dev/null" once replaced the machine's /dev/null with a regular file. */
MT_TEST(write_atomic_keeps_devices_and_links) {
  mr_err e;
  char dir[] = "/tmp/mr-test-write-XXXXXX";
  MT_TRUE(mkdtemp(dir) != NULL);
  char path[128], link[128], back[64];
  snprintf(path, sizeof path, "%s/out.json", dir);
  snprintf(link, sizeof link, "%s/link.json", dir);
  MT_OK(mr_file_write_atomic(path, "first", 5, &e), &e);
  MT_OK(mr_file_write_atomic(path, "second", 6, &e), &e);
  FILE *f = fopen(path, "r");
  MT_TRUE(f != NULL);
  size_t n = fread(back, 1, sizeof back, f);
  fclose(f);
  MT_EQ_INT(n, 6);
  MT_TRUE(memcmp(back, "second", 6) == 0);
  /* Through a symlink: the link stays a link, its target gets the bytes. */
  MT_EQ_INT(symlink(path, link), 0);
  MT_OK(mr_file_write_atomic(link, "third", 5, &e), &e);
  struct stat sb;
  MT_EQ_INT(lstat(link, &sb), 0);
  MT_TRUE(S_ISLNK(sb.st_mode));
  MT_EQ_INT(stat(path, &sb), 0);
  MT_EQ_INT(sb.st_size, 5);
  /* A character device stays one. */
  MT_OK(mr_file_write_atomic("/dev/null", "x", 1, &e), &e);
  MT_EQ_INT(stat("/dev/null", &sb), 0);
  MT_TRUE(S_ISCHR(sb.st_mode));
  /* No temporary file is left behind, also after a failure (a missing directory). */
  char missing[160];
  snprintf(missing, sizeof missing, "%s/no/such/dir/x.json", dir);
  MT_EQ_INT(mr_file_write_atomic(missing, "x", 1, &e), MR_EIO);
  MT_CONTAINS(e.msg, "cannot create");
  unlink(link);
  unlink(path);
  MT_EQ_INT(rmdir(dir), 0); /* fails if a .tmp file were left */
}

MT_MAIN()
