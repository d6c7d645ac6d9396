/*
 * test_pl_apply.c - the diff of `moerpc-place apply` (pl_apply_prepare): per server the pairs
 * to load (planned there, not owned) and to unload (owned, not planned there), and the
 * refusals before anything moves: a plan server not in the cluster file, a pair of a served
 * layer that is neither local nor on a server, a server over its capacity. And the
 * placement hash (FNV-1a 64) that a client's GET /placement reports.
 */
#include <string.h>

#include "placement/pl.h"
#include "tests/unit/mt.h"

#define L 3
#define E 8

static mr_cluster_file cf;
static uint8_t owned[2 * L * E];

/* s0 owns experts 0-3 and s1 owns 4-7 of layers 1 and 2; layer 0 is dense (nobody). */
static void setup(void) {
  memset(&cf, 0, sizeof cf);
  cf.n_servers = 2;
  strcpy(cf.servers[0].name, "s0");
  strcpy(cf.servers[1].name, "s1");
  memset(owned, 0, sizeof owned);
  for (int l = 1; l < L; l++)
    for (int x = 0; x < E; x++) owned[(x < 4 ? 0 : 1) * L * E + l * E + x] = 1;
}

static void plan_of(mr_placement *p, const char *json) {
  mr_err e;
  MT_OK(mr_placement_parse(p, json, strlen(json), "plan.json", &e), &e);
}

#define HEAD "{\"format\": \"moerpc-placement\", \"version\": 1, \"num_layers\": 3, \"num_experts\": 8, "

MT_TEST(diff_moves_experts_between_servers) {
  setup();
  mr_placement p;
  plan_of(&p, HEAD "\"layers\": [{\"layer\": 1, \"remote\": {\"s0\": \"0-1\", \"s1\": \"2-7\"}},"
                   "{\"layer\": 2, \"local\": \"0\", \"remote\": {\"s0\": \"1-3,7\", \"s1\": \"4-6\"}}]}");
  pl_apply_plan ap;
  mr_err e;
  uint64_t free_b[2] = {1000, 1000};
  MT_OK(pl_apply_prepare(&ap, &p, &cf, owned, free_b, 100, "plan.json", &e), &e);
  MT_EQ_U64(ap.n_add[0], 1);  /* (2,7) */
  MT_EQ_U64(ap.n_drop[0], 3); /* (1,2) (1,3) (2,0): local now */
  MT_EQ_U64(ap.n_add[1], 2);  /* (1,2) (1,3) */
  MT_EQ_U64(ap.n_drop[1], 1); /* (2,7) */
  MT_TRUE(ap.add[0 * L * E + 2 * E + 7] && ap.drop[1 * L * E + 2 * E + 7]);
  MT_TRUE(ap.drop[0 * L * E + 2 * E + 0] && !ap.want[0 * L * E + 2 * E + 0]);
  /* Nothing to do when the plan is what they own. */
  pl_apply_plan_close(&ap);
  mr_placement_close(&p);
  plan_of(&p, HEAD "\"layers\": [{\"layer\": 1, \"remote\": {\"s0\": \"0-3\", \"s1\": \"4-7\"}},"
                   "{\"layer\": 2, \"remote\": {\"s0\": \"0-3\", \"s1\": \"4-7\"}}]}");
  MT_OK(pl_apply_prepare(&ap, &p, &cf, owned, NULL, 100, "plan.json", &e), &e);
  MT_EQ_U64(ap.n_add[0] + ap.n_add[1] + ap.n_drop[0] + ap.n_drop[1], 0);
  pl_apply_plan_close(&ap);
  mr_placement_close(&p);
}

MT_TEST(refusals_name_the_problem) {
  setup();
  mr_placement p;
  pl_apply_plan ap;
  mr_err e;
  plan_of(&p, HEAD "\"layers\": [{\"layer\": 1, \"remote\": {\"s0\": \"0-3\", \"s9\": \"4-7\"}}]}");
  MT_EQ_INT(pl_apply_prepare(&ap, &p, &cf, owned, NULL, 100, "plan.json", &e), MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "plan.json: server \"s9\" is not in the cluster file");
  MT_TRUE(ap.want == NULL); /* left empty */
  mr_placement_close(&p);
  /* Layer 2 is served now but the plan does not place expert 6 and 7 of layer 1 nor layer 2. */
  plan_of(&p, HEAD "\"layers\": [{\"layer\": 1, \"remote\": {\"s0\": \"0-3\", \"s1\": \"4-5\"}}]}");
  MT_EQ_INT(pl_apply_prepare(&ap, &p, &cf, owned, NULL, 100, "plan.json", &e), MR_EPRECOND);
  MT_CONTAINS(e.msg, "layer 1: experts 6-7 are neither local nor on a server");
  mr_placement_close(&p);
  plan_of(&p, HEAD "\"layers\": [{\"layer\": 1, \"remote\": {\"s0\": \"0-3\", \"s1\": \"4-7\"}}]}");
  MT_EQ_INT(pl_apply_prepare(&ap, &p, &cf, owned, NULL, 100, "plan.json", &e), MR_EPRECOND);
  MT_CONTAINS(e.msg, "layer 2: experts 0-7 are neither local nor on a server");
  mr_placement_close(&p);
  /* Capacity: s1 must load 2 experts of 100 bytes with room for 150. */
  plan_of(&p, HEAD "\"layers\": [{\"layer\": 1, \"remote\": {\"s0\": \"0-1\", \"s1\": \"2-7\"}},"
                   "{\"layer\": 2, \"remote\": {\"s0\": \"0-3\", \"s1\": \"4-7\"}}]}");
  uint64_t free_b[2] = {0, 150};
  MT_EQ_INT(pl_apply_prepare(&ap, &p, &cf, owned, free_b, 100, "plan.json", &e), MR_EEXHAUSTED);
  MT_CONTAINS(e.msg, "server s1 must load 2 experts = 200 bytes");
  MT_CONTAINS(e.msg, "room for 150 bytes");
  free_b[1] = 200;
  MT_OK(pl_apply_prepare(&ap, &p, &cf, owned, free_b, 100, "plan.json", &e), &e);
  pl_apply_plan_close(&ap);
  mr_placement_close(&p);
}

MT_TEST(hash_is_fnv1a64) {
  MT_EQ_U64(pl_placement_hash("", 0), 0xcbf29ce484222325ull);
  MT_EQ_U64(pl_placement_hash("a", 1), 0xaf63dc4c8601ec8cull);
  MT_EQ_U64(pl_placement_hash("foobar", 6), 0x85944171f73967e8ull);
}

MT_MAIN()
