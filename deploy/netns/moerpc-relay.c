/*
 * moerpc-relay - a TCP relay that adds a fixed one-way delay, and optionally TCP-like loss
 * stalls, to every connection through it. It stands in for netem on kernels without
 * sch_netem (deploy/netns/README.md says when each is used, and why a "loss" here is a
 * stall, not lost bytes).
 *
 *   moerpc-relay --listen HOST:PORT --target HOST:PORT [--delay-us N] [--loss P]
 *                [--rto-ms N] [--seed N] [--max-conns N] [--max-queue-bytes N]
 *
 * Model. Every read from one side of a connection is a chunk stamped with a due time,
 * now + delay, and queued for the other side; a queue is sent in order once its head is
 * due. Both directions of every connection are delayed the same way, independently, and
 * no connection waits for another: one thread, epoll, and a timerfd armed at the earliest
 * due head. With probability P a chunk is held another --rto-ms (TCP's minimum RTO is
 * 200 ms): on TCP a lost segment is not lost data but a stall of the stream until the
 * retransmission, and everything behind it waits too (the queue is FIFO; a chunk's due
 * time is never earlier than the one before it).
 *
 * Lifecycle: the relay connects to the target for every accepted client; a refused or
 * failed target connect closes the client with a reset (so a client sees "server down"
 * as it would without the relay). End of stream is forwarded (shutdown SHUT_WR) after the
 * same delay; a reset or error on either side closes both at once with a reset. One log
 * line per event (listening, accepted, connected, closed with byte counts, stopping);
 * nothing per chunk.
 *
 * Threads: one. Ownership: the relay owns every fd and chunk it creates; a connection's
 * chunks are freed with it.
 */
#define _GNU_SOURCE /* accept4 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include "common/mr.h"

#define RL_READ_MAX (64u * 1024u)  /* bytes per read, i.e. the largest chunk */
#define RL_MAX_EVENTS 64

typedef struct rl_args {
  const char *listen, *target;
  uint64_t delay_ns;   /* one-way delay added in each direction */
  double loss;         /* probability that a chunk stalls, 0..1 */
  uint64_t rto_ns;     /* the stall */
  uint64_t seed;
  uint32_t max_conns;
  size_t max_queue;    /* bytes queued per direction before reading pauses */
} rl_args;

/* One read, waiting for its due time. An eof chunk (len 0) forwards end of stream. */
typedef struct rl_chunk {
  struct rl_chunk *next;
  uint64_t due_ns;
  uint32_t len, off;
  bool eof;
  unsigned char data[];
} rl_chunk;

/* One direction of a connection: bytes read from `from`, written to `to`. */
typedef struct rl_dir {
  int from, to;
  rl_chunk *head, *tail;
  size_t queued;      /* bytes in the queue */
  bool read_eof;      /* `from` said end of stream; nothing more is read */
  bool write_shut;    /* the eof chunk went out: `to` is shut for writing */
  bool blocked;       /* `to` returned EAGAIN: wait for EPOLLOUT */
  uint64_t bytes, chunks, stalls;
} rl_dir;

struct rl_conn;
/* What an epoll event points at: one socket of one connection. */
typedef struct rl_end {
  struct rl_conn *c;
  int fd;
  uint32_t armed; /* the epoll events registered now */
} rl_end;

typedef struct rl_conn {
  struct rl_conn *prev, *next;
  uint64_t id;
  uint64_t t0_ns;
  bool connecting;    /* the target connect is in progress */
  const char *fail;   /* set once: why the connection is being closed (static text) */
  int fail_errno;
  rl_end client, target;
  rl_dir up;          /* client -> target */
  rl_dir down;        /* target -> client */
  char peer[64];
} rl_conn;

typedef struct rl_relay {
  rl_args a;
  int ep, lfd, tfd, sfd;
  struct sockaddr_storage target;
  socklen_t target_len;
  rl_conn *conns;     /* doubly linked list of live connections (owned) */
  uint32_t n_conns;
  uint64_t next_id;
  uint64_t rng;
  uint64_t armed_due; /* what the timerfd is armed for, 0 = disarmed */
  uint64_t total_conns, total_stalls, total_bytes;
} rl_relay;

static const char rl_usage[] =
    "usage: moerpc-relay --listen HOST:PORT --target HOST:PORT [options]\n"
    "\n"
    "A TCP relay that delays every chunk it forwards by a fixed one-way delay, in both\n"
    "directions of every connection, preserving order; optionally a fraction of the chunks\n"
    "is held an extra RTO, which is how packet loss shows up on TCP (a stall, not lost\n"
    "bytes). For the multi-host harness on kernels without netem (deploy/netns/README.md).\n"
    "\n"
    "  --listen HOST:PORT       address to accept clients on (port 0 = any, logged)  required\n"
    "  --target HOST:PORT       where each client is connected to                    required\n"
    "  --delay-us N             one-way delay added in each direction, 0..10000000 (default 0)\n"
    "  --loss P                 probability that a chunk stalls, 0..1 (default 0)\n"
    "  --rto-ms N               the stall, 1..60000 (default 200, TCP's minimum RTO)\n"
    "  --seed N                 seed of the stall draws (default 1)\n"
    "  --max-conns N            connections at once, 1..65536 (default 1024; more are refused)\n"
    "  --max-queue-bytes N      bytes queued per direction before reading pauses,\n"
    "                           65536..1073741824 (default 67108864)\n"
    "  --log-level L            error|warn|info|debug (default info, or env MOERPC_LOG)\n"
    "  --help                   this text\n"
    "\n"
    "Exit status: 0 after SIGTERM/SIGINT, 1 on a runtime failure, 2 on a usage error.\n";

static int rl_usage_error(const char *fmt, const char *arg) {
  fprintf(stderr, "moerpc-relay: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, " (see --help)\n");
  return 2;
}

static bool rl_parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out) {
  if (!s || !*s || *s == '-') return false;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || *end || v < lo || v > hi) return false;
  *out = v;
  return true;
}

/* Splits "host:port" or "[v6]:port" and resolves it (numeric or a name, once at start).
 * Returns 0, or -1 with a message on stderr naming the flag. */
static int rl_resolve(const char *flag, const char *spec, bool passive,
                      struct sockaddr_storage *ss, socklen_t *len) {
  char host[256];
  const char *colon = strrchr(spec, ':');
  if (!colon || colon == spec || strlen(spec) >= sizeof host) {
    fprintf(stderr, "moerpc-relay: %s '%s': expected HOST:PORT\n", flag, spec);
    return -1;
  }
  size_t hl = (size_t)(colon - spec);
  memcpy(host, spec, hl);
  host[hl] = 0;
  if (hl >= 2 && host[0] == '[' && host[hl - 1] == ']') {
    memmove(host, host + 1, hl - 2);
    host[hl - 2] = 0;
  }
  uint64_t port;
  if (!rl_parse_u64(colon + 1, 0, 65535, &port) || (!passive && port == 0)) {
    fprintf(stderr, "moerpc-relay: %s '%s': port must be %s..65535\n", flag, spec,
            passive ? "0" : "1");
    return -1;
  }
  struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = passive ? AI_PASSIVE : 0};
  struct addrinfo *res = NULL;
  int rc = getaddrinfo(host, colon + 1, &hints, &res);
  if (rc != 0 || !res) {
    fprintf(stderr, "moerpc-relay: %s '%s': %s\n", flag, spec, gai_strerror(rc));
    return -1;
  }
  memcpy(ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return 0;
}

static void rl_addr_str(const struct sockaddr *sa, char *out, size_t cap) {
  char h[INET6_ADDRSTRLEN] = "?", p[8] = "?";
  getnameinfo(sa, sa->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                            : sizeof(struct sockaddr_in),
              h, sizeof h, p, sizeof p, NI_NUMERICHOST | NI_NUMERICSERV);
  snprintf(out, cap, sa->sa_family == AF_INET6 ? "[%s]:%s" : "%s:%s", h, p);
}

/* xorshift64*: the stall draws; reproducible for one --seed and one chunking. */
static double rl_uniform(rl_relay *r) {
  r->rng ^= r->rng >> 12;
  r->rng ^= r->rng << 25;
  r->rng ^= r->rng >> 27;
  return (double)((r->rng * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}

static void rl_sock_tune(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* gRPC sets it too */
}

/* Registers or updates what epoll watches on one end. */
static void rl_end_arm(rl_relay *r, rl_end *e, uint32_t want) {
  if (e->fd < 0 || e->armed == want) return;
  struct epoll_event ev = {.events = want, .data.ptr = e};
  if (epoll_ctl(r->ep, EPOLL_CTL_MOD, e->fd, &ev) == 0) e->armed = want;
}

/* Interest follows state: read while the direction out of an end is open and not over
 * its queue cap; write-wait while the direction into it is blocked or it is connecting. */
static void rl_conn_arm(rl_relay *r, rl_conn *c) {
  uint32_t wc = 0, wt = 0;
  if (c->connecting) {
    wt = EPOLLOUT;
  } else {
    if (!c->up.read_eof && c->up.queued < r->a.max_queue) wc |= EPOLLIN;
    if (!c->down.read_eof && c->down.queued < r->a.max_queue) wt |= EPOLLIN;
    if (c->up.blocked) wt |= EPOLLOUT;
    if (c->down.blocked) wc |= EPOLLOUT;
  }
  rl_end_arm(r, &c->client, wc);
  rl_end_arm(r, &c->target, wt);
}

static void rl_conn_fail(rl_conn *c, const char *why, int err) {
  if (!c->fail) {
    c->fail = why;
    c->fail_errno = err;
  }
}

static void rl_dir_free(rl_dir *d) {
  while (d->head) {
    rl_chunk *n = d->head->next;
    mr_free(d->head);
    d->head = n;
  }
  d->tail = NULL;
  d->queued = 0;
}

/* Closes both sockets (with a reset when the connection failed, so the peer sees what
 * the relay saw), logs the totals and frees the connection. */
static void rl_conn_close(rl_relay *r, rl_conn *c) {
  double ms = (double)(mr_now_ns() - c->t0_ns) / 1e6;
  if (c->fail) {
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    setsockopt(c->client.fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    if (c->target.fd >= 0) setsockopt(c->target.fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
  }
  char why[160];
  if (c->fail && c->fail_errno)
    snprintf(why, sizeof why, "%s: %s", c->fail, strerror(c->fail_errno));
  else
    snprintf(why, sizeof why, "%s", c->fail ? c->fail : "both sides ended");
  mr_log(c->fail ? MR_LOG_WARN : MR_LOG_INFO,
         "conn %llu from %s closed (%s) after %.0f ms: up %llu bytes in %llu chunks, %llu "
         "stalls; down %llu bytes in %llu chunks, %llu stalls",
         (unsigned long long)c->id, c->peer, why, ms, (unsigned long long)c->up.bytes,
         (unsigned long long)c->up.chunks, (unsigned long long)c->up.stalls,
         (unsigned long long)c->down.bytes, (unsigned long long)c->down.chunks,
         (unsigned long long)c->down.stalls);
  r->total_stalls += c->up.stalls + c->down.stalls;
  r->total_bytes += c->up.bytes + c->down.bytes;
  close(c->client.fd);
  if (c->target.fd >= 0) close(c->target.fd);
  rl_dir_free(&c->up);
  rl_dir_free(&c->down);
  if (c->prev) c->prev->next = c->next; else r->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  r->n_conns--;
  mr_free(c);
}

/* Reads what `from` has (until EAGAIN or the queue cap) into chunks due after the delay. */
static void rl_dir_read(rl_relay *r, rl_conn *c, rl_dir *d) {
  unsigned char buf[RL_READ_MAX];
  while (!d->read_eof && d->queued < r->a.max_queue && !c->fail) {
    ssize_t n = read(d->from, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        rl_conn_fail(c, d == &c->up ? "client read failed" : "target read failed", errno);
      return;
    }
    rl_chunk *k = mr_malloc(sizeof *k + (size_t)n);
    if (!k) {
      rl_conn_fail(c, "out of memory", ENOMEM);
      return;
    }
    uint64_t now = mr_now_ns();
    k->next = NULL;
    memcpy(k->data, buf, (size_t)n);
    k->len = (uint32_t)n;
    k->off = 0;
    k->eof = n == 0;
    k->due_ns = now + r->a.delay_ns;
    if (n > 0 && r->a.loss > 0 && rl_uniform(r) < r->a.loss) {
      k->due_ns += r->a.rto_ns;
      d->stalls++;
    }
    if (d->tail && k->due_ns < d->tail->due_ns) k->due_ns = d->tail->due_ns; /* FIFO */
    if (d->tail) d->tail->next = k; else d->head = k;
    d->tail = k;
    d->queued += (size_t)n;
    if (n == 0) {
      d->read_eof = true;
    } else {
      d->chunks++;
    }
  }
}

/* Writes the due head chunks of d; returns the due time of the next one waiting (0: none,
 * or blocked on the socket). */
static uint64_t rl_dir_flush(rl_conn *c, rl_dir *d, uint64_t now) {
  while (d->head && !c->fail && !d->blocked) {
    rl_chunk *k = d->head;
    if (k->due_ns > now) return k->due_ns;
    if (k->eof) {
      shutdown(d->to, SHUT_WR);
      d->write_shut = true;
    } else {
      ssize_t n = send(d->to, k->data + k->off, k->len - k->off, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          d->blocked = true;
          return 0;
        }
        rl_conn_fail(c, d == &c->up ? "target write failed" : "client write failed", errno);
        return 0;
      }
      k->off += (uint32_t)n;
      d->bytes += (uint64_t)n;
      d->queued -= (size_t)n;
      if (k->off < k->len) continue;
    }
    d->head = k->next;
    if (!d->head) d->tail = NULL;
    mr_free(k);
  }
  return 0;
}

static void rl_accept(rl_relay *r) {
  for (;;) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int fd = accept4(r->lfd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        mr_log_ratelimited(MR_LOG_WARN, 5, "accept failed: %s", strerror(errno));
      return;
    }
    char peer[64];
    rl_addr_str((struct sockaddr *)&ss, peer, sizeof peer);
    if (r->n_conns >= r->a.max_conns) {
      mr_log_ratelimited(MR_LOG_WARN, 5, "refusing %s: %u connections open (--max-conns)",
                         peer, r->n_conns);
      close(fd);
      continue;
    }
    rl_conn *c = mr_calloc(1, sizeof *c);
    int tfd = socket(r->target.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (!c || tfd < 0) {
      mr_log(MR_LOG_ERROR, "refusing %s: %s", peer, c ? strerror(errno) : "out of memory");
      if (tfd >= 0) close(tfd);
      mr_free(c);
      close(fd);
      continue;
    }
    rl_sock_tune(fd);
    rl_sock_tune(tfd);
    c->id = ++r->next_id;
    c->t0_ns = mr_now_ns();
    snprintf(c->peer, sizeof c->peer, "%s", peer);
    c->client = (rl_end){.c = c, .fd = fd};
    c->target = (rl_end){.c = c, .fd = tfd};
    c->up = (rl_dir){.from = fd, .to = tfd};
    c->down = (rl_dir){.from = tfd, .to = fd};
    c->next = r->conns;
    if (r->conns) r->conns->prev = c;
    r->conns = c;
    r->n_conns++;
    r->total_conns++;
    struct epoll_event ev = {.events = 0, .data.ptr = &c->client};
    epoll_ctl(r->ep, EPOLL_CTL_ADD, fd, &ev);
    ev.data.ptr = &c->target;
    epoll_ctl(r->ep, EPOLL_CTL_ADD, tfd, &ev);
    int rc = connect(tfd, (struct sockaddr *)&r->target, r->target_len);
    if (rc < 0 && errno != EINPROGRESS) {
      mr_log(MR_LOG_INFO, "conn %llu from %s accepted", (unsigned long long)c->id, peer);
      rl_conn_fail(c, "target connect failed", errno);
      continue;
    }
    c->connecting = rc < 0;
    mr_log(MR_LOG_INFO, "conn %llu from %s accepted, %s to %s", (unsigned long long)c->id,
           peer, c->connecting ? "connecting" : "connected", r->a.target);
    rl_conn_arm(r, c);
  }
}

static void rl_end_event(rl_relay *r, rl_end *e, uint32_t ev) {
  rl_conn *c = e->c;
  if (c->fail) return;
  bool is_target = e == &c->target;
  if (is_target && c->connecting) {
    int err = 0;
    socklen_t el = sizeof err;
    getsockopt(e->fd, SOL_SOCKET, SO_ERROR, &err, &el);
    if (err || (ev & (EPOLLERR | EPOLLHUP))) {
      rl_conn_fail(c, "target connect failed", err ? err : ECONNREFUSED);
      return;
    }
    c->connecting = false;
    mr_log(MR_LOG_INFO, "conn %llu: connected to %s", (unsigned long long)c->id, r->a.target);
    return;
  }
  rl_dir *out = is_target ? &c->down : &c->up; /* the direction read from this end */
  rl_dir *in = is_target ? &c->up : &c->down;  /* the direction written to it */
  if (ev & EPOLLOUT) in->blocked = false;
  if (ev & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
    if (!out->read_eof && out->queued < r->a.max_queue) {
      rl_dir_read(r, c, out);
    } else if (ev & EPOLLERR) {
      int err = 0;
      socklen_t el = sizeof err;
      getsockopt(e->fd, SOL_SOCKET, SO_ERROR, &err, &el);
      rl_conn_fail(c, is_target ? "target socket error" : "client socket error", err);
    } else if ((ev & EPOLLHUP) && in->head == NULL && out->read_eof) {
      /* Both ways shut and nothing left to send it: nothing more can happen here. */
      in->write_shut = true;
    }
  }
}

static int rl_listen(rl_relay *r) {
  struct sockaddr_storage ss;
  socklen_t sl;
  if (rl_resolve("--listen", r->a.listen, true, &ss, &sl)) return -1;
  r->lfd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int one = 1;
  if (r->lfd < 0 || setsockopt(r->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
      bind(r->lfd, (struct sockaddr *)&ss, sl) || listen(r->lfd, 128)) {
    fprintf(stderr, "moerpc-relay: --listen %s: %s\n", r->a.listen, strerror(errno));
    return -1;
  }
  sl = sizeof ss;
  getsockname(r->lfd, (struct sockaddr *)&ss, &sl);
  char where[80];
  rl_addr_str((struct sockaddr *)&ss, where, sizeof where);
  mr_log(MR_LOG_INFO,
         "listening on %s -> %s: delay %.3f ms each way, loss %.4f (stall +%.0f ms), seed %llu",
         where, r->a.target, (double)r->a.delay_ns / 1e6, r->a.loss, (double)r->a.rto_ns / 1e6,
         (unsigned long long)r->a.seed);
  return 0;
}

static int rl_run(rl_relay *r) {
  sigset_t ss;
  sigemptyset(&ss);
  sigaddset(&ss, SIGINT);
  sigaddset(&ss, SIGTERM);
  sigprocmask(SIG_BLOCK, &ss, NULL);
  signal(SIGPIPE, SIG_IGN);
  /* The default 50 us timer slack would be as large as the 25gbe profile's delay. */
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
  r->ep = epoll_create1(EPOLL_CLOEXEC);
  r->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  r->sfd = signalfd(-1, &ss, SFD_NONBLOCK | SFD_CLOEXEC);
  if (r->ep < 0 || r->tfd < 0 || r->sfd < 0) {
    mr_log(MR_LOG_ERROR, "epoll/timerfd/signalfd: %s", strerror(errno));
    return 1;
  }
  static rl_end lend, tend, send_;
  lend.fd = r->lfd;
  tend.fd = r->tfd;
  send_.fd = r->sfd;
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &lend};
  epoll_ctl(r->ep, EPOLL_CTL_ADD, r->lfd, &ev);
  ev.data.ptr = &tend;
  epoll_ctl(r->ep, EPOLL_CTL_ADD, r->tfd, &ev);
  ev.data.ptr = &send_;
  epoll_ctl(r->ep, EPOLL_CTL_ADD, r->sfd, &ev);

  struct epoll_event evs[RL_MAX_EVENTS];
  for (;;) {
    int n = epoll_wait(r->ep, evs, RL_MAX_EVENTS, -1);
    if (n < 0 && errno != EINTR) {
      mr_log(MR_LOG_ERROR, "epoll_wait: %s", strerror(errno));
      return 1;
    }
    for (int i = 0; i < n; i++) {
      rl_end *e = evs[i].data.ptr;
      if (e == &lend) {
        rl_accept(r);
      } else if (e == &tend) {
        uint64_t x;
        if (read(r->tfd, &x, sizeof x) < 0) { /* EAGAIN: a timer re-armed meanwhile */ }
        r->armed_due = 0;
      } else if (e == &send_) {
        struct signalfd_siginfo si;
        if (read(r->sfd, &si, sizeof si) != (ssize_t)sizeof si) continue;
        uint32_t open = r->n_conns;
        while (r->conns) {
          rl_conn_fail(r->conns, "relay stopping", 0);
          rl_conn_close(r, r->conns);
        }
        mr_log(MR_LOG_INFO,
               "stopping on %s: %u connections were open, %llu accepted in all, %llu bytes "
               "forwarded, %llu stalls",
               si.ssi_signo == SIGTERM ? "SIGTERM" : "SIGINT", open,
               (unsigned long long)r->total_conns, (unsigned long long)r->total_bytes,
               (unsigned long long)r->total_stalls);
        return 0;
      } else {
        rl_end_event(r, e, evs[i].events);
      }
    }
    /* Send what is due, close what is over, and wake at the next due chunk. */
    uint64_t now = mr_now_ns(), next = 0;
    for (rl_conn *c = r->conns, *nx; c; c = nx) {
      nx = c->next;
      if (!c->fail && !c->connecting) {
        uint64_t a = rl_dir_flush(c, &c->up, now), b = rl_dir_flush(c, &c->down, now);
        if (a && (!next || a < next)) next = a;
        if (b && (!next || b < next)) next = b;
      }
      if (c->fail || (c->up.write_shut && c->down.write_shut)) {
        rl_conn_close(r, c);
        continue;
      }
      rl_conn_arm(r, c);
    }
    if (next && next != r->armed_due) {
      struct itimerspec its = {.it_value = {.tv_sec = (time_t)(next / 1000000000u),
                                            .tv_nsec = (long)(next % 1000000000u)}};
      timerfd_settime(r->tfd, TFD_TIMER_ABSTIME, &its, NULL);
      r->armed_due = next;
    }
  }
}

int main(int argc, char **argv) {
  mr_log_set_component("relay");
  rl_relay r = {.lfd = -1};
  r.a = (rl_args){.rto_ns = 200000000ull, .seed = 1, .max_conns = 1024,
                  .max_queue = 64u << 20};
  for (int i = 1; i < argc; i++) {
    const char *f = argv[i];
    if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
      fputs(rl_usage, stdout);
      return 0;
    }
    if (i + 1 >= argc) return rl_usage_error("%s needs a value", f);
    const char *v = argv[++i];
    uint64_t u;
    if (!strcmp(f, "--listen")) {
      r.a.listen = v;
    } else if (!strcmp(f, "--target")) {
      r.a.target = v;
    } else if (!strcmp(f, "--delay-us")) {
      if (!rl_parse_u64(v, 0, 10000000, &u)) return rl_usage_error("--delay-us '%s': expected 0..10000000", v);
      r.a.delay_ns = u * 1000u;
    } else if (!strcmp(f, "--loss")) {
      char *end;
      errno = 0;
      double p = strtod(v, &end);
      if (errno || *end || !(p >= 0 && p <= 1)) return rl_usage_error("--loss '%s': expected 0..1", v);
      r.a.loss = p;
    } else if (!strcmp(f, "--rto-ms")) {
      if (!rl_parse_u64(v, 1, 60000, &u)) return rl_usage_error("--rto-ms '%s': expected 1..60000", v);
      r.a.rto_ns = u * 1000000u;
    } else if (!strcmp(f, "--seed")) {
      if (!rl_parse_u64(v, 0, UINT64_MAX, &u)) return rl_usage_error("--seed '%s': expected 0..2^64-1", v);
      r.a.seed = u;
    } else if (!strcmp(f, "--max-conns")) {
      if (!rl_parse_u64(v, 1, 65536, &u)) return rl_usage_error("--max-conns '%s': expected 1..65536", v);
      r.a.max_conns = (uint32_t)u;
    } else if (!strcmp(f, "--max-queue-bytes")) {
      if (!rl_parse_u64(v, 65536, 1u << 30, &u))
        return rl_usage_error("--max-queue-bytes '%s': expected 65536..1073741824", v);
      r.a.max_queue = (size_t)u;
    } else if (!strcmp(f, "--log-level")) {
      int lv;
      if (mr_log_parse_level(v, &lv)) return rl_usage_error("--log-level '%s': expected error|warn|info|debug", v);
      mr_log_set_level(lv);
    } else {
      return rl_usage_error("unknown option %s", f);
    }
  }
  if (!r.a.listen) return rl_usage_error("%s is required", "--listen");
  if (!r.a.target) return rl_usage_error("%s is required", "--target");
  /* The draws use a nonzero state; seed 0 is as good a seed as any other. */
  r.rng = r.a.seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
  if (!r.rng) r.rng = 1;
  if (rl_resolve("--target", r.a.target, false, &r.target, &r.target_len)) return 2;
  if (rl_listen(&r)) return 1;
  return rl_run(&r);
}
