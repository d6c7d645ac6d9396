/*
 * test_idset.c - id sets: "all", "", lists and ranges, canonical formatting, and each kind
 * of bad token (checking the code AND that the message names `what`, the token and limit).
 */
#include "common/mr.h"
#include "tests/unit/mt.h"

static int parse(mr_idset *s, const char *spec, uint32_t limit, mr_err *e) {
  mr_err_clear(e);
  return mr_idset_parse(s, spec, limit, "--experts", e);
}

static void expect_format(const mr_idset *s, const char *want) {
  char buf[256];
  size_t n = mr_idset_format(s, buf, sizeof buf);
  MT_EQ_STR(buf, want);
  MT_EQ_U64(n, strlen(want));
}

MT_TEST(good_specs) {
  mr_idset s;
  mr_err e;
  MT_OK(parse(&s, "all", 16, &e), &e);
  MT_EQ_INT(mr_idset_count(&s), 16);
  MT_TRUE(mr_idset_has(&s, 15));
  MT_FALSE(mr_idset_has(&s, 16)); /* beyond the limit is never in */
  expect_format(&s, "0-15");
  mr_idset_close(&s);

  MT_OK(parse(&s, "", 16, &e), &e);
  MT_EQ_INT(mr_idset_count(&s), 0);
  expect_format(&s, "");
  mr_idset_close(&s);
  MT_OK(mr_idset_parse(&s, NULL, 4, NULL, NULL), (mr_err *)NULL);
  MT_EQ_INT(mr_idset_count(&s), 0);
  mr_idset_close(&s);

  MT_OK(parse(&s, "0-7,12", 16, &e), &e);
  MT_EQ_INT(mr_idset_count(&s), 9);
  for (uint32_t i = 0; i < 16; i++) MT_EQ_INT(mr_idset_has(&s, i), i < 8 || i == 12);
  expect_format(&s, "0-7,12");
  mr_idset_close(&s);

  /* Spaces, overlaps, unsorted input: canonical output. */
  MT_OK(parse(&s, " 12 , 3-4,0 ,4-5, 13", 200, &e), &e);
  expect_format(&s, "0,3-5,12-13");
  mr_idset_close(&s);
  MT_OK(parse(&s, "  all  ", 3, &e), &e);
  expect_format(&s, "0-2");
  mr_idset_close(&s);
  MT_OK(parse(&s, "63-64,127", 128, &e), &e); /* word boundaries */
  expect_format(&s, "63-64,127");
  MT_EQ_INT(mr_idset_count(&s), 3);
  mr_idset_close(&s);
}

MT_TEST(bad_specs) {
  struct {
    const char *spec;
    int code;
    const char *msg;
  } cases[] = {
      {"1,,2", MR_EINVAL, "bad token \"\""},
      {"a", MR_EINVAL, "bad token \"a\""},
      {"1,", MR_EINVAL, "bad token \"\""},
      {",1", MR_EINVAL, "bad token \"\""},
      {"1-", MR_EINVAL, "bad token \"1-\""},
      {"-1", MR_EINVAL, "bad token \"-1\""},
      {"1-2-3", MR_EINVAL, "bad token \"1-2-3\""},
      {"1 2", MR_EINVAL, "bad token \"1 2\""},
      {"all,1", MR_EINVAL, "bad token \"all\""},
      {"All", MR_EINVAL, "bad token \"All\""},
      {"0x3", MR_EINVAL, "bad token \"0x3\""},
      {"+3", MR_EINVAL, "bad token \"+3\""},
      {"99999999999", MR_EINVAL, "bad token \"99999999999\""},
      {"5-3", MR_EINVAL, "range \"5-3\" is reversed (5 > 3)"},
      {"16", MR_ERANGE, "id 16 in \"16\" is out of range, ids must be < 16"},
      {"3,10-20", MR_ERANGE, "id 20 in \"10-20\" is out of range, ids must be < 16"},
      {"4294967295", MR_ERANGE, "id 4294967295"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    mr_idset s = {0};
    mr_err e;
    int rc = parse(&s, cases[i].spec, 16, &e);
    if (rc != cases[i].code) fprintf(stderr, "spec \"%s\"\n", cases[i].spec);
    MT_EQ_INT(rc, cases[i].code);
    MT_CONTAINS(e.msg, "--experts: ");
    MT_CONTAINS(e.msg, cases[i].msg);
    MT_TRUE(s.bits == NULL); /* nothing to close on failure */
    mr_idset_close(&s);      /* but closing is harmless */
  }
}

MT_TEST(limit_zero_and_large) {
  mr_idset s;
  mr_err e;
  MT_OK(parse(&s, "all", 0, &e), &e);
  MT_EQ_INT(mr_idset_count(&s), 0);
  MT_FALSE(mr_idset_has(&s, 0));
  mr_idset_close(&s);
  MT_EQ_INT(parse(&s, "0", 0, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "ids must be < 0");
  MT_OK(parse(&s, "65535,0", 65536, &e), &e);
  expect_format(&s, "0,65535");
  mr_idset_close(&s);
}

MT_TEST(idlist_from_any_source) {
  char buf[64];
  const uint32_t a[] = {0, 1, 2, 3, 7, 9, 10};
  mr_idlist w;
  mr_idlist_init(&w, buf, sizeof buf);
  for (int i = 0; i < 7; i++) mr_idlist_add(&w, a[i]);
  MT_EQ_INT(mr_idlist_end(&w, false), strlen("0-3,7,9-10"));
  MT_EQ_STR(buf, "0-3,7,9-10");
  mr_idlist_init(&w, buf, sizeof buf);
  MT_EQ_INT(mr_idlist_end(&w, true), 0);
  MT_EQ_STR(buf, "");
  /* Too small: counts what it needs, cut at a whole item, never overrun. */
  char small[5];
  memset(small, 'x', sizeof small);
  mr_idlist_init(&w, small, sizeof small);
  for (int i = 0; i < 7; i++) mr_idlist_add(&w, a[i]);
  MT_EQ_INT(mr_idlist_end(&w, false), 10);
  MT_EQ_STR(small, "0-3");
  /* With an ellipsis the cut is visible; the largest id ends a range safely. */
  char cut[9];
  mr_idlist_init(&w, cut, sizeof cut);
  for (int i = 0; i < 7; i++) mr_idlist_add(&w, a[i]);
  mr_idlist_add(&w, UINT32_MAX - 1);
  mr_idlist_add(&w, UINT32_MAX);
  MT_EQ_INT(mr_idlist_end(&w, true), strlen("0-3,7,9-10,4294967294-4294967295"));
  MT_EQ_STR(cut, "0-3,7...");
  mr_idlist_init(&w, NULL, 0);
  mr_idlist_add(&w, 12);
  MT_EQ_INT(mr_idlist_end(&w, true), 2);
}

MT_TEST(init_add_format_truncation) {
  mr_idset s;
  MT_OK(mr_idset_init(&s, 100), (mr_err *)NULL);
  MT_EQ_INT(mr_idset_count(&s), 0);
  mr_idset_add(&s, 99);
  mr_idset_add(&s, 10);
  mr_idset_add(&s, 11);
  mr_idset_add(&s, 11);
  MT_EQ_INT(mr_idset_count(&s), 3);
  expect_format(&s, "10-11,99");
  /* Returns the length needed and never writes past len; output is cut at a token. */
  char small[6];
  memset(small, 'x', sizeof small);
  MT_EQ_U64(mr_idset_format(&s, small, sizeof small), 8);
  MT_EQ_STR(small, "10-11");
  MT_EQ_U64(mr_idset_format(&s, NULL, 0), 8);
  char three[3];
  MT_EQ_U64(mr_idset_format(&s, three, sizeof three), 8);
  MT_EQ_STR(three, "");
  /* Round trip: format -> parse gives the same set. */
  char buf[64];
  mr_idset_format(&s, buf, sizeof buf);
  mr_idset t;
  mr_err e;
  MT_OK(mr_idset_parse(&t, buf, 100, "x", &e), &e);
  for (uint32_t i = 0; i < 100; i++) MT_EQ_INT(mr_idset_has(&s, i), mr_idset_has(&t, i));
  mr_idset_close(&t);
  mr_idset_close(&s);
  mr_idset_close(&s); /* double close is a no-op */
}

MT_TEST(alloc_failure) {
  mr_idset s;
  mr_err e;
  mr_alloc_fail_after(1);
  int rc = mr_idset_parse(&s, "1-3", 10, "--layers", &e);
  mr_alloc_fail_after(0);
  MT_EQ_INT(rc, MR_ENOMEM);
  MT_CONTAINS(e.msg, "--layers");
  MT_TRUE(s.bits == NULL);
}

MT_MAIN()
