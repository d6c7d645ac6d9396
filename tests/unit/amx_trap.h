/*
 * amx_trap.h - runs the real AMX machine code on a CPU without AMX (tests only).
 *
 * The AMX kernels' real object (kernels/x86/moe_amx.c built with -mamx-*) executes tile
 * instructions the CPU lacks: each raises #UD, i.e. SIGILL. amx_trap_install() installs
 * a SIGILL handler that decodes the faulting instruction, carries it out on the scalar
 * tile model of kernels/x86/amx_tile.h (per thread, like the hardware's tile state), and
 * resumes after it. So the tests run exactly the instructions, addresses and tile
 * configurations the compiler emitted, not a re-compilation of the source with emulated
 * macros. That is what catches the class of bug that killed every binary on Emerald
 * Rapids: GCC dropped the stores of tiles 4-7's configuration before LDTILECFG. The
 * emulated build could not see it (its LOADCFG is a C function that reads the struct,
 * which keeps the stores alive); the trap reads the 64 bytes the real LDTILECFG would
 * read, finds tiles 4-7 unconfigured and fails at the first load into tmm4, where the
 * hardware raises #UD.
 *
 * Decoded: the VEX forms (C4, map 0F38, W0, L0) of LDTILECFG, STTILECFG, TILERELEASE,
 * TILEZERO, TILELOADD(T1), TILESTORED, TDPBF16PS, TDPBSSD and TDPBUSD, with every
 * ModRM/SIB addressing form (RIP-relative, SIB with and without index, disp8/disp32).
 * Anything else (a genuine illegal instruction, an AMX form the kernels do not use) falls
 * through to the default action: the process dies with SIGILL, as it would on hardware.
 * A tile used unconfigured or an impossible configuration is reported on stderr with the
 * instruction's address and ends the process (abort), where the hardware would raise
 * #UD or #GP.
 *
 * Include after defining KN_AMX_EMULATE 1 (it uses the model's functions). x86-64 Linux
 * only; amx_trap_install returns false elsewhere.
 */
#ifndef MOERPC_TESTS_AMX_TRAP_H
#define MOERPC_TESTS_AMX_TRAP_H

#if !KN_AMX_EMULATE
#error "amx_trap.h needs the tile model: define KN_AMX_EMULATE 1 before including amx_tile.h"
#endif

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) && defined(__linux__)
#include <ucontext.h>

static unsigned long amx_trap_count; /* instructions emulated (all threads; approximate) */

/* async-signal-safe message, then abort */
static void amx_trap_die(const char *what, uintptr_t rip, int tile) {
  char buf[256];
  size_t n = 0;
  const char *p = "amx_trap: ";
  while (*p && n < sizeof buf - 40) buf[n++] = *p++;
  for (p = what; *p && n < sizeof buf - 40; p++) buf[n++] = *p;
  if (tile >= 0) {
    buf[n++] = ' ';
    buf[n++] = 't';
    buf[n++] = 'm';
    buf[n++] = 'm';
    buf[n++] = (char)('0' + tile);
  }
  p = " at rip 0x";
  while (*p) buf[n++] = *p++;
  for (int s = 60; s >= 0; s -= 4) buf[n++] = "0123456789abcdef"[(rip >> s) & 15];
  buf[n++] = '\n';
  ssize_t w = write(2, buf, n);
  (void)w;
  abort();
}

static const int amx_trap_greg[16] = {REG_RAX, REG_RCX, REG_RDX, REG_RBX, REG_RSP, REG_RBP, REG_RSI, REG_RDI,
                                      REG_R8,  REG_R9,  REG_R10, REG_R11, REG_R12, REG_R13, REG_R14, REG_R15};

/* Decodes the memory operand at p (ModRM at p[0]); returns the bytes it takes after the
 * ModRM-less prefix, the effective base address (base + disp) and the SIB index value
 * shifted by its scale (the TILELOADD/TILESTORED stride; 0 without an index). */
static size_t amx_trap_mem(const uint8_t *p, const greg_t *g, uintptr_t next_rip_without_disp, bool rex_b,
                           bool rex_x, uintptr_t *addr, uint64_t *stride) {
  const uint8_t modrm = p[0], mod = modrm >> 6, rm = modrm & 7;
  size_t len = 1;
  uintptr_t base = 0;
  *stride = 0;
  bool rip_rel = false;
  if (rm == 4) { /* SIB */
    const uint8_t sib = p[1], scale = sib >> 6;
    const unsigned index = ((sib >> 3) & 7) | (rex_x ? 8u : 0u), b = (sib & 7) | (rex_b ? 8u : 0u);
    len = 2;
    if (index != 4) *stride = (uint64_t)g[amx_trap_greg[index]] << scale;
    if ((sib & 7) == 5 && mod == 0) {
      base = 0; /* disp32, no base */
    } else {
      base = (uintptr_t)g[amx_trap_greg[b]];
    }
    if ((sib & 7) == 5 && mod == 0) {
      int32_t d;
      memcpy(&d, p + len, 4);
      *addr = base + (uintptr_t)(intptr_t)d;
      return len + 4;
    }
  } else if (mod == 0 && rm == 5) {
    rip_rel = true;
  } else {
    base = (uintptr_t)g[amx_trap_greg[rm | (rex_b ? 8u : 0u)]];
  }
  intptr_t disp = 0;
  size_t dlen = 0;
  if (mod == 1) {
    disp = (int8_t)p[len];
    dlen = 1;
  } else if (mod == 2 || rip_rel) {
    int32_t d;
    memcpy(&d, p + len, 4);
    disp = d;
    dlen = 4;
  }
  if (rip_rel) base = next_rip_without_disp + len + dlen; /* RIP of the next instruction */
  *addr = base + (uintptr_t)disp;
  return len + dlen;
}

static void amx_trap_check(int t, uintptr_t rip) {
  if (!kn__amx_emu.configured) amx_trap_die("tile instruction with no tile configuration loaded on", rip, t);
  if (t < 0 || t >= KN_AMX_TILES || kn__amx_emu.rows[t] == 0)
    amx_trap_die("tile instruction on an unconfigured tile (the hardware raises #UD):", rip, t);
}

static void amx_trap_handler(int sig, siginfo_t *si, void *ctx) {
  (void)si;
  ucontext_t *uc = ctx;
  greg_t *g = uc->uc_mcontext.gregs;
  const uintptr_t rip = (uintptr_t)g[REG_RIP];
  const uint8_t *p = (const uint8_t *)rip;
  if (p[0] != 0xC4 || (p[1] & 0x1f) != 2 || (p[2] & 0x84) != 0) goto not_ours; /* VEX3, 0F38, W0 L0 */
  const bool R = !(p[1] & 0x80), X = !(p[1] & 0x40), B = !(p[1] & 0x20);
  const unsigned vvvv = (~p[2] >> 3) & 0xf, pp = p[2] & 3, op = p[3];
  const uint8_t modrm = p[4], mod = modrm >> 6;
  const unsigned reg = ((modrm >> 3) & 7) | (R ? 8u : 0u), rm = (modrm & 7) | (B ? 8u : 0u);
  size_t len = 5;
  uintptr_t addr = 0;
  uint64_t stride = 0;
  if (mod != 3) len = 4 + amx_trap_mem(p + 4, g, rip + 4, B, X, &addr, &stride);
  if (op == 0x49 && pp == 0 && modrm == 0xC0) { /* TILERELEASE */
    kn__amx_emu_release();
  } else if (op == 0x49 && pp == 0 && mod != 3 && ((modrm >> 3) & 7) == 0) { /* LDTILECFG */
    const kn__amx_cfg *c = (const kn__amx_cfg *)addr;
    if (c->palette != 1 || c->start_row != 0) amx_trap_die("LDTILECFG of a palette other than 1 (#GP)", rip, -1);
    for (int t = 0; t < 16; t++)
      if (c->rows[t] > KN_AMX_MAX_ROWS || c->colsb[t] > KN_AMX_MAX_COLSB || (c->rows[t] == 0) != (c->colsb[t] == 0) ||
          (t >= KN_AMX_TILES && c->rows[t]))
        amx_trap_die("LDTILECFG of an invalid configuration (#GP) for", rip, t < 10 ? t : 9);
    kn__amx_emu_loadcfg(c);
  } else if (op == 0x49 && pp == 1 && mod != 3) { /* STTILECFG */
    kn__amx_emu_storecfg((kn__amx_cfg *)addr);
  } else if (op == 0x49 && pp == 3 && mod == 3) { /* TILEZERO */
    amx_trap_check((int)reg, rip);
    kn__amx_emu_zero((int)reg);
  } else if (op == 0x4B && (pp == 3 || pp == 1) && mod != 3) { /* TILELOADD(T1) */
    amx_trap_check((int)reg, rip);
    kn__amx_emu_load((int)reg, (const void *)addr, (size_t)stride);
  } else if (op == 0x4B && pp == 2 && mod != 3) { /* TILESTORED */
    amx_trap_check((int)reg, rip);
    kn__amx_emu_store((int)reg, (void *)addr, (size_t)stride);
  } else if (op == 0x5C && pp == 2 && mod == 3) { /* TDPBF16PS reg += rm . vvvv */
    amx_trap_check((int)reg, rip);
    amx_trap_check((int)rm, rip);
    amx_trap_check((int)vvvv, rip);
    kn__amx_emu_dpbf16ps((int)reg, (int)rm, (int)vvvv);
  } else if (op == 0x5E && (pp == 3 || pp == 1) && mod == 3) { /* TDPBSSD (F2) / TDPBUSD (66) */
    amx_trap_check((int)reg, rip);
    amx_trap_check((int)rm, rip);
    amx_trap_check((int)vvvv, rip);
    kn__amx_emu_dp8((int)reg, (int)rm, (int)vvvv, pp == 3);
  } else {
    goto not_ours;
  }
  __atomic_fetch_add(&amx_trap_count, 1, __ATOMIC_RELAXED);
  g[REG_RIP] = (greg_t)(rip + len);
  return;
not_ours: {
  /* A real illegal instruction: die of it, as without the trap. */

  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = SIG_DFL;
  sigaction(sig, &sa, NULL);
}
}

/* Installs the trap for the whole process (threads included). Returns false where it
 * cannot work (not x86-64 Linux). */
static inline bool amx_trap_install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = amx_trap_handler;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  return sigaction(SIGILL, &sa, NULL) == 0;
}

#else
static unsigned long amx_trap_count;
static inline bool amx_trap_install(void) { return false; }
#endif

#endif /* MOERPC_TESTS_AMX_TRAP_H */
