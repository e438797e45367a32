"""Engine configuration, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from services.kernels.shape_classes import parse_choices

ROLES = ("both", "prefill", "decode")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KERNEL_BACKENDS = ("auto", "torch", "triton", "aiter", "tuned")
# vLLM's spellings; "fp8" is its alias of fp8_e4m3 (float8_e4m3fn, per-layer K / V scales)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")
QUANTIZATIONS = (None, "fp8")
# vLLM's: first come first served, or by each request's priority (lower first)
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class EngineConfig:
    model: str  # a folder, a Hugging Face Hub id (owner/name) or the bundled model's alias
    role: str = "both"
    device: str = "cpu"
    dtype: str = "auto"  # float32 on CPU, bfloat16 on GPU
    # KV cache storage: auto (the model's dtype) or fp8_e4m3 / fp8 (half the bytes of
    # bf16, scaled per layer by the checkpoint's k_scale / v_scale, else 1.0)
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    # "fp8": quantize an unquantized checkpoint's linear layers to FP8 at load (one
    # scale per output channel, dynamic per-token activation scales); FP8 checkpoints
    # need nothing (their config.json says so)
    quantization: str | None = None
    kernel_backend: str = "auto"  # tuned (torch without triton on a GPU)
    # overrides of the tuner's picks, "op[.class]=candidate,..." (tuned backend only)
    kernel_choices: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    # None: 1 GiB on a CPU; on a GPU 90% of the memory left after the weights, less 2 GiB
    # of headroom for activations and graphs
    kv_cache_memory_gb: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0
    # CUDA graphs for decode steps (GPU, triton/aiter kernels); True: always eager
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 256
    # mixed steps (prefill chunks next to decode rows) of up to this many tokens run as
    # CUDA graphs too (mixed_graph.py); 0: they run eagerly; None: room for every
    # sequence's decode row plus as many prompt tokens, at least 512
    cuda_graph_mixed_max_tokens: int | None = None
    # Schedule and launch decode step N+1 while step N runs, feeding it N's tokens on
    # the device (batches without logprobs, penalties or min_tokens masking). None: on
    # for CUDA, off on CPU, where nothing overlaps.
    async_scheduling: bool | None = None
    # ranks (one process and device each) that split the model's heads and MLP widths;
    # rank 0 is this process
    tensor_parallel_size: int = 1
    scheduling_policy: str = "fcfs"
    # Hub ids only: the revision (branch, tag, commit) and the cache folder to fetch into
    revision: str | None = None
    download_dir: str | None = None

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(
                f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}"
            )
        if self.kernel_choices:
            if self.kernel_backend_name != "tuned":
                raise ValueError(
                    "kernel_choices only applies to the tuned kernel backend "
                    f"(kernel_backend is {self.kernel_backend!r} here)"
                )
            # raises ValueError on a bad spec
            parse_choices(self.kernel_choices, graphs=self.device != "cpu")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be positive")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling must be True, False or None, got {self.async_scheduling!r}"
            )
        if self.cuda_graph_max_batch < 1:
            raise ValueError("cuda_graph_max_batch (--max-cudagraph-capture-size) must be positive")
        if self.cuda_graph_mixed_max_tokens is not None and self.cuda_graph_mixed_max_tokens < 0:
            raise ValueError(
                "cuda_graph_mixed_max_tokens (--max-cudagraph-mixed-tokens) must be >= 0, "
                f"got {self.cuda_graph_mixed_max_tokens}"
            )
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(
            self.tensor_parallel_size, int
        ):
            raise ValueError(
                f"tensor_parallel_size must be an integer, got {self.tensor_parallel_size!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")

    @property
    def mixed_graph_max_tokens(self) -> int:
        """The largest mixed step captured as a CUDA graph (0: none)."""
        limit = self.cuda_graph_mixed_max_tokens
        if limit is None:
            limit = max(512, 2 * self.max_num_seqs)
        return min(limit, self.max_num_batched_tokens)

    @property
    def kernel_backend_name(self) -> str:
        if self.kernel_backend != "auto":
            return self.kernel_backend
        if self.device == "cpu":
            return "tuned"  # the CPU's own candidates, measured (kernels/tuner.py)
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "tuned"

    @property
    def async_scheduling_enabled(self) -> bool:
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.device.startswith("cuda")

    @property
    def kv_cache_fp8(self) -> bool:
        return self.kv_cache_dtype in ("fp8_e4m3", "fp8")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"
