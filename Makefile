# gptlua — build, test and run.
#   make            build build/gptlua and build/libgptlua.so (+ CUDA objects when nvcc is found)
#   make run        deps if missing, build, run the default recipe
#   make test       deps if missing, build, run every spec
#   make test-cuda  the CUDA-vs-CPU twin specs on a real GPU
#   make gpu-check  one command that shows a GPU works: builds for it, runs the #cuda specs,
#                   trains, measures tokens/s and MFU (and FP8's against bf16's on sm_89+),
#                   runs NCCL (recipes/tools/gpu_check.lua;
#                   report in build/gpu-check/); without a GPU, the same in the simulator
#   make cuda-resources  every kernel's registers and shared memory against each arch's limits
#   make sim        build/sim/: the same engine with every CUDA kernel, cuBLASLt and
#                   NCCL call running on the CPU in the CUDA simulator (spec/cudasim/)
#   make sim-account build/sim-account/: the simulator counting each launch's bytes
#                   (recipes/tools/bench_cuda.lua --account)
#   make test-sim   the #cuda specs (and the simulator's own) under the simulator
#   make test-race  the kernel twin specs in the simulator's race mode (two seeds)
#   make test-seeds the kernel twin specs under N=50 seeds of random inputs (make test
#                   uses fixed ones); prints every failing seed and how to repeat it
#   make bench      CPU benchmarks;  make bench-cuda  GPU benchmarks
#   make fuzz       libFuzzer (clang, ASan+UBSan) on every file parser, FUZZ_SECONDS each;
#                   make fuzz-ci  the same for FUZZ_CI_SECONDS each (CI)
#   make deps       apt-get install the Debian packages listed in DEBIAN_PACKAGES
#   make install    the binary, library and Lua tree under PREFIX (root: /usr/local, else ~/.local)
#   make link       BINDIR/gptlua -> this checkout's build/gptlua (make run and make test do it)
#   make embed-example  build and run recipes/embed/host.c, a C program embedding the engine
#   CUDA=0 forces a CPU-only build; CUDA=1 fails if nvcc is missing.

# where `make install` and `make link` put the `gptlua` command: as root
# /usr/local (bin/ is on every user's PATH), otherwise ~/.local (bin/ is on
# PATH in Debian's ~/.profile; `make link` adds it to ~/.profile where not)
IS_ROOT ?= $(shell [ "$$(id -u)" = 0 ] && echo 1)
PREFIX ?= $(if $(IS_ROOT),/usr/local,$(HOME)/.local)
BINDIR ?= $(PREFIX)/bin
.DEFAULT_GOAL := all
BUILD  ?= build
CC     ?= gcc

DEBIAN_PACKAGES = build-essential pkg-config luajit libluajit-5.1-dev lua-busted lua-cjson \
  libopenblas-openmp-dev libcjson-dev libpcre2-dev libreadline-dev libopenmpi-dev openmpi-bin \
  clang libclang-rt-14-dev libomp-14-dev gnuplot-nox libgloo-dev luarocks

NVCC := $(shell command -v nvcc 2>/dev/null || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })
ifeq ($(CUDA),0)
  NVCC :=
endif
ifeq ($(CUDA),1)
  ifeq ($(NVCC),)
    $(error CUDA=1 but nvcc was not found on PATH or at /usr/local/cuda/bin/nvcc)
  endif
endif
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))

WARN    = -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers -Wno-format-truncation
CFLAGS  ?= -O3 -march=native
# -fno-math-errno: no kernel reads errno, and with it sqrt and friends
# vectorize (the AdamW update, norms) instead of running one lane at a time
BASE_CFLAGS := $(CFLAGS)
CFLAGS  += -std=gnu11 -fPIC -fopenmp -fno-math-errno $(WARN) -Iengine -I$(BUILD) -I/usr/include/luajit-2.1 \
           -I$(BLAS_DIR:/usr/lib/%=/usr/include/%)
# OpenBLAS built on OpenMP: BLAS and our kernels share one thread pool
# (the pthread build spins its own threads against OpenMP's on small cores)
BLAS_DIR = /usr/lib/x86_64-linux-gnu/openblas-openmp
LIBS    = -L$(BLAS_DIR) -Wl,-rpath,$(BLAS_DIR) -lopenblas -lcjson -lpcre2-8 -lpthread -lm -fopenmp
BASE_LIBS := $(LIBS)

# engine/cpu/NAME.c (the CPU twin of kernels/NAME.cu) builds obj/cpu_NAME.o
ENGINE_SRC = $(filter-out engine/main.c,$(wildcard engine/*.c)) $(wildcard engine/cpu/*.c)
engine_obj = $(patsubst engine/%.c,$(1)/%.o,$(subst engine/cpu/,engine/cpu_,$(2)))
ENGINE_OBJ = $(call engine_obj,$(BUILD)/obj,$(ENGINE_SRC)) $(BUILD)/obj/gl_cdef.o $(BUILD)/obj/gl_abi.o
HEADERS    = $(wildcard engine/*.h) $(wildcard engine/cpu/*.h)
CU_SRC     = $(wildcard kernels/*.cu)
CU_HDR     = $(wildcard kernels/*.cuh)

# The GPUs the library carries machine code for, as compute capabilities
# without the dot: A100 (80), A10 / RTX 3090 (86), L4 / L40S / RTX 4090 (89),
# H100 / H200 (90), plus PTX of the last one, which the driver compiles for
# newer GPUs at load time.  `make CUDA_ARCHS=90` builds for one GPU only
# (`make test` does, to keep CI's compile time; `make cuda-check` compiles
# all of them); nvcc compiles the archs of a file in parallel (--threads 0).
# Objects live in a folder per arch list, so switching lists reuses them.
CUDA_ALL_ARCHS   = 80 86 89 90
CUDA_ARCHS      ?= $(CUDA_ALL_ARCHS)
TEST_CUDA_ARCHS ?= 90
empty :=
space := $(empty) $(empty)
CUDA_ARCH_TAG   = $(subst $(space),-,$(strip $(CUDA_ARCHS)))
NVCC_GENCODE    = $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
                  -gencode arch=compute_$(lastword $(CUDA_ARCHS)),code=compute_$(lastword $(CUDA_ARCHS))
ifneq ($(NVCC),)
  CFLAGS     += -DGL_WITH_CUDA -I$(CUDA_HOME)/include
  NVCCFLAGS  ?= -O3 -std=c++17 $(NVCC_GENCODE) --threads 0 -Xcompiler -fPIC -DGL_WITH_CUDA -Iengine -I$(BUILD) \
                --expt-relaxed-constexpr -lineinfo
  CU_OBJ      = $(patsubst kernels/%.cu,$(BUILD)/obj/sm-$(CUDA_ARCH_TAG)/cu_%.o,$(CU_SRC))
  LIBS       += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lcublasLt -lcublas -lstdc++
  ENGINE_OBJ += $(CU_OBJ)
endif

# the distributed backend lives in its own library so that a single process
# never loads MPI (lua/gptlua/dist/ loads it on demand)
MPI_SRC  = $(wildcard engine/mpi/*.c)
MPI_LIB  = $(if $(MPI_SRC),$(BUILD)/libgptlua_mpi.so)
MPI_CFLAGS = $(shell pkg-config --cflags ompi-c 2>/dev/null) $(MPI_NCCL_CFLAGS)
MPI_LIBS   = $(shell pkg-config --libs ompi-c 2>/dev/null) $(MPI_NCCL_LIBS)
# NCCL for CUDA tensors (engine/mpi/nccl.c): on in a CUDA build whose
# toolkit (or MPI_NCCL_HOME, or /usr) has nccl.h; MPI_NCCL=0 turns it off.
# Without it nccl.c only reports that this build has no NCCL.
MPI_NCCL_HOME ?= $(CUDA_HOME)
MPI_NCCL_H    := $(if $(NVCC),$(if $(filter 0,$(MPI_NCCL)),,$(firstword $(wildcard \
                   $(MPI_NCCL_HOME)/include/nccl.h /usr/include/nccl.h))))
ifneq ($(MPI_NCCL_H),)
  MPI_NCCL_ROOT   = $(patsubst %/include/nccl.h,%,$(MPI_NCCL_H))
  MPI_NCCL_CFLAGS = -DGL_WITH_NCCL -I$(MPI_NCCL_ROOT)/include
  MPI_NCCL_LIBS   = -L$(MPI_NCCL_ROOT)/lib64 -Wl,-rpath,$(MPI_NCCL_ROOT)/lib64 -lnccl \
                    -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart
endif


# ---- fuzzing (engine/fuzz/, its README.md) -------------------------------------
# libFuzzer harnesses, built by clang with AddressSanitizer and UBSan into
# build/fuzz/: the C parsers (safetensors, token shards + the loader,
# tokenizer files) linked with the engine sources they need, instrumented;
# the Lua parsers (checkpoint state, config/command line) through LuaJIT
# (engine/fuzz/fuzz_lua.c, which loads build/libgptlua.so like gptlua does).
# Each run starts from the committed seeds in engine/fuzz/corpus/TARGET (found
# crashes stay there as regression inputs); new inputs go to build/fuzz/corpus/.
# No OpenMP in these objects (one thread is what a fuzzer wants): omp.h and
# omp_get_thread_num come from libomp.
FUZZ          = $(BUILD)/fuzz
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 300
FUZZ_CI_SECONDS ?= 25
FUZZ_SAN      = -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_CFLAGS   = -std=gnu11 -O1 -g -fno-omit-frame-pointer $(FUZZ_SAN) -Wall -Wno-unknown-pragmas \
                -Iengine -I$(BLAS_DIR:/usr/lib/%=/usr/include/%)
# the whole engine (tensor.c's copies dispatch through backend.c's tables,
# which name every CPU kernel), built CPU-only and instrumented
FUZZ_OBJ      = $(call engine_obj,$(FUZZ)/obj,$(ENGINE_SRC))
FUZZ_C        = safetensors shards tokenizer
FUZZ_LUA      = checkpoint_state config
FUZZ_TARGETS  = $(FUZZ_C) $(FUZZ_LUA)
FUZZ_BINS     = $(FUZZ_TARGETS:%=$(FUZZ)/fuzz_%)
FUZZ_OMP_DIR  = $(abspath $(shell $(FUZZ_CC) -print-resource-dir 2>/dev/null)/../..)

$(FUZZ)/obj:
	@mkdir -p $@
$(FUZZ)/obj/%.o: engine/%.c $(HEADERS) | $(FUZZ)/obj
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c $< -o $@
$(FUZZ)/obj/cpu_%.o: engine/cpu/%.c $(HEADERS) | $(FUZZ)/obj
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c $< -o $@
$(FUZZ_C:%=$(FUZZ)/fuzz_%): $(FUZZ)/fuzz_%: engine/fuzz/fuzz_%.c engine/fuzz/fuzz_common.h $(FUZZ_OBJ)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -o $@ $< $(FUZZ_OBJ) \
	  -L$(BLAS_DIR) -Wl,-rpath,$(BLAS_DIR) -lopenblas -lcjson -lpcre2-8 \
	  -L$(FUZZ_OMP_DIR) -Wl,-rpath,$(FUZZ_OMP_DIR) -lomp -lpthread -lm
$(FUZZ_LUA:%=$(FUZZ)/fuzz_%): $(FUZZ)/fuzz_%: engine/fuzz/fuzz_lua.c | $(FUZZ)/obj
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -I/usr/include/luajit-2.1 -DFUZZ_TARGET='"$*"' \
	  -DFUZZ_ROOT='"$(CURDIR)"' -o $@ $< -lluajit-5.1 -lm -ldl

# one target for FUZZ_RUN_SECONDS; stops at its first finding (the input is
# left as build/fuzz/crash-TARGET-*: add it to engine/fuzz/corpus/TARGET with the fix)
fuzz-run-%:
	@mkdir -p $(FUZZ)/corpus/$*
	@echo "fuzz: $* for $(FUZZ_RUN_SECONDS) s"
	@$(FUZZ)/fuzz_$* -max_total_time=$(FUZZ_RUN_SECONDS) -timeout=10 -rss_limit_mb=4096 -max_len=65536 \
	  -print_final_stats=1 -artifact_prefix=$(FUZZ)/crash-$*- $(FUZZ)/corpus/$* engine/fuzz/corpus/$* 2> $(FUZZ)/$*.log \
	  || { tail -n 60 $(FUZZ)/$*.log; echo "fuzz: $* found a failure (log: $(FUZZ)/$*.log)"; exit 1; }
	@grep -ah 'stat::number_of_executed_units\|stat::average_exec_per_sec\|stat::peak_rss_mb' $(FUZZ)/$*.log | sed 's/^/  /'

# every target, as many at a time as there are cores (a fuzzer is one
# thread), each for the same seconds; each one's lines printed when it ends
fuzz_run = @$(MAKE) --no-print-directory -j$(NPROC) -O $(FUZZ_TARGETS:%=fuzz-run-%) FUZZ_RUN_SECONDS=$(1)

fuzz-build: all $(FUZZ_BINS)
fuzz: fuzz-build
	$(call fuzz_run,$(FUZZ_SECONDS))
fuzz-ci: fuzz-build
	$(call fuzz_run,$(FUZZ_CI_SECONDS))


# ---- the TCP backend -----------------------------------------------------------
# The TCP backend (engine/gloo/ plus the backend-neutral comm.c and nccl.c):
# worlds launched torchrun-style, without mpirun, talk through a TCP
# rendezvous and Gloo.  Built when libgloo-dev is installed; lua/gptlua/dist/
# loads it on demand, like the MPI library.
GLOO_SRC    = $(wildcard engine/gloo/*.c)
GLOO_CXX    = $(wildcard engine/gloo/*.cpp)
GLOO_SHARED = $(filter-out engine/mpi/mpi.c,$(MPI_SRC))
GLOO_DEPS   = $(GLOO_SRC) $(GLOO_CXX) $(wildcard engine/gloo/*.h) $(GLOO_SHARED) $(HEADERS)
GLOO_LIB    = $(if $(wildcard /usr/include/gloo/rendezvous/context.h),$(BUILD)/libgptlua_gloo.so)
GLOO_CXXFLAGS = -O2 -std=c++17 -fPIC $(WARN) -Iengine -I$(BUILD)

# ---- the CUDA simulator build (spec/cudasim/, its README.md) -----------------
# The engine and kernels/*.cu compiled by the host compilers against the
# simulator's headers (spec/cudasim/ stands in for the toolkit's): no nvcc, no
# GPU, no CUDA libraries.  build/sim/gptlua finds build/sim/libgptlua.so.
SIM        = $(BUILD)/sim
CXX       ?= g++
SIM_DEFS   = -DGL_WITH_CUDA -DGL_SIM -Ispec/cudasim
SIM_CFLAGS = $(BASE_CFLAGS) -std=gnu11 -fPIC -fopenmp -fno-math-errno $(WARN) -Iengine -I$(BUILD) \
             -I/usr/include/luajit-2.1 -I$(BLAS_DIR:/usr/lib/%=/usr/include/%) $(SIM_DEFS)
# -fsanitize=bounds: an index past a static shared (or any fixed-size) array
# in a kernel stops the process with the file and line
SIM_CXXFLAGS = -O2 -g -std=c++17 -fPIC -fno-math-errno -fno-strict-aliasing $(WARN) -Wno-unused-function -Wno-unknown-pragmas \
             -fsanitize=bounds -fno-sanitize-recover=bounds -Iengine -I$(BUILD) -Ikernels \
             -I$(BLAS_DIR:/usr/lib/%=/usr/include/%) $(SIM_DEFS)
# Kernels (kernels/*.cu and the simulator's test kernels) are also compiled
# with GCC's thread-sanitizer instrumentation: every load and store calls
# spec/cudasim/sanitize.cpp's hooks, which check it (memcheck, initcheck,
# racecheck) and count its bytes for the account.  Only the instrumentation,
# at compile time: linking with -fsanitize=thread would pull in GCC's
# runtime, so the libraries are linked without it.  No vectorising or store
# merging, so that each access keeps its source type's size and alignment
# (the misaligned-address check).
SIM_SAN_FLAGS = -fsanitize=thread --param tsan-instrument-func-entry-exit=0 \
                -fno-tree-vectorize -fno-store-merging
SIM_HDR    = $(wildcard spec/cudasim/*.h) $(CU_HDR) $(HEADERS)
SIM_NCCL   = $(wildcard spec/cudasim/nccl*.cpp)
SIM_CORE   = $(filter-out $(SIM_NCCL),$(wildcard spec/cudasim/*.cpp))
SIM_OBJ    = $(call engine_obj,$(SIM)/obj,$(ENGINE_SRC)) $(SIM)/obj/gl_cdef.o $(SIM)/obj/gl_abi.o \
             $(patsubst kernels/%.cu,$(SIM)/obj/cu_%.o,$(CU_SRC)) \
             $(patsubst spec/cudasim/%.cpp,$(SIM)/obj/sim_%.o,$(SIM_CORE))
SIM_TEST_SRC = $(filter-out spec/cudasim/cases/sanitize.cu,$(wildcard spec/cudasim/cases/*.cu))
# the sanitizer's planted bugs and correct twins, once per optimisation level
SIM_SAN_LIBS = $(foreach o,0 2 3,$(SIM)/libgptlua_sanitize_O$(o).so)
SIM_MPI_FLAGS = $(shell pkg-config --cflags ompi-c 2>/dev/null) -DOMPI_SKIP_MPICXX=1

$(SIM)/obj:
	@mkdir -p $@
$(SIM)/obj/%.o: engine/%.c $(HEADERS) | $(SIM)/obj
	$(CC) $(SIM_CFLAGS) -c $< -o $@
$(SIM)/obj/cpu_%.o: engine/cpu/%.c $(HEADERS) | $(SIM)/obj
	$(CC) $(SIM_CFLAGS) -c $< -o $@
$(SIM)/obj/gl_%.o: $(BUILD)/gl_%.c | $(SIM)/obj
	$(CC) $(SIM_CFLAGS) -c $< -o $@
$(SIM)/obj/cu_%.o: kernels/%.cu $(SIM_HDR) | $(SIM)/obj
	$(CXX) $(SIM_CXXFLAGS) $(SIM_SAN_FLAGS) -x c++ -c $< -o $@
$(SIM)/obj/sim_%.o: spec/cudasim/%.cpp $(SIM_HDR) | $(SIM)/obj
	$(CXX) $(SIM_CXXFLAGS) -c $< -o $@
$(SIM)/libgptlua.so: $(SIM_OBJ)
	$(CXX) -shared -Wl,-z,nodelete -fsanitize=bounds -o $@ $^ $(BASE_LIBS) -lstdc++
# the simulated NCCL (spec/cudasim/nccl*.cpp) sits with the MPI backend it runs on
$(SIM)/obj/mpi_%.o: spec/cudasim/%.cpp $(SIM_HDR) | $(SIM)/obj
	$(CXX) $(SIM_CXXFLAGS) $(SIM_MPI_FLAGS) -c $< -o $@
$(SIM)/libgptlua_mpi.so: $(MPI_SRC) $(HEADERS) $(patsubst spec/cudasim/%.cpp,$(SIM)/obj/mpi_%.o,$(SIM_NCCL)) $(SIM)/libgptlua.so
	$(CC) $(SIM_CFLAGS) $(SIM_MPI_FLAGS) -DGL_WITH_NCCL -shared -o $@ $(MPI_SRC) \
	  $(patsubst spec/cudasim/%.cpp,$(SIM)/obj/mpi_%.o,$(SIM_NCCL)) \
	  -L$(SIM) -Wl,-rpath,'$$ORIGIN' -lgptlua $(shell pkg-config --libs ompi-c 2>/dev/null) -lstdc++ -fsanitize=bounds
# the simulated NCCL runs over MPI: this library has none and says so
$(SIM)/libgptlua_gloo.so: $(GLOO_DEPS) $(SIM)/libgptlua.so
	$(CXX) $(GLOO_CXXFLAGS) -c $(GLOO_CXX) -o $(SIM)/obj/gloo_ops.o
	$(CC) $(SIM_CFLAGS) -DGL_NCCL_MISSING='"the NCCL of the CUDA simulator (spec/cudasim/nccl*.cpp) runs over MPI; start the ranks with mpirun (gptlua -n N --launcher=mpi) to use it"' \
	  -shared -o $@ $(GLOO_SRC) $(GLOO_SHARED) $(SIM)/obj/gloo_ops.o -L$(SIM) -Wl,-rpath,'$$ORIGIN' -lgptlua -lgloo -lstdc++ -lpthread
$(SIM)/obj/case_%.o: spec/cudasim/cases/%.cu $(wildcard spec/cudasim/cases/*.h) $(SIM_HDR) | $(SIM)/obj
	$(CXX) $(SIM_CXXFLAGS) $(SIM_SAN_FLAGS) -x c++ -c $< -o $@
$(SIM)/libgptlua_simtest.so: $(patsubst spec/cudasim/cases/%.cu,$(SIM)/obj/case_%.o,$(SIM_TEST_SRC)) $(SIM)/libgptlua.so
	$(CXX) -shared -fsanitize=bounds -o $@ $(filter %.o,$^) -L$(SIM) -Wl,-rpath,'$$ORIGIN' -lgptlua
$(SIM)/obj/sanitize_O%.o: spec/cudasim/cases/sanitize.cu $(wildcard spec/cudasim/cases/*.h) $(SIM_HDR) | $(SIM)/obj
	$(CXX) $(SIM_CXXFLAGS) -O$* $(SIM_SAN_FLAGS) -x c++ -c $< -o $@
.PRECIOUS: $(SIM)/obj/sanitize_O%.o
$(SIM)/libgptlua_sanitize_O%.so: $(SIM)/obj/sanitize_O%.o $(SIM)/libgptlua.so
	$(CXX) -shared -fsanitize=bounds -o $@ $< -L$(SIM) -Wl,-rpath,'$$ORIGIN' -lgptlua
$(SIM)/gptlua: engine/main.c $(HEADERS) | $(SIM)/obj
	$(CC) $(SIM_CFLAGS) -DGL_VERSION_STR='"$(shell cat VERSION)"' -o $@ engine/main.c -lluajit-5.1 -lreadline -ldl -lm

sim: $(SIM)/gptlua $(SIM)/libgptlua.so $(if $(MPI_SRC),$(SIM)/libgptlua_mpi.so) $(if $(GLOO_LIB),$(SIM)/libgptlua_gloo.so) \
  $(SIM)/libgptlua_simtest.so $(SIM_SAN_LIBS)

# The account flavour (build/sim-account/, `recipes/tools/bench_cuda.lua --account`):
# build/sim/'s objects (whose kernels report every load and store to
# spec/cudasim/sanitize.cpp's hooks) with spec/cudasim/account.cpp compiled to
# count the bytes each launch moves.
SIM_ACC       = $(BUILD)/sim-account
SIM_ACC_OBJ   = $(filter-out $(SIM)/obj/sim_account.o,$(SIM_OBJ)) $(SIM_ACC)/obj/sim_account.o
$(SIM_ACC)/obj:
	@mkdir -p $@
$(SIM_ACC)/obj/sim_account.o: spec/cudasim/account.cpp $(SIM_HDR) | $(SIM_ACC)/obj
	$(CXX) $(SIM_CXXFLAGS) -DGL_SIM_ACCOUNT_FLAVOUR -c $< -o $@
$(SIM_ACC)/libgptlua.so: $(SIM_ACC_OBJ)
	$(CXX) -shared -Wl,-z,nodelete -Wl,-z,defs -fsanitize=bounds -o $@ $^ $(BASE_LIBS) -lstdc++
$(SIM_ACC)/gptlua: engine/main.c $(HEADERS) | $(SIM_ACC)/obj
	$(CC) $(SIM_CFLAGS) -DGL_VERSION_STR='"$(shell cat VERSION)"' -o $@ engine/main.c -lluajit-5.1 -lreadline -ldl -lm
sim-account: $(SIM_ACC)/gptlua $(SIM_ACC)/libgptlua.so


.PHONY: fuzz fuzz-ci fuzz-build sim sim-account test-sim test-race test-cpu-specs test-sim-specs all deps deps-if-missing run test test-cuda bench bench-cuda acceptance install link rock-install embed-example clean cuda-check cuda-resources gpu-check test-seeds FORCE
all: $(BUILD)/gptlua $(BUILD)/libgptlua.so $(MPI_LIB) $(GLOO_LIB)

$(BUILD)/obj:
	@mkdir -p $@

# One source of truth for the FFI: the preprocessed public headers, embedded
# in the library as a string that the Lua binding feeds to ffi.cdef.
$(BUILD)/gl_cdef.h: $(HEADERS) | $(BUILD)/obj
	$(CC) -E -P -DGL_CDEF engine/gptlua.h -o $@
$(BUILD)/gl_cdef.c: $(BUILD)/gl_cdef.h
	@{ echo '/* generated from engine/gptlua.h by the Makefile; do not edit */'; \
	   echo 'const char *gl_cdef(void) { return'; \
	   sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/^/  "/' -e 's/$$/\\n"/' $<; \
	   echo '  ; }'; } > $@
$(BUILD)/obj/gl_cdef.o: $(BUILD)/gl_cdef.c
	$(CC) $(CFLAGS) -c $< -o $@
# struct layouts as the C compiler sees them (checked against ffi by spec/abi_spec.lua)
$(BUILD)/gl_abi.c: $(BUILD)/gl_cdef.h engine/gen_abi.lua
	luajit engine/gen_abi.lua $< > $@
$(BUILD)/obj/gl_abi.o: $(BUILD)/gl_abi.c
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/obj/%.o: engine/%.c $(HEADERS) | $(BUILD)/obj
	$(CC) $(CFLAGS) -c $< -o $@
$(BUILD)/obj/cpu_%.o: engine/cpu/%.c $(HEADERS) | $(BUILD)/obj
	$(CC) $(CFLAGS) -c $< -o $@
$(BUILD)/obj/sm-$(CUDA_ARCH_TAG)/cu_%.o: kernels/%.cu $(HEADERS) $(CU_HDR)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

# the arch list the library was last linked with: a different list relinks it
$(BUILD)/cuda_archs: FORCE | $(BUILD)/obj
	@echo '$(if $(NVCC),$(CUDA_ARCHS))' | cmp -s - $@ || echo '$(if $(NVCC),$(CUDA_ARCHS))' > $@
FORCE:

$(BUILD)/libgptlua.so: $(ENGINE_OBJ) $(BUILD)/cuda_archs
	$(CC) -shared -Wl,-z,nodelete -o $@ $(ENGINE_OBJ) $(LIBS)

$(BUILD)/libgptlua_mpi.so: $(MPI_SRC) $(HEADERS) $(BUILD)/libgptlua.so
	$(CC) $(CFLAGS) $(MPI_CFLAGS) -shared -o $@ $(MPI_SRC) -L$(BUILD) -Wl,-rpath,'$$ORIGIN' -lgptlua $(MPI_LIBS)

$(BUILD)/libgptlua_gloo.so: $(GLOO_DEPS) $(BUILD)/libgptlua.so
	$(CXX) $(GLOO_CXXFLAGS) -c $(GLOO_CXX) -o $(BUILD)/obj/gloo_ops.o
	$(CC) $(CFLAGS) $(MPI_NCCL_CFLAGS) -shared -o $@ $(GLOO_SRC) $(GLOO_SHARED) $(BUILD)/obj/gloo_ops.o \
	  -L$(BUILD) -Wl,-rpath,'$$ORIGIN' -lgptlua -lgloo -lstdc++ -lpthread $(MPI_NCCL_LIBS)

$(BUILD)/gptlua: engine/main.c $(HEADERS) | $(BUILD)/obj
	$(CC) $(CFLAGS) -DGL_VERSION_STR='"$(shell cat VERSION)"' -o $@ engine/main.c -lluajit-5.1 -lreadline -ldl -lm

# compile every CUDA source on its own: a CUDA compile error fails CI even
# though nothing CUDA runs there
cuda-check:
	@if [ -n "$(NVCC)" ]; then $(MAKE) --no-print-directory $(CU_OBJ) && echo "cuda-check: compiled $(words $(CU_SRC)) CUDA sources"; \
	 else echo "cuda-check: nvcc not found, skipped"; fi

# every kernel's registers and shared memory, for every arch of the default
# build, against that arch's limits (recipes/tools/cuda_resources.lua): ptxas
# -v per source into build/cuda-resources/NAME.txt, redone when the source
# changes, then the check; make test runs it
CUDA_RES       = $(BUILD)/cuda-resources
CUDA_RES_FILES = $(CU_SRC:kernels/%.cu=$(CUDA_RES)/%.txt)
CUDA_RES_FLAGS = -O3 -std=c++17 -DGL_WITH_CUDA -Iengine -I$(BUILD) --expt-relaxed-constexpr
$(CUDA_RES)/%.txt: kernels/%.cu $(HEADERS) $(CU_HDR)
	@mkdir -p $(@D)
	NVCC='$(NVCC)' CUDA_RES_FLAGS='$(CUDA_RES_FLAGS)' luajit recipes/tools/cuda_resources.lua compile $< $@ $(CUDA_ALL_ARCHS)
cuda-resources: $(if $(NVCC),$(CUDA_RES_FILES))
	@if [ -n "$(NVCC)" ]; then luajit recipes/tools/cuda_resources.lua check $(CUDA_RES_FILES); \
	 else echo "cuda-resources: nvcc not found, skipped"; fi

deps:
	@echo "make deps: apt-get install -y $(DEBIAN_PACKAGES)"
	@if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	 $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(DEBIAN_PACKAGES)

# install the packages only if one of them is missing
deps-if-missing:
	@missing=$$(for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	 if [ -n "$$missing" ]; then echo "missing packages: $$missing"; $(MAKE) --no-print-directory deps; fi

# packages first, then a parallel build, then the job
NPROC := $(shell nproc 2>/dev/null || echo 2)
define prepare
	@$(MAKE) --no-print-directory deps-if-missing
	@$(MAKE) --no-print-directory -j$(NPROC) all
endef

run:
	$(prepare)
	@$(MAKE) --no-print-directory link
	$(BUILD)/gptlua recipes/shakespeare.lua $(ARGS)

# `gptlua` on PATH: a symbolic link to this checkout's build/gptlua (which
# finds its Lua tree and library through the link, so edits to lua/ need no
# reinstall).  An installed copy (make install) already there is left alone.
# Not root: BINDIR is ~/.local/bin, which ~/.profile gets onto PATH (Debian's
# does when the directory exists; one that does not mention it gets the
# lines that do); this shell needs the export the message prints.
PROFILE_LINES = if [ -d "$$HOME/.local/bin" ] ; then PATH="$$HOME/.local/bin:$$PATH" ; fi
link: all
	@mkdir -p $(BINDIR)
	@if [ -e $(BINDIR)/gptlua ] && [ ! -L $(BINDIR)/gptlua ]; then \
	   echo "make link: $(BINDIR)/gptlua is an installed copy (make install), left as it is"; \
	 else ln -sfn $(CURDIR)/$(BUILD)/gptlua $(BINDIR)/gptlua && echo "make link: $(BINDIR)/gptlua -> $(CURDIR)/$(BUILD)/gptlua"; fi
	@if [ -z "$(IS_ROOT)" ] && [ "$(BINDIR)" = "$(HOME)/.local/bin" ] && ! grep -qs '.local/bin' $(HOME)/.profile; then \
	   printf '\n# the user'"'"'s own commands (added by gptlua'"'"'s make link)\n%s\n' '$(PROFILE_LINES)' >> $(HOME)/.profile; \
	   echo "make link: added $(BINDIR) to PATH in $(HOME)/.profile (for new logins)"; fi
	@case ":$$PATH:" in *":$(BINDIR):"*) ;; *) \
	  echo "make link: $(BINDIR) is not on this shell's PATH yet: export PATH=$(BINDIR):\$$PATH";; esac

# every spec: the CPU ones with build/gptlua, and the #cuda ones (and the
# simulator's own, #sim) with every kernel running in the CUDA simulator,
# race mode, and the kernels' resources per arch (cuda-resources): two at a
# time, the longest first, since the simulator runs one thread at a time and
# alone leaves a core of a 2-core machine idle.  Each
# prints its output whole when it ends (make -O); the two suites take the TCP
# rendezvous ports of their specs from ranges of their own (GPTLUA_PORTS, below
# Linux's ephemeral ports, 32768-60999, which no connect() can take), so they
# never race for one.
# (the three builds in one make, so that neither core waits on another's last link)
test:
	@$(MAKE) --no-print-directory deps-if-missing
	@$(MAKE) --no-print-directory -j$(NPROC) all sim sim-account CUDA_ARCHS='$(TEST_CUDA_ARCHS)'
	@$(MAKE) --no-print-directory link CUDA_ARCHS='$(TEST_CUDA_ARCHS)'
	@$(MAKE) --no-print-directory -j$(NPROC) -O test-cpu-specs test-sim-specs $(RACE_RUNS) cuda-resources CUDA_ARCHS='$(TEST_CUDA_ARCHS)'
# (each target builds what it runs: after make test's own builds, nothing to do)
test-cpu-specs: all
	GPTLUA_PORTS=24000-24999 $(BUILD)/gptlua spec/run.lua $(SPEC_ARGS)
test-sim-specs: sim sim-account
	GPTLUA_PORTS=25000-25999 $(SIM)/gptlua spec/run.lua --tags=cuda $(SPEC_ARGS)

# the kernel twins again in the simulator's race mode, under two random thread
# orders: each grid runs in order and in the seeded random order, and the two
# must leave identical memory (spec/cudasim/README.md)
# (one target per seed and spec file, race-SEED-FILE, so that make test can
# run them beside the other suites, two at a time)
RACE_SPECS = cuda_spec cuda_rows_spec cuda_nn_spec cuda_attention_spec layer_fusion_spec cuda_step_block_spec \
             cuda_gemm_mma_spec cuda_moe_spec fp8_spec fp8_product_spec
RACE_RUNS  = $(foreach s,$(RACE_SPECS),race-1-$(s) race-2-$(s))
test-race: $(RACE_RUNS)
race-%: sim
	GL_SIM_RACECHECK=1 GL_SIM_SEED=$(word 1,$(subst -, ,$*)) $(SIM)/gptlua spec/run.lua --tags=cuda \
	  spec/$(word 2,$(subst -, ,$*)).lua

# the seeded specs under N seeds of random inputs each (GL_CUDA_SPEC_SEED;
# make test runs them under the fixed one): every failing run is printed with
# the command that repeats it.  FIRST=S starts at seed S (default: from the
# clock), SEED_SPECS=... narrows the files, LOGS=DIR keeps every run's output.
N ?= 50
SEED_SPECS ?= $(RACE_SPECS) sim_numeric_spec
test-seeds: sim
	@N=$(N) JOBS=$(NPROC) EXE=$(SIM)/gptlua SPECS="$(SEED_SPECS)" $(if $(FIRST),FIRST=$(FIRST)) $(if $(LOGS),LOGS=$(LOGS)) \
	  sh spec/support/seeds.sh

test-sim:
	$(prepare)
	@$(MAKE) --no-print-directory -j$(NPROC) sim sim-account
	$(SIM)/gptlua spec/run.lua --tags=cuda $(SPEC_ARGS)

# on a real GPU: the same #cuda specs against the hardware
test-cuda:
	$(prepare)
	$(BUILD)/gptlua spec/run.lua --tags=cuda --exclude-tags=sim $(SPEC_ARGS)

# The GPU's first contact (recipes/tools/gpu_check.lua): built for the
# compute capabilities nvidia-smi reports, then every stage on the device;
# without nvidia-smi or a GPU, the simulator's build and mode.  Missing
# packages are installed where the network allows (at most 90 s: a GPU
# machine may have none); when the whole build fails, the engine alone is
# built and the stages it allows run (the nccl stage then fails, naming
# what is missing).  ARGS go to the script.
gpu-check:
	@timeout 90 $(MAKE) --no-print-directory deps-if-missing || echo "gpu-check: could not install the missing packages; building anyway"
	@caps="$$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d '. ' | sort -u | tr '\n' ' ')"; \
	 if [ -n "$$(echo $$caps)" ]; then \
	   echo "gpu-check: building for compute capabilities $$caps"; \
	   { $(MAKE) --no-print-directory -j$(NPROC) all CUDA=1 CUDA_ARCHS="$$caps" || \
	     { echo "gpu-check: the full build failed; building the engine alone"; \
	       $(MAKE) --no-print-directory -j$(NPROC) $(BUILD)/gptlua $(BUILD)/libgptlua.so CUDA=1 CUDA_ARCHS="$$caps"; }; } && \
	   $(BUILD)/gptlua recipes/tools/gpu_check.lua --mode=gpu --archs="$$caps" $(ARGS); \
	 else \
	   echo "gpu-check: no GPU (nvidia-smi lists none): the CUDA simulator's mode"; \
	   $(MAKE) --no-print-directory -j$(NPROC) all sim && $(BUILD)/gptlua recipes/tools/gpu_check.lua --mode=sim $(ARGS); \
	 fi

bench: all
	$(BUILD)/gptlua recipes/tools/bench.lua $(ARGS)

# the default recipe's full run against nanoGPT's val-loss figure (minutes, not in CI)
acceptance: all
	$(BUILD)/gptlua recipes/tools/acceptance.lua $(ARGS)

bench-cuda: all
	$(BUILD)/gptlua recipes/tools/bench.lua --device=cuda $(ARGS)

# a copy independent of the checkout (run it again after changing lua/)
install: all
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/share/gptlua
	rm -f $(DESTDIR)$(BINDIR)/gptlua
	install -m 755 $(BUILD)/gptlua $(DESTDIR)$(BINDIR)/gptlua
	install -m 644 $(BUILD)/libgptlua.so $(MPI_LIB) $(GLOO_LIB) $(DESTDIR)$(PREFIX)/lib/
	cp -r lua $(DESTDIR)$(PREFIX)/share/gptlua/
	cp -r recipes data $(DESTDIR)$(PREFIX)/share/gptlua/
	@case ":$$PATH:" in *":$(BINDIR):"*) ;; *) [ -n "$(DESTDIR)" ] || \
	  echo "make install: $(BINDIR) is not on your PATH: export PATH=$(BINDIR):\$$PATH";; esac

# what `luarocks make` (gptlua-dev-1.rockspec) installs: the Lua library in
# LUADIR, the engine libraries in LIBDIR (the tree's C-module directory, on
# package.cpath, where lua/gptlua/ffi.lua finds libgptlua.so)
rock-install: all
	install -d $(LUADIR)/gptlua $(LIBDIR)
	cp -r lua/gptlua/. $(LUADIR)/gptlua/
	install -m 644 $(BUILD)/libgptlua.so $(MPI_LIB) $(GLOO_LIB) $(LIBDIR)/

# recipes/embed/host.c: a C program that embeds the engine (links
# libgptlua and LuaJIT, runs training steps in a Lua state, reads a tensor back)
$(BUILD)/embed_host: recipes/embed/host.c engine/gptlua.h $(BUILD)/libgptlua.so
	$(CC) -O2 -std=gnu11 -Wall -Wextra -Iengine -I/usr/include/luajit-2.1 \
	  -DGPTLUA_ROOT='"$(CURDIR)"' $< -o $@ -L$(BUILD) -Wl,-rpath,'$$ORIGIN' -lgptlua -lluajit-5.1 -lm
embed-example: $(BUILD)/embed_host
	$(BUILD)/embed_host

clean:
	rm -rf $(BUILD)
