"""The planner's assumptions: one named constant each, with its unit. What measured each one, and where it is
checked, is the calibration table of docs/planner.md."""

from __future__ import annotations

from ..units import GIB

# -- memory ---------------------------------------------------------------------------------------------------
CUDA_CONTEXT_BYTES = 7 * GIB // 4  # bytes: GPU memory outside torch's allocator (CUDA context, workspaces)
FIRST_STEP_RUNTIME_BYTES = GIB // 2  # bytes: GPU memory a process's first step adds outside the allocator
HOST_PROCESS_BYTES = 3 * GIB  # bytes: host memory a training process takes before any pinned pool
HOST_GROWTH_BYTES = 2 * GIB  # bytes: host memory a process may add during a run beyond what it was placed with
PLACEMENT_HEADROOM_SHARE = 0.03  # of the GPU memory: left unused by every placed step (peaks ran up to 3% over)
UNMODELLED_ACTIVATION_FACTOR = 1.5  # x a Llama layer's saved activations: a family the formulas do not model

# -- what a step keeps from stage 1 for stage 2 ---------------------------------------------------------------
KEPT_ATTENTION_SHARE = 0.5  # of the GPU memory a step leaves free: kept attention outputs
KEPT_GRAPHS_SHARE = 0.75  # of what those leave free: kept autograd graphs of whole chunks

# -- offload (dense, pages streamed from the host) ------------------------------------------------------------
OFFLOAD_SEGMENT_TOKENS = 65536  # tokens per sequence: the longest streamed segment
OFFLOAD_STAGING_SHARE = 0.25  # of the GPU memory a step leaves free: the most both staged segments take

# -- time -----------------------------------------------------------------------------------------------------
DEFAULT_MATMUL_TFLOPS = 790.0  # TFLOP/s: the H200's dense bf16 matmul peak
LINEAR_EFFICIENCY = 0.70  # of the matmul peak: the linear layers over a whole step
ATTENTION_EFFICIENCY = 0.60  # of the matmul peak: the attention over a whole step
PORTABLE_ATTENTION_EFFICIENCY = 0.38  # of the matmul peak: packed-document chunks in the portable Triton kernels
HEAD_DIM_64_ATTENTION_EFFICIENCY = 0.44  # of the matmul peak: the attention of heads of 64 (SmolLM2)
KERNEL_LAUNCH_S = 70e-6  # s: the host's time to issue one kernel of a chunk's layer step (Python, autograd)
KERNELS_PER_LAYER_FORWARD = 32  # kernels one decoder layer's forward of one chunk launches (Llama layer, fused ops)
KERNELS_PER_LAYER_BACKWARD = 61  # ... and its backward
CARRIED_OP_LAUNCH_S = 11.4e-6  # s: the host's time to issue one operation of a state-carrying layer's torch path
HOST_ADD_GBPS = 61.5  # GB/s: host gradient layers' additions over the bus (sparse)
HOST_ADD_HIDDEN_S = 5.4e-3  # s: of each host layer's additions per chunk, hidden behind the compute
HOST_GATHER_GBPS = 48.0  # GB/s: host K/V layers' gathers of the selected pages over the bus (sparse)
STREAM_GBPS = 53.0  # GB/s each way: dense steps' streamed segments of host pages (H100, 51-55 measured)

# -- generation (prefill and decoding without gradients)
DECODE_GBPS = 3400.0  # GB/s at DEFAULT_MATMUL_TFLOPS: a new token's reads of weights and K/V (assumed, not measured)

# -- QLoRA (4-bit base weights, bitsandbytes)
DEQUANT_GBPS = 2900.0  # GB/s at DEFAULT_MATMUL_TFLOPS: dequantising a 4-bit weight (assumed, not measured)

# -- several GPUs ---------------------------------------------------------------------------------------------
COLLECTIVE_GBPS = 350.0  # GB/s per rank: NCCL ring bus bandwidth (assumed, not measured), none hidden
TP_ROWWISE, TP_COLWISE = 2, 5  # linear modules per decoder layer: RowwiseParallel (o, down), ColwiseParallel (q..up)
ZERO3_GATHERED_LAYERS = 2  # decoder layers gathered at once under zero3: the one computing and the prefetched one
