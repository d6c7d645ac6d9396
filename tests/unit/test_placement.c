/*
 * test_placement.c - the placement file reader (common/placement.c): a good file, and
 * every kind of bad one refused with the field named.
 */
#include <string.h>

#include "common/mr.h"
#include "tests/unit/mt.h"

static int parse(mr_placement *p, const char *json, mr_err *e) {
  return mr_placement_parse(p, json, strlen(json), "p.json", e);
}

MT_TEST(good_file) {
  mr_placement p;
  mr_err e = {0};
  MT_OK(parse(&p, "{\"format\":\"moerpc-placement\",\"version\":1,\"num_layers\":3,"
                  "\"num_experts\":8,\"model_fingerprint\":\"abc\",\"layers\":["
                  "{\"layer\":0,\"local\":\"0-1\",\"remote\":{\"s0\":\"2-4\",\"s1\":\"5-7\"}},"
                  "{\"layer\":2,\"remote\":{\"s1\":\"all\"}}]}", &e), &e);
  MT_EQ_INT(p.num_layers, 3);
  MT_EQ_INT(p.num_experts, 8);
  MT_EQ_STR(p.model_fingerprint, "abc");
  MT_EQ_INT(p.n_local, 2);
  MT_EQ_INT(p.local[1], 1);
  MT_EQ_INT(p.local[2], 0);
  MT_EQ_INT(p.n_servers, 2);
  MT_EQ_STR(p.server[p.route[3]], "s0");
  MT_EQ_STR(p.server[p.route[7]], "s1");
  MT_EQ_INT(p.route[8 + 3], -1); /* layer 1: not listed */
  MT_EQ_STR(p.server[p.route[16]], "s1");
  /* No replicas: one copy per remote pair, rep[] agrees with route[]. */
  MT_EQ_INT(p.n_replicated, 0);
  MT_EQ_INT(p.n_single, 6 + 8);
  MT_EQ_INT(p.n_copies, 14);
  MT_EQ_INT(p.copies[0], 0);
  MT_EQ_INT(p.copies[3], 1);
  MT_EQ_INT(p.rep[p.rep_off[3]], p.route[3]);
  mr_placement_close(&p);
}

/* A pair under several servers has replicas: route -1 (the client's default rule), the
 * copy count and the servers in file order. */
MT_TEST(replicas) {
  mr_placement p;
  mr_err e = {0};
  MT_OK(parse(&p, "{\"format\":\"moerpc-placement\",\"version\":1,\"num_layers\":2,"
                  "\"num_experts\":4,\"layers\":["
                  "{\"layer\":1,\"local\":\"0\",\"remote\":{\"s1\":\"1-3\",\"s0\":\"2-3\",\"s2\":\"3\"}},"
                  "{\"layer\":0,\"remote\":{\"s0\":\"0-3\"}}]}", &e), &e);
  MT_EQ_INT(p.n_servers, 3);
  MT_EQ_STR(p.server[0], "s1");
  MT_EQ_INT(p.n_replicated, 2);
  MT_EQ_INT(p.n_single, 4 + 1);
  MT_EQ_INT(p.n_copies, 4 + 3 + 2 + 1);
  MT_EQ_INT(p.copies[4 + 0], 0);
  MT_EQ_INT(p.local[4 + 0], 1);
  MT_EQ_INT(p.copies[4 + 1], 1);
  MT_EQ_STR(p.server[p.route[4 + 1]], "s1");
  MT_EQ_INT(p.copies[4 + 2], 2);
  MT_EQ_INT(p.route[4 + 2], -1);
  MT_EQ_INT(p.copies[4 + 3], 3);
  MT_EQ_INT(p.route[4 + 3], -1);
  uint32_t o = p.rep_off[4 + 3];
  MT_EQ_INT(p.rep_off[4 + 4] - o, 3);
  MT_EQ_STR(p.server[p.rep[o]], "s1");
  MT_EQ_STR(p.server[p.rep[o + 1]], "s0");
  MT_EQ_STR(p.server[p.rep[o + 2]], "s2");
  MT_EQ_STR(p.server[p.route[0]], "s0"); /* layer 0: one copy each */
  MT_EQ_INT(p.rep_off[8], p.n_copies);
  mr_placement_close(&p);
}

MT_TEST(bad_files_name_the_field) {
  static const struct { const char *json, *want; } cases[] = {
      {"[]", "top level"},
      {"{\"format\":\"x\",\"version\":1,\"num_layers\":1,\"num_experts\":1,\"layers\":[]}", "format"},
      {"{\"format\":\"moerpc-placement\",\"version\":2,\"num_layers\":1,\"num_experts\":1,\"layers\":[]}", "version"},
      {"{\"format\":\"moerpc-placement\",\"version\":1,\"num_experts\":1,\"layers\":[]}", "num_layers"},
      {"{\"format\":\"moerpc-placement\",\"version\":1,\"num_layers\":1,\"num_experts\":0,\"layers\":[]}", "num_experts"},
      {"{\"format\":\"moerpc-placement\",\"version\":1,\"num_layers\":1,\"num_experts\":4,\"layers\":{}}", "layers"},
      {"{\"format\":\"moerpc-placement\",\"version\":1,\"num_layers\":1,\"num_experts\":4,\"layerz\":[]}", "layerz"},
      {"{\"format\":\"moerpc-placement\",\"version\":1,\"num_layers\":2,\"num_experts\":4,\"layers\":[{\"layer\":2}]}", "layers[0].layer"},
      {"{\"format\":\"moerpc-placement\",\"version\":1,\"num_layers\":2,\"num_experts\":4,\"layers\":[{\"layer\":0},{\"layer\":0}]}", "twice"},
      {"{\"format\":\"moerpc-placement\",\"version\":1,\"num_layers\":2,\"num_experts\":4,\"layers\":[{\"layer\":0,\"local\":\"0-4\"}]}", "layers[0].local"},
      {"{\"format\":\"moerpc-placement\",\"version\":1,\"num_layers\":2,\"num_experts\":4,\"layers\":[{\"layer\":0,\"local\":\"1\",\"remote\":{\"s0\":\"0-1\"}}]}", "also local"},
      {"{\"format\":\"moerpc-placement\",\"version\":1,\"num_layers\":2,\"num_experts\":4,\"layers\":[{\"layer\":0,\"local\":\"1\",\"remote\":{\"s0\":\"0\",\"s1\":\"1\"}}]}", "layer 0 expert 1 is also local"},
      {"{\"format\":\"moerpc-placement\",\"version\":1,\"num_layers\":2,\"num_experts\":4,\"layers\":[{\"layer\":0,\"remote\":{\"s0\":\"0\",\"s0\":\"1\"}}]}", "server named twice"},
      {"{\"format\":\"moerpc-placement\",\"version\":1,\"num_layers\":2,\"num_experts\":4,\"layers\":[{\"layer\":0,\"remote\":{\"s0\":3}}]}", "layers[0].remote.s0"},
      {"{\"format\":\"moerpc-placement\",\"version\":1,\"num_layers\":2,\"num_experts\":4,\"layers\":[{\"layer\":0,\"remote\":{\"\":\"1\"}}]}", "server name"},
      {"{\"format\":\"moerpc-placement\",\"version\":1,\"num_layers\":2,\"num_experts\":4,\"layers\":[{\"layer\":0,\"hot\":\"1\"}]}", "hot"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    mr_placement p;
    mr_err e = {0};
    int rc = parse(&p, cases[i].json, &e);
    fprintf(stderr, "  %zu: %s\n", i, e.msg);
    MT_TRUE(rc != 0);
    MT_CONTAINS(e.msg, cases[i].want);
    MT_TRUE(p.local == NULL && p.route == NULL);
    mr_placement_close(&p);
  }
}

MT_MAIN()
