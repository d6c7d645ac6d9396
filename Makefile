# moerpc - root Makefile. Builds everything into $(BUILD) (build/ by default).
#
#   make                  libraries, binaries (build/bin) and tests
#   make test             unit + fuzz-corpus replay + integration tests (test-unit, test-fuzz,
#                         test-integration: one group)
#   make demo             model + two servers + verify + bench-rpc (see deploy/demo.sh)
#   make demo-multihost   servers and client each in a network namespace, over a 25gbe-like
#                         link, vs loopback (deploy/netns/README.md; needs root)
#   make bench            a quick kernel and RPC benchmark, JSON lines in build/bench/
#   make SANITIZER=address|undefined|thread test   instrumented build in build/san-<name>
#   make have-not         the "have-not" build (no AVX2/AVX-512, hwloc, libnuma) + unit tests
#   make fuzz             libFuzzer targets (clang) in build/fuzz
#   make fuzz-check       runs each of them FUZZ_SECONDS (20) on a copy of its corpus
#
#   make check-layers     fails when a file includes a header from a room above its own
#                         (tests/check_layers.sh; part of make test)
#
# Rooms, one way (docs/DESIGN.md section 2; checked by make check-layers):
#   common <- kernels <- proto <- {expert_server, gpu_client/rpc} <- gpu_client/runner
#   <- gpu_client/cuda;  placement <- gpu_client/rpc (never proto).
# Only proto and the code above it include the generated protobuf-c header, so only their
# objects wait for protoc-c.

SANITIZER ?=
ifeq ($(SANITIZER),)
BUILD ?= build
else
BUILD ?= build/san-$(SANITIZER)
endif

CC      ?= gcc
CLANG   ?= clang
PROTOC_C ?= protoc-c

HAVE_HWLOC  ?= 1
HAVE_NUMA   ?= 1
HAVE_AVX2   ?= 1
HAVE_AVX512 ?= 1
# AMX tile kernels (kernels/x86/moe_amx.c); they forward small token counts to the AVX-512
# kernels and are compiled with the AVX-512 flags, so they need HAVE_AVX512=1.
HAVE_AMX    ?= 1
ifneq ($(HAVE_AVX512),1)
override HAVE_AMX := 0
endif

# The CUDA backend (gpu_client/cuda/ -> $(BUILD)/lib/libmoerpc-cuda.so, dlopen'ed by the client
# for --backend cuda): built when nvcc is found. Sanitizer builds skip it: nvcc's objects are
# not instrumented and the CUDA runtime's own allocations trip ASan/TSan, so those builds
# test the CPU backend only (the loader then reports "no CUDA backend").
NVCC      ?= nvcc
CUDA_HOME ?= /usr/local/cuda
ifeq ($(origin HAVE_CUDA),undefined)
HAVE_CUDA := $(if $(shell command -v $(NVCC) 2>/dev/null),1,0)
endif
ifneq ($(SANITIZER),)
override HAVE_CUDA := 0
endif

STD   = -std=gnu11
WARN  = -Wall -Wextra -Wno-unused-parameter -Wshadow -Wstrict-prototypes -Wvla -Werror=implicit-function-declaration
# Debug info is kept and compressed (-gz: zlib sections that gdb and addr2line read), a
# third less per binary under ASan; with the tests' shared library (SO_TEST below) it keeps
# the four builds of CI (plain, have-not, ASan, TSan) within a small disk.
ifeq ($(origin GZ),undefined)
GZ := $(shell $(CC) -gz -x c -c /dev/null -o /dev/null 2>/dev/null && echo -gz)
endif
OPT  ?= -O2 -g $(GZ)
DEFS  = -DMR_HAVE_HWLOC=$(HAVE_HWLOC) -DMR_HAVE_NUMA=$(HAVE_NUMA) -DMR_HAVE_AVX2=$(HAVE_AVX2) \
        -DMR_HAVE_AVX512=$(HAVE_AVX512) -DMR_HAVE_AMX=$(HAVE_AMX) -DMR_HAVE_CUDA=$(HAVE_CUDA)
INC   = -I. -I$(BUILD)/gen -I$(BUILD)/gen/proto

ifeq ($(SANITIZER),address)
SAN = -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
else ifeq ($(SANITIZER),undefined)
SAN = -fsanitize=undefined -fno-sanitize-recover=undefined
else ifeq ($(SANITIZER),thread)
SAN = -fsanitize=thread
else
SAN =
endif

CFLAGS  = $(STD) $(WARN) $(OPT) $(DEFS) $(INC) $(SAN) -fPIC -pthread -MMD -MP $(EXTRA_CFLAGS)
LDFLAGS = $(SAN) $(GZ) -pthread $(EXTRA_LDFLAGS)

# nvcc compiles the .cu files as C++ (mr.h, kn.h and backend.h have extern "C" guards).
# sm_90 (H100/H200) code plus its PTX, so that newer GPUs JIT it. Everything is hidden but
# gc_cuda_lib_get; libmr/libkn (and the static CUDA runtime) are linked in and kept local.
CUDA_ARCH ?= -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90
NVCCFLAGS  = -O2 $(CUDA_ARCH) -std=c++17 -Xcompiler -fPIC,-fvisibility=hidden,-Wall,-Wextra,-Wno-unused-parameter \
             $(DEFS) -I. -isystem $(CUDA_HOME)/include $(EXTRA_NVCCFLAGS)
CUDA_LIBS  = -cudart static -L$(CUDA_HOME)/lib64 -lcublas -lcublasLt -lnccl

# Per-ISA flags: only the files of that ISA get them (STYLE.md 11).
ISA_AVX2   = -mavx2 -mfma -mf16c
ISA_AVX512 = -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni -mavx512vbmi -mfma -mf16c
ISA_AMX    = $(ISA_AVX512) -mamx-tile -mamx-bf16 -mamx-int8

GRPC_LIBS = -lgrpc -lgpr
# libcrypto (OpenSSL, the one gRPC itself uses on Debian): the server reads its certificate's
# validity dates and checks its key against it (expert_server/es_auth.c).
EXT_LIBS  = $(GRPC_LIBS) -lprotobuf-c -luv -lcjson -lmicrohttpd -lonig -lutf8proc -lcrypto -lz -lm
ifeq ($(HAVE_HWLOC),1)
EXT_LIBS += -lhwloc
endif
ifeq ($(HAVE_NUMA),1)
EXT_LIBS += -lnuma
endif

# Quiet by default: one line per step; `make V=1` prints the commands.
Q =
ifeq ($(V),1)
say =
else
say = @printf '  %-6s %s\n' $(1) $(2);
endif

# ---- sources ---------------------------------------------------------------------------
GEN_PB_C   = $(BUILD)/gen/proto/moe.pb-c.c
GEN_PB_H   = $(BUILD)/gen/proto/moe.pb-c.h

MR_SRC  = $(wildcard common/*.c)
PR_SRC  = $(wildcard proto/*.c)
KN_SRC  = $(wildcard kernels/*.c)
ifeq ($(HAVE_AVX2),1)
KN_SRC += $(wildcard kernels/x86/*_avx2.c)
endif
ifeq ($(HAVE_AVX512),1)
KN_SRC += $(wildcard kernels/x86/*_avx512.c)
endif
ifeq ($(HAVE_AMX),1)
KN_SRC += $(wildcard kernels/x86/*_amx.c)
endif
ES_SRC  = $(filter-out expert_server/main.c,$(wildcard expert_server/*.c))
# gpu_client/ is three rooms: rpc/ is libmoerpc-client (the C API the SGLang adapter and
# placement use); runner/ is the whole-model runner (libmoerpc-runner.a) and moerpc-client,
# which is runner/main.c (the command table) plus one cli_<group>.c per group of
# subcommands; cuda/ is the runner's CUDA backend (libmoerpc-cuda.so, below).
GC_SRC  = $(wildcard gpu_client/rpc/*.c)
CLI_SRC = gpu_client/runner/main.c $(wildcard gpu_client/runner/cli_*.c)
RUN_SRC = $(filter-out $(CLI_SRC),$(wildcard gpu_client/runner/*.c))
# placement/: libpl from pl_*.c; main.c is the moerpc-place command table.
PL_SRC  = $(wildcard placement/pl_*.c)
# gpu_client/cuda/: the CUDA backend (.cu by nvcc, .c by $(CC) against the CUDA headers).
CU_SRC  = $(wildcard gpu_client/cuda/*.cu) $(wildcard gpu_client/cuda/*.c)

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))

MR_OBJ  = $(call obj,$(MR_SRC))
PR_OBJ  = $(call obj,$(PR_SRC)) $(BUILD)/obj/gen/moe.pb-c.o
KN_OBJ  = $(call obj,$(KN_SRC))
ES_OBJ  = $(call obj,$(ES_SRC))
GC_OBJ  = $(call obj,$(GC_SRC))
RUN_OBJ = $(call obj,$(RUN_SRC))
CLI_OBJ = $(call obj,$(CLI_SRC))
PL_OBJ  = $(call obj,$(PL_SRC))
CU_OBJ  = $(patsubst %.cu,$(BUILD)/obj/%.o,$(patsubst %.c,$(BUILD)/obj/%.o,$(CU_SRC)))

LIB_MR = $(BUILD)/lib/libmr.a
LIB_PR = $(BUILD)/lib/libpr.a
LIB_KN = $(BUILD)/lib/libkn.a
LIB_ES = $(BUILD)/lib/libes.a
LIB_GC = $(BUILD)/lib/libmoerpc-client.a
SO_GC  = $(BUILD)/lib/libmoerpc-client.so
LIB_RUN = $(BUILD)/lib/libmoerpc-runner.a
SO_CUDA = $(BUILD)/lib/libmoerpc-cuda.so
LIB_PL = $(BUILD)/lib/libpl.a
# The tests link every room as one shared library, found next to them ($ORIGIN/../lib),
# not the static archives the binaries use: statically, each of the 100-odd test binaries
# carried its own copy of the kernels (40-60 MB apiece under ASan + UBSan, 3 GB per
# sanitizer build), which filled a CI machine's disk; now the build is a tenth of that and
# links in seconds. A test may still define a function the library has: the executable's
# definition wins (no -Bsymbolic), as it did with the archives.
SO_TEST   = $(BUILD)/lib/libmoerpc-test.so
TEST_LIBS = -L$(BUILD)/lib -l:libmoerpc-test.so -Wl,-rpath,'$$ORIGIN/../lib'

BINS = $(BUILD)/bin/moerpc-server $(BUILD)/bin/moerpc-client $(BUILD)/bin/moerpc-mkmodel \
       $(BUILD)/bin/moerpc-bench-kernels $(BUILD)/bin/moerpc-bench-finite $(BUILD)/bin/moerpc-relay \
       $(BUILD)/bin/moerpc-place $(BUILD)/bin/moerpc-bench-wake

BINS += $(BUILD)/bin/moerpc-bench-place
UNIT_SRC   = $(wildcard tests/unit/test_*.c)
UNIT_BINS  = $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(UNIT_SRC))
FUZZ_SRC   = $(wildcard tests/fuzz/fuzz_*.c)
REPLAY_BINS = $(patsubst tests/fuzz/%.c,$(BUILD)/tests/replay_%,$(FUZZ_SRC))
FUZZ_BINS  = $(patsubst tests/fuzz/%.c,$(BUILD)/fuzz/%,$(FUZZ_SRC))
ITEST_SRC  = $(wildcard tests/integration/itest_*.c)
ITEST_BINS = $(patsubst tests/integration/%.c,$(BUILD)/tests/%,$(ITEST_SRC))
TEST_HELPERS = $(ITEST_BINS) $(BUILD)/tests/kn_ref_cli $(BUILD)/tests/netns_gen $(BUILD)/tests/tok_cli $(BUILD)/tests/tmpl_cli \
               $(BUILD)/tests/flood

.SECONDARY:
.PHONY: all test test-unit test-fuzz test-integration check-layers demo demo-multihost bench fuzz fuzz-check have-not clean help
ifeq ($(HAVE_CUDA),1)
CUDA_TARGETS = $(SO_CUDA)
endif
all: $(BINS) $(SO_GC) $(CUDA_TARGETS) $(UNIT_BINS) $(REPLAY_BINS) $(TEST_HELPERS)

help:
	@sed -n '1,/^$$/p' Makefile

# ---- generated protobuf-c code ---------------------------------------------------------
$(GEN_PB_C) $(GEN_PB_H): proto/moe.proto
	@mkdir -p $(BUILD)/gen/proto
	$(call say,PROTOC,$<)$(Q)$(PROTOC_C) --c_out=$(BUILD)/gen/proto -Iproto proto/moe.proto

$(BUILD)/obj/gen/moe.pb-c.o: $(GEN_PB_C)
	@mkdir -p $(dir $@)
	$(call say,CC,$<)$(Q)$(CC) $(CFLAGS) -w -c $< -o $@

# Code above proto/ may include pr.h -> moe.pb-c.h, so its objects wait for protoc-c (the
# first time; -MMD records the real dependencies after that). common/, kernels/ and the
# tools and benchmarks built on them only never include it, so they compile at once.
$(BUILD)/obj/%.o: %.c | $(GEN_PB_H)
	@mkdir -p $(dir $@)
	$(call say,CC,$<)$(Q)$(CC) $(CFLAGS) -c $< -o $@

define no_gen_rule
$(BUILD)/obj/$(1)/%.o: $(1)/%.c
	@mkdir -p $$(dir $$@)
	$$(call say,CC,$$<)$$(Q)$$(CC) $$(CFLAGS) -c $$< -o $$@
endef
$(foreach d,common kernels tests/bench tests/conformance deploy/netns,$(eval $(call no_gen_rule,$(d))))

$(BUILD)/obj/kernels/x86/%_avx2.o: kernels/x86/%_avx2.c
	@mkdir -p $(dir $@)
	$(call say,CC,$<)$(Q)$(CC) $(CFLAGS) $(ISA_AVX2) -c $< -o $@
$(BUILD)/obj/kernels/x86/%_avx512.o: kernels/x86/%_avx512.c
	@mkdir -p $(dir $@)
	$(call say,CC,$<)$(Q)$(CC) $(CFLAGS) $(ISA_AVX512) -c $< -o $@
$(BUILD)/obj/kernels/x86/%_amx.o: kernels/x86/%_amx.c
	@mkdir -p $(dir $@)
	$(call say,CC,$<)$(Q)$(CC) $(CFLAGS) $(ISA_AMX) -c $< -o $@
# The same AMX source over the scalar tile model (kernels/x86/amx_tile.h), AVX-512 flags
# only, symbols kn__amx_emu_*: linked into tests/unit/test_kn_amx.c alone, so that make
# test checks the AMX kernels on CPUs without AMX.
$(BUILD)/obj/kernels/x86/%_amx_emu.o: kernels/x86/%_amx.c
	@mkdir -p $(dir $@)
	$(call say,CC,$@)$(Q)$(CC) $(CFLAGS) $(ISA_AVX512) -DKN_AMX_EMULATE=1 -c $< -o $@

# The CUDA backend's objects: nvcc for .cu, $(CC) with the CUDA headers for .c (these rules
# are more specific than the generic %.o one, so they win for gpu_client/cuda/).
$(BUILD)/obj/gpu_client/cuda/%.o: gpu_client/cuda/%.cu
	@mkdir -p $(dir $@)
	$(call say,NVCC,$<)$(Q)$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@
$(BUILD)/obj/gpu_client/cuda/%.o: gpu_client/cuda/%.c
	@mkdir -p $(dir $@)
	$(call say,CC,$<)$(Q)$(CC) $(CFLAGS) -fvisibility=hidden -isystem $(CUDA_HOME)/include -c $< -o $@

# ---- libraries --------------------------------------------------------------------------
define mklib
	@mkdir -p $(dir $@)
	@rm -f $@
	$(call say,AR,$@)$(Q)ar rcs $@ $^
endef
$(LIB_MR): $(MR_OBJ) ; $(mklib)
$(LIB_PR): $(PR_OBJ) ; $(mklib)
$(LIB_KN): $(KN_OBJ) ; $(mklib)
$(LIB_ES): $(ES_OBJ) ; $(mklib)
$(LIB_GC): $(GC_OBJ) ; $(mklib)
$(LIB_RUN): $(RUN_OBJ) ; $(mklib)
$(LIB_PL): $(PL_OBJ) ; $(mklib)

$(SO_GC): $(GC_OBJ) $(LIB_KN) $(LIB_PR) $(LIB_MR)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -shared -o $@ $(GC_OBJ) $(LIB_KN) $(LIB_PR) $(LIB_MR) $(LDFLAGS) $(EXT_LIBS)

KN_EXT_LIBS = -lm
ifeq ($(HAVE_HWLOC),1)
KN_EXT_LIBS += -lhwloc
endif
ifeq ($(HAVE_NUMA),1)
KN_EXT_LIBS += -lnuma
endif
$(SO_CUDA): $(CU_OBJ) $(LIB_KN) $(LIB_MR)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(NVCC) -shared $(CUDA_ARCH) -o $@ $(CU_OBJ) $(LIB_KN) $(LIB_MR) \
	    $(CUDA_LIBS) $(KN_EXT_LIBS) -lpthread -Xlinker --exclude-libs,ALL \
	    -Xlinker -rpath,'$$ORIGIN:$(CUDA_HOME)/lib64'

# ---- binaries ---------------------------------------------------------------------------
$(BUILD)/bin/moerpc-server: $(BUILD)/obj/expert_server/main.o $(LIB_ES) $(LIB_KN) $(LIB_PR) $(LIB_MR)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(EXT_LIBS)
$(BUILD)/bin/moerpc-client: $(CLI_OBJ) $(LIB_RUN) $(LIB_GC) $(LIB_KN) $(LIB_PR) $(LIB_MR)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(EXT_LIBS)
$(BUILD)/bin/moerpc-place: $(BUILD)/obj/placement/main.o $(LIB_PL) $(LIB_GC) $(LIB_KN) $(LIB_PR) $(LIB_MR)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(EXT_LIBS)
# The planner's benchmark (tests/bench/bench_place.c, moerpc-place plan's speed).
$(BUILD)/bin/moerpc-bench-place: $(BUILD)/obj/tests/bench/bench_place.o $(LIB_PL) $(LIB_MR)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(EXT_LIBS)
$(BUILD)/bin/moerpc-mkmodel: $(BUILD)/obj/common/tools/mkmodel.o $(LIB_MR)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(EXT_LIBS)
# The delaying TCP relay of the multi-host harness (deploy/netns/README.md).
$(BUILD)/bin/moerpc-relay: $(BUILD)/obj/deploy/netns/moerpc-relay.o $(LIB_MR)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(EXT_LIBS)
$(BUILD)/bin/moerpc-bench-kernels: $(BUILD)/obj/tests/bench/bench_kernels.o $(LIB_KN) $(LIB_MR)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(EXT_LIBS)
$(BUILD)/bin/moerpc-bench-wake: $(BUILD)/obj/tests/bench/bench_wake.o $(LIB_MR)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(EXT_LIBS)
$(BUILD)/bin/moerpc-bench-finite: $(BUILD)/obj/tests/bench/bench_finite.o $(LIB_ES) $(LIB_GC) $(LIB_KN) $(LIB_PR) $(LIB_MR)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(EXT_LIBS)

# ---- tests ------------------------------------------------------------------------------
$(SO_TEST): $(PL_OBJ) $(ES_OBJ) $(RUN_OBJ) $(GC_OBJ) $(KN_OBJ) $(PR_OBJ) $(MR_OBJ)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -shared -o $@ $^ $(LDFLAGS) $(EXT_LIBS)

$(BUILD)/tests/test_%: $(BUILD)/obj/tests/unit/test_%.o $(SO_TEST)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $< $(TEST_LIBS) $(LDFLAGS) $(EXT_LIBS)

ifeq ($(HAVE_AMX),1)
AMX_EMU_OBJ = $(BUILD)/obj/kernels/x86/moe_amx_emu.o
endif
$(BUILD)/tests/test_kn_amx: $(BUILD)/obj/tests/unit/test_kn_amx.o $(AMX_EMU_OBJ) $(SO_TEST)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $(filter %.o,$^) $(TEST_LIBS) $(LDFLAGS) $(EXT_LIBS)

$(BUILD)/tests/itest_%: $(BUILD)/obj/tests/integration/itest_%.o $(BUILD)/obj/tests/integration/util.o $(SO_TEST)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $(filter %.o,$^) $(TEST_LIBS) $(LDFLAGS) $(EXT_LIBS)

# The long-lived client of the multi-host tests (tests/integration/netns_*.sh).
$(BUILD)/tests/netns_gen: $(BUILD)/obj/tests/integration/netns_gen.o $(SO_TEST)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $< $(TEST_LIBS) $(LDFLAGS) $(EXT_LIBS)

# Greedy Forward streams against a running server (tests/bench/flood.c, docs/BENCHMARKS.md).
$(BUILD)/tests/flood: $(BUILD)/obj/tests/bench/flood.o $(BUILD)/obj/tests/integration/util.o $(SO_TEST)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $(filter %.o,$^) $(TEST_LIBS) $(LDFLAGS) $(EXT_LIBS)

# Fuzz targets built twice: as a corpus replayer (any compiler, run by make test) and as a
# libFuzzer binary (clang, make fuzz).
$(BUILD)/tests/replay_%: $(BUILD)/obj/tests/fuzz/%.o $(BUILD)/obj/tests/fuzz/replay_main.o $(SO_TEST)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $(filter %.o,$^) $(TEST_LIBS) $(LDFLAGS) $(EXT_LIBS)
$(BUILD)/obj/tests/fuzz/replay_main.o: tests/fuzz/replay_main.c
	@mkdir -p $(dir $@)
	$(call say,CC,$<)$(Q)$(CC) $(CFLAGS) -c $< -o $@

# The libraries' sources are compiled once for every target (fuzzer-no-link coverage
# instrumentation, ASan + UBSan), without the per-ISA kernel files (MR_FUZZ_NO_ISA).
FUZZ_SAN    = -fsanitize=address,undefined -fno-omit-frame-pointer
FUZZ_CFLAGS = $(STD) -O1 -g $(GZ) $(DEFS) -DMR_FUZZ_NO_ISA=1 $(INC) $(FUZZ_SAN)
FUZZ_LIB_SRC = $(MR_SRC) $(PR_SRC) $(filter-out %_avx2.c %_avx512.c %_amx.c,$(KN_SRC)) $(ES_SRC) $(GC_SRC) \
               $(RUN_SRC) $(PL_SRC)
FUZZ_LIB_OBJ = $(patsubst %.c,$(BUILD)/fuzz/obj/%.o,$(FUZZ_LIB_SRC)) $(BUILD)/fuzz/obj/gen/moe.pb-c.o
$(BUILD)/fuzz/obj/gen/moe.pb-c.o: $(GEN_PB_C)
	@mkdir -p $(dir $@)
	$(call say,CLANG,$<)$(Q)$(CLANG) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -w -c $< -o $@
$(BUILD)/fuzz/obj/%.o: %.c | $(GEN_PB_H)
	@mkdir -p $(dir $@)
	$(call say,CLANG,$<)$(Q)$(CLANG) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -MMD -MP -c $< -o $@
$(BUILD)/fuzz/%: tests/fuzz/%.c $(FUZZ_LIB_OBJ) | $(GEN_PB_H)
	@mkdir -p $(dir $@)
	$(call say,FUZZ,$@)$(Q)$(CLANG) $(FUZZ_CFLAGS) -fsanitize=fuzzer -o $@ $< $(FUZZ_LIB_OBJ) \
	    $(EXT_LIBS) -lpthread
fuzz: $(FUZZ_BINS)
# Each target for FUZZ_SECONDS on a copy of its corpus; fails on any crash, leak or UB
# (tests/fuzz/check.sh; the failing input is kept in $(BUILD)/fuzz-artifacts/).
FUZZ_SECONDS ?= 20
fuzz-check: fuzz
	@BUILD=$(BUILD) FUZZ_SECONDS=$(FUZZ_SECONDS) tests/fuzz/check.sh

# The reference kernel on safetensors inputs, driven by tests/conformance/run.sh (PyTorch).
$(BUILD)/tests/kn_ref_cli: $(BUILD)/obj/tests/conformance/kn_ref_cli.o $(LIB_KN) $(LIB_MR)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(EXT_LIBS)

# The tokenizer on lines of text, driven by tests/conformance/test_tokenizer_hf.py.
$(BUILD)/tests/tok_cli: $(BUILD)/obj/tests/conformance/tok_cli.o $(LIB_RUN) $(LIB_MR)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(EXT_LIBS)

# The chat-template interpreter on a template file and a JSON context, driven by
# tests/conformance/test_chat_template_jinja.py (transformers' jinja2 as the oracle).
$(BUILD)/tests/tmpl_cli: $(BUILD)/obj/tests/conformance/tmpl_cli.o $(LIB_RUN) $(LIB_MR)
	@mkdir -p $(dir $@)
	$(call say,LINK,$@)$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(EXT_LIBS)

# MOERPC_SAN_FLAGS: what a test that compiles a helper against our libraries must add.
test: all check-layers
	@BUILD=$(BUILD) SANITIZER=$(SANITIZER) MOERPC_SAN_FLAGS="$(SAN)" tests/run.sh

# The rooms' include order (docs/DESIGN.md section 2): a file that includes a header from a
# room above its own, or another room's internal.h, fails it.
check-layers:
	@tests/check_layers.sh

test-unit: all
	@BUILD=$(BUILD) SANITIZER=$(SANITIZER) MOERPC_SAN_FLAGS="$(SAN)" tests/run.sh unit
test-fuzz: all
	@BUILD=$(BUILD) SANITIZER=$(SANITIZER) MOERPC_SAN_FLAGS="$(SAN)" tests/run.sh fuzz
test-integration: all
	@BUILD=$(BUILD) SANITIZER=$(SANITIZER) MOERPC_SAN_FLAGS="$(SAN)" tests/run.sh integration

demo:
	@deploy/demo.sh

# Servers and client on hosts made of network namespaces (root or CAP_NET_ADMIN).
demo-multihost: all
	@NO_BUILD=1 BUILD=$(BUILD) deploy/netns/demo-multihost.sh

# The "have-not" build: no AVX2/AVX-512/AMX kernels, no hwloc/libnuma, no CUDA backend;
# proves every fallback compiles and passes the unit tests (STYLE.md 15), the CPU backend
# alone included (test_gc_cuda then checks that --backend cuda is refused by name; the AMX
# test ends skipped).
HAVE_NOT = HAVE_AVX2=0 HAVE_AVX512=0 HAVE_AMX=0 HAVE_HWLOC=0 HAVE_NUMA=0 HAVE_CUDA=0
have-not:
	@$(MAKE) --no-print-directory BUILD=build/have-not $(HAVE_NOT) all
	@BUILD=build/have-not tests/run.sh unit

# A quick subset of both benchmarks (tests/bench/README.md); JSON lines in $(BUILD)/bench/.
bench: all
	@BUILD=$(BUILD) tests/bench/run.sh

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj $(BUILD)/fuzz/obj -name '*.d' 2>/dev/null)
