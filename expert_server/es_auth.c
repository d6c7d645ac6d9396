/*
 * es_auth.c - who may talk to the server: TLS credentials (gRPC's own, from PEM files), the
 * bearer token checked on every Hello, Stats and Forward call, and the loopback rule for
 * plaintext. docs/DESIGN.md section 11.
 *
 * The token is read once at start-up (es__auth_init) into s->auth_value as the whole
 * expected metadata value "Bearer <token>"; each call's request metadata is compared with it
 * in constant time (mr_secret_equal). Only the CQ threads read it afterwards, read-only.
 * The grpc.health.v1 Check stays open: load balancers and our own start-up probe have no
 * token.
 */
#include <arpa/inet.h>
#include <grpc/grpc_security.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "expert_server/internal.h"

#define ES_AUTH_KEY "authorization"
#define ES_AUTH_SCHEME "Bearer "

bool es_listen_is_loopback(const char *listen) {
  char host[256];
  unsigned char bin[16];
  if (!listen) return false;
  const char *end;
  const char *h = listen;
  if (listen[0] == '[') {
    h = listen + 1;
    end = strchr(h, ']');
  } else {
    end = strrchr(listen, ':');
  }
  if (!end || end == h || (size_t)(end - h) >= sizeof host) return false;
  memcpy(host, h, (size_t)(end - h));
  host[end - h] = '\0';
  if (strcasecmp(host, "localhost") == 0) return true;
  if (inet_pton(AF_INET, host, bin) == 1) return bin[0] == 127;
  if (inet_pton(AF_INET6, host, bin) == 1) {
    static const unsigned char lo6[16] = {[15] = 1};
    return memcmp(bin, lo6, 16) == 0;
  }
  return false;
}

/* Reads one PEM file named by flag into a heap string (caller wipes and frees). */
static int es__pem_read(const char *flag, const char *path, char **out, mr_err *e) {
  size_t len = 0;
  int rc = mr_file_read(path, ES_MAX_PEM_BYTES, out, &len, e);
  if (rc) return mr_err_prefix(e, rc, "%s", flag);
  if (len == 0 || !strstr(*out, "-----BEGIN ")) {
    mr_free(*out);
    *out = NULL;
    return mr_err_set(e, MR_EINVAL, "%s %s: not a PEM file (no \"-----BEGIN \" line)", flag,
                      path);
  }
  return 0;
}

int es__auth_init(es_server *s, mr_err *e) {
  const es_server_opts *o = &s->opts;
  int rc = 0;
  if (!o->tls_cert != !o->tls_key)
    return mr_err_set(e, MR_EINVAL, "%s needs %s too", o->tls_cert ? "--tls-cert" : "--tls-key",
                      o->tls_cert ? "--tls-key" : "--tls-cert");
  if (o->tls_client_ca && !o->tls_cert)
    return mr_err_set(e, MR_EINVAL, "--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS "
                      "with client certificates)");
  if (!o->tls_cert && !o->insecure && !es_listen_is_loopback(o->listen))
    return mr_err_set(e, MR_EINVAL,
                      "--listen %s is not a loopback address: serving plaintext there needs "
                      "--insecure (or serve TLS with --tls-cert and --tls-key)",
                      o->listen);
  if (o->auth_token_file) {
    char tok[MR_SECRET_MAX_BYTES + 1];
    size_t n = 0;
    rc = mr_secret_read(o->auth_token_file, "--auth-token-file", tok, sizeof tok, &n, e);
    if (rc) return rc;
    memcpy(s->auth_value, ES_AUTH_SCHEME, sizeof ES_AUTH_SCHEME - 1);
    memcpy(s->auth_value + sizeof ES_AUTH_SCHEME - 1, tok, n);
    s->auth_len = sizeof ES_AUTH_SCHEME - 1 + n;
    s->auth_on = true;
    mr_secret_wipe(tok, sizeof tok);
  }
  if (o->tls_cert) {
    if ((rc = es__pem_read("--tls-cert", o->tls_cert, &s->pem_cert, e))) return rc;
    if ((rc = es__pem_read("--tls-key", o->tls_key, &s->pem_key, e))) return rc;
    if (o->tls_client_ca && (rc = es__pem_read("--tls-client-ca", o->tls_client_ca,
                                               &s->pem_client_ca, e)))
      return rc;
  }
  /* The paths were borrowed (es.h): nothing reads them after this. */
  s->tls_on = o->tls_cert != NULL;
  s->mtls_on = o->tls_client_ca != NULL;
  s->opts.tls_cert = s->opts.tls_key = s->opts.tls_client_ca = s->opts.auth_token_file = NULL;
  return 0;
}

static void es__pem_free(char **p) {
  if (*p) {
    mr_secret_wipe(*p, strlen(*p));
    mr_free(*p);
    *p = NULL;
  }
}

grpc_server_credentials *es__auth_server_creds(es_server *s) {
  grpc_server_credentials *cr;
  if (!s->tls_on) {
    cr = grpc_insecure_server_credentials_create();
  } else {
    grpc_ssl_pem_key_cert_pair kp = {.private_key = s->pem_key, .cert_chain = s->pem_cert};
    cr = grpc_ssl_server_credentials_create_ex(
        s->pem_client_ca, &kp, 1,
        s->mtls_on ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                   : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
        NULL);
  }
  /* gRPC keeps its own copies: ours, the private key above all, go now. */
  es__pem_free(&s->pem_cert);
  es__pem_free(&s->pem_key);
  es__pem_free(&s->pem_client_ca);
  return cr;
}

void es__auth_close(es_server *s) {
  es__pem_free(&s->pem_cert);
  es__pem_free(&s->pem_key);
  es__pem_free(&s->pem_client_ca);
  mr_secret_wipe(s->auth_value, sizeof s->auth_value);
}

bool es__auth_ok(es_server *s, const grpc_metadata_array *md, const char *peer,
                 const char *method) {
  if (!s->auth_on) return true;
  const grpc_metadata *found = NULL;
  size_t n_found = 0;
  for (size_t i = 0; i < md->count; i++) {
    const grpc_slice *k = &md->metadata[i].key;
    if (GRPC_SLICE_LENGTH(*k) == sizeof ES_AUTH_KEY - 1 &&
        memcmp(GRPC_SLICE_START_PTR(*k), ES_AUTH_KEY, sizeof ES_AUTH_KEY - 1) == 0) {
      found = &md->metadata[i];
      n_found++;
    }
  }
  /* Exactly one authorization entry: two would leave it open which one a proxy checked. */
  bool ok = false;
  if (n_found == 1) {
    const grpc_slice *v = &found->value;
    ok = mr_secret_equal((const char *)GRPC_SLICE_START_PTR(*v), GRPC_SLICE_LENGTH(*v),
                         s->auth_value, s->auth_len);
  }
  if (!ok)
    mr_log_ratelimited(MR_LOG_WARN, 5, "refused %s from %s: %s bearer token", method, peer,
                       n_found == 0 ? "no" : n_found > 1 ? "more than one" : "wrong");
  return ok;
}
