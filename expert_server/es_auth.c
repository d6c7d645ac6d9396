/*
 * es_auth.c - who may talk to the server: TLS credentials (gRPC's own, from PEM files), the
 * bearer token checked on every Hello, Stats and Forward call, the loopback rule for
 * plaintext, and the reload of both on SIGHUP. docs/DESIGN.md section 11.
 *
 * Start-up (es__auth_init, before the model loads): the flags are checked, the token file
 * and the PEM files are read and checked (the key's file mode, every certificate of the
 * chain within its validity dates, the key matching the first certificate: libcrypto), the
 * token is kept as the whole expected metadata value "Bearer <token>", and the TLS files
 * become one grpc_ssl_server_certificate_config, left in tls_pending.
 *
 * TLS credentials are built on a certificate config fetcher (es__tls_fetch), gRPC's way to
 * change a server's certificates without a restart: gRPC calls it once when the port is
 * added and then at every new connection's handshake, from its own threads. It hands over
 * the pending config, if any (gRPC takes ownership), else says "unchanged". Connections
 * already made keep the certificate they were made with.
 *
 * Reload (es__auth_reload, admin thread, on SIGHUP): the same paths are read and checked
 * again, all of them before anything changes: a bad file, an expired certificate or a key
 * that does not match leaves the old credentials in place and is reported. Then the token
 * is swapped under auth_lock and the new TLS config becomes tls_pending under tls_lock.
 *
 * Threads and locks: auth_value / auth_len are read by the CQ threads (es__auth_ok) and
 * written by the admin thread, under auth_lock; tls_pending is written by the admin thread
 * and taken by gRPC's handshake threads, under tls_lock. Both locks are leaves (held for a
 * compare of 4 KiB or a pointer swap; no other lock is taken under them).
 */
#include <arpa/inet.h>
#include <grpc/grpc_security.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>

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

/* Reads one PEM file named by flag into a heap string (caller wipes and frees); a private
 * key's file must not be readable by group or others (mr_file_read_private). */
static int es__pem_read(const char *flag, const char *path, bool private, char **out, mr_err *e) {
  size_t len = 0;
  int rc = private ? mr_file_read_private(path, ES_MAX_PEM_BYTES, out, &len, e)
                   : mr_file_read(path, ES_MAX_PEM_BYTES, out, &len, e);
  if (rc) return mr_err_prefix(e, rc, "%s", flag);
  if (len == 0 || !strstr(*out, "-----BEGIN ")) {
    mr_free(*out);
    *out = NULL;
    return mr_err_set(e, MR_EINVAL, "%s %s: not a PEM file (no \"-----BEGIN \" line)", flag,
                      path);
  }
  return 0;
}

static void es__pem_free(char **p) {
  if (*p) {
    mr_secret_wipe(*p, strlen(*p));
    mr_free(*p);
    *p = NULL;
  }
}

/* ---- certificates (libcrypto) ------------------------------------------------------------ */

/* "2026-12-01 10:00:00 UTC" */
static void es__asn1_date(const ASN1_TIME *t, char *buf, size_t len) {
  struct tm tm;
  if (!t || ASN1_TIME_to_tm(t, &tm) != 1 || strftime(buf, len, "%Y-%m-%d %H:%M:%S UTC", &tm) == 0)
    snprintf(buf, len, "(an unreadable date)");
}

/* OpenSSL's first queued error, as text, and the queue cleared. */
static const char *es__ssl_err(char *buf, size_t len) {
  unsigned long code = ERR_get_error();
  if (code) ERR_error_string_n(code, buf, len);
  else snprintf(buf, len, "no detail");
  ERR_clear_error();
  return buf;
}

/* Never asks for a passphrase (OpenSSL's default would read the terminal): an encrypted key
 * simply does not load, and gRPC could not use one either. */
static int es__no_passphrase(char *buf, int size, int rwflag, void *u) {
  (void)buf, (void)size, (void)rwflag, (void)u;
  return 0;
}

/* Checks the chain in cert_pem (read from path): at least one certificate, each one valid
 * now (notBefore <= now < notAfter), and key_pem's key that of the first one. A refusal names
 * the file, the certificate (its place in the chain and subject) and both dates; the host's
 * clock is what "now" is. until gets the first certificate's notAfter for the log line. */
static int es__cert_check(const char *path, const char *cert_pem, const char *key_pem,
                          char *until, size_t until_len, mr_err *e) {
  char ebuf[256];
  int rc = 0;
  X509 *leaf = NULL;
  EVP_PKEY *key = NULL;
  ERR_clear_error();
  BIO *bio = BIO_new_mem_buf(cert_pem, -1);
  if (!bio) return mr_err_set(e, MR_ENOMEM, "--tls-cert %s: out of memory", path);
  for (int n = 1;; n++) {
    X509 *x = PEM_read_bio_X509(bio, NULL, es__no_passphrase, NULL);
    if (!x) {
      if (n == 1)
        rc = mr_err_set(e, MR_EINVAL, "--tls-cert %s: no certificate could be read (%s)", path,
                        es__ssl_err(ebuf, sizeof ebuf));
      ERR_clear_error(); /* the end of the file reads as an error too */
      break;
    }
    char subj[256], esc[MR_LOG_ESC_MAX], from[40], to[40];
    X509_NAME_oneline(X509_get_subject_name(x), subj, sizeof subj);
    mr_log_escape(esc, sizeof esc, subj, strlen(subj));
    const ASN1_TIME *nb = X509_get0_notBefore(x), *na = X509_get0_notAfter(x);
    es__asn1_date(nb, from, sizeof from);
    es__asn1_date(na, to, sizeof to);
    int c_nb = X509_cmp_current_time(nb), c_na = X509_cmp_current_time(na);
    if (c_nb == 0 || c_na == 0)
      rc = mr_err_set(e, MR_EINVAL, "--tls-cert %s: certificate %d (subject %s) has a validity "
                      "date that cannot be read (notBefore %s, notAfter %s)", path, n, esc, from,
                      to);
    else if (c_nb > 0)
      rc = mr_err_set(e, MR_EINVAL, "--tls-cert %s: certificate %d (subject %s) is not valid "
                      "yet: valid from %s to %s (is this host's clock right?)", path, n, esc,
                      from, to);
    else if (c_na < 0)
      rc = mr_err_set(e, MR_EINVAL, "--tls-cert %s: certificate %d (subject %s) expired: valid "
                      "from %s to %s", path, n, esc, from, to);
    if (n == 1) {
      leaf = x;
      snprintf(until, until_len, "%s", to);
    } else {
      X509_free(x);
    }
    if (rc) break;
  }
  BIO_free(bio);
  if (rc || !key_pem) goto out_free;
  bio = BIO_new_mem_buf(key_pem, -1);
  key = bio ? PEM_read_bio_PrivateKey(bio, NULL, es__no_passphrase, NULL) : NULL;
  if (bio) {
    BIO_free(bio);
  }
  if (!key)
    rc = mr_err_set(e, MR_EINVAL, "--tls-key: no private key could be read (%s; an encrypted "
                    "key is not supported)", es__ssl_err(ebuf, sizeof ebuf));
  else if (X509_check_private_key(leaf, key) != 1)
    rc = mr_err_set(e, MR_EINVAL, "--tls-key is not the key of the first certificate of "
                    "--tls-cert %s (%s)", path, es__ssl_err(ebuf, sizeof ebuf));
out_free:
  EVP_PKEY_free(key);
  X509_free(leaf);
  ERR_clear_error();
  return rc;
}

/* ---- reading everything, for start-up and reload ------------------------------------------ */

/* What one read of the files yields, before it is put in place. */
typedef struct es_creds {
  char tok[MR_SECRET_MAX_BYTES + 1];
  size_t tok_len;
  grpc_ssl_server_certificate_config *tls; /* NULL without TLS */
  char until[40];                          /* the first certificate's notAfter */
} es_creds;

/* Reads the token file and the TLS files of s (the paths kept at start-up) into c, checking
 * all of them. On failure nothing is left in c. */
static int es__creds_read(es_server *s, es_creds *c, mr_err *e) {
  int rc = 0;
  char *cert = NULL, *key = NULL, *ca = NULL;
  memset(c, 0, sizeof *c);
  if (s->token_path &&
      (rc = mr_secret_read(s->token_path, "--auth-token-file", c->tok, sizeof c->tok,
                           &c->tok_len, e)))
    return rc;
  if (!s->tls_cert_path) return 0;
  if ((rc = es__pem_read("--tls-cert", s->tls_cert_path, false, &cert, e)) ||
      (rc = es__pem_read("--tls-key", s->tls_key_path, true, &key, e)) ||
      (s->tls_ca_path && (rc = es__pem_read("--tls-client-ca", s->tls_ca_path, false, &ca, e))) ||
      (rc = es__cert_check(s->tls_cert_path, cert, key, c->until, sizeof c->until, e)))
    goto out_free;
  grpc_ssl_pem_key_cert_pair kp = {.private_key = key, .cert_chain = cert};
  /* gRPC copies the strings: ours, the private key above all, are wiped below. gRPC 1.51
   * asserts that a fetched config has client roots even when no client certificate is
   * requested (ssl_security_connector.cc); without --tls-client-ca the server's own chain
   * stands in: with GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE nothing is verified against it
   * and no client is asked for a certificate. */
  c->tls = grpc_ssl_server_certificate_config_create(ca ? ca : cert, &kp, 1);
  if (!c->tls) rc = mr_err_set(e, MR_ENOMEM, "--tls-cert: out of memory for the TLS config");
out_free:
  es__pem_free(&cert);
  es__pem_free(&key);
  es__pem_free(&ca);
  if (rc) mr_secret_wipe(c->tok, sizeof c->tok);
  return rc;
}

/* Puts c in place (the token under auth_lock, the TLS config as the pending one under
 * tls_lock); c is emptied. */
static void es__creds_install(es_server *s, es_creds *c) {
  if (s->token_path) {
    pthread_mutex_lock(&s->auth_lock);
    memcpy(s->auth_value, ES_AUTH_SCHEME, sizeof ES_AUTH_SCHEME - 1);
    memcpy(s->auth_value + sizeof ES_AUTH_SCHEME - 1, c->tok, c->tok_len);
    s->auth_len = sizeof ES_AUTH_SCHEME - 1 + c->tok_len;
    pthread_mutex_unlock(&s->auth_lock);
  }
  mr_secret_wipe(c->tok, sizeof c->tok);
  if (c->tls) {
    pthread_mutex_lock(&s->tls_lock);
    grpc_ssl_server_certificate_config *old = s->tls_pending;
    s->tls_pending = c->tls;
    pthread_mutex_unlock(&s->tls_lock);
    /* A config no handshake took since the last reload: never used. */
    if (old) grpc_ssl_server_certificate_config_destroy(old);
    snprintf(s->tls_until, sizeof s->tls_until, "%s", c->until);
    c->tls = NULL;
  }
}

static int es__path_keep(const char *path, char **out, mr_err *e) {
  if (!path) return 0;
  *out = mr_strdup(path);
  return *out ? 0 : mr_err_set(e, MR_ENOMEM, "out of memory copying the path %s", path);
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
  /* The paths were borrowed (es.h); SIGHUP reads the same files again, so keep copies. */
  if ((rc = es__path_keep(o->auth_token_file, &s->token_path, e)) ||
      (rc = es__path_keep(o->tls_cert, &s->tls_cert_path, e)) ||
      (rc = es__path_keep(o->tls_key, &s->tls_key_path, e)) ||
      (rc = es__path_keep(o->tls_client_ca, &s->tls_ca_path, e)))
    return rc;
  s->opts.tls_cert = s->opts.tls_key = s->opts.tls_client_ca = s->opts.auth_token_file = NULL;
  es_creds c;
  if ((rc = es__creds_read(s, &c, e))) return rc;
  s->auth_on = s->token_path != NULL;
  s->tls_on = s->tls_cert_path != NULL;
  s->mtls_on = s->tls_ca_path != NULL;
  es__creds_install(s, &c);
  if (s->tls_on)
    mr_log(MR_LOG_INFO, "tls: --tls-cert %s valid until %s%s", s->tls_cert_path, s->tls_until,
           s->mtls_on ? "; client certificates required (--tls-client-ca)" : "");
  return 0;
}

/* gRPC's certificate config fetcher (any gRPC thread; see the top of the file). */
static grpc_ssl_certificate_config_reload_status es__tls_fetch(
    void *ud, grpc_ssl_server_certificate_config **config) {
  es_server *s = ud;
  pthread_mutex_lock(&s->tls_lock);
  grpc_ssl_server_certificate_config *c = s->tls_pending;
  s->tls_pending = NULL;
  pthread_mutex_unlock(&s->tls_lock);
  if (!c) return GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
  *config = c;
  return GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW;
}

grpc_server_credentials *es__auth_server_creds(es_server *s) {
  if (!s->tls_on) return grpc_insecure_server_credentials_create();
  grpc_ssl_server_credentials_options *o =
      grpc_ssl_server_credentials_create_options_using_config_fetcher(
          s->mtls_on ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                     : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
          es__tls_fetch, s);
  return o ? grpc_ssl_server_credentials_create_with_options(o) : NULL;
}

int es__auth_reload(es_server *s, char *what, size_t len, mr_err *e) {
  es_creds c;
  int rc = es__creds_read(s, &c, e);
  if (rc) return rc;
  es__creds_install(s, &c);
  size_t pos = 0;
  what[0] = '\0';
  if (s->tls_on)
    pos += (size_t)snprintf(what, len, "--tls-cert %s (valid until %s), --tls-key %s%s%s",
                            s->tls_cert_path, s->tls_until, s->tls_key_path,
                            s->mtls_on ? ", --tls-client-ca " : "",
                            s->mtls_on ? s->tls_ca_path : "");
  if (s->auth_on && pos < len)
    snprintf(what + pos, len - pos, "%s--auth-token-file %s", pos ? ", " : "", s->token_path);
  return 0;
}

void es__auth_close(es_server *s) {
  if (s->tls_pending) grpc_ssl_server_certificate_config_destroy(s->tls_pending);
  s->tls_pending = NULL;
  mr_secret_wipe(s->auth_value, sizeof s->auth_value);
  mr_free(s->token_path);
  mr_free(s->tls_cert_path);
  mr_free(s->tls_key_path);
  mr_free(s->tls_ca_path);
  s->token_path = s->tls_cert_path = s->tls_key_path = s->tls_ca_path = NULL;
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
    pthread_mutex_lock(&s->auth_lock); /* a SIGHUP may be swapping the token */
    ok = mr_secret_equal((const char *)GRPC_SLICE_START_PTR(*v), GRPC_SLICE_LENGTH(*v),
                         s->auth_value, s->auth_len);
    pthread_mutex_unlock(&s->auth_lock);
  }
  if (!ok)
    mr_log_ratelimited(MR_LOG_WARN, 5, "refused %s from %s: %s bearer token", method, peer,
                       n_found == 0 ? "no" : n_found > 1 ? "more than one" : "wrong");
  return ok;
}
