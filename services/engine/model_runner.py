"""Owns the model weights and the KV cache; turns a scheduled batch into tensors,
runs the forward pass and samples. It makes no policy decisions.

KV cache layout ("block_head_major"): one tensor [num_blocks, num_kv_heads,
num_layers, 2, block_size, head_dim]. A block holds every layer's K and V for its
tokens in one contiguous region, so a run of consecutive blocks is one memory region:
the KV of a request moves to another worker as a few large writes instead of
2 x num_layers small ones per block. Inside a block each KV head is one contiguous
chunk, so a worker with another tensor-parallel split takes its heads as large writes
too.

Tensor parallelism: this runner is one rank. Rank 0's runner (the engine's) starts the
others (tp_ranks.py) and, before each call that runs the model, has every rank make the
same call with the same host lists; only rank 0 samples."""

from __future__ import annotations

import contextlib
import gc
import logging

import torch

from services.engine.cuda_graph import GRAPH_BACKENDS, CUDAGraphRunner, decode_graph_max_batch
from services.engine.kernel_shapes import kernel_shapes
from services.engine.kv_memory import zeroed_kv_tensor
from services.engine.kv_spec import KVCacheSpec
from services.engine.mixed_graph import MixedGraphs, mixed_capture_sizes
from services.engine.sampler import (
    DeviceTokens,
    Sampler,
    SamplerOutput,
    SamplingRequest,
    prompt_logprobs,
)
from services.engine.scheduler import ScheduledSeq
from services.engine.startup import StartupPhases
from services.engine.step_inputs import (
    StepInput,
    attention_metadata,
    decode_rows,
    pipelined_step,
    prepare_step,
    prompt_targets,
)
from services.engine.tp_ranks import TPRanks
from services.kernels import get_backend
from services.kernels.fp8 import FP8_FNUZ_DTYPE, platform_fp8_dtype
from services.models.loader import load_model
from services.models.tensor_parallel import TPGroup

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

log = logging.getLogger(__name__)


class ModelRunner:
    # calls whose return value a rank sends back to rank 0
    REPLYING_CALLS = frozenset({"kv_memory_budget"})

    def __init__(self, config, hf_config, model_path, max_model_len: int, phases=None, tp=None):
        """tp: this rank's group (ranks 1.. get it from tp_ranks); rank 0 passes None
        and starts the other ranks itself when config.tensor_parallel_size > 1."""
        phases = phases or StartupPhases()
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches and graph capture follow the current device, not the tensors'.
            torch.cuda.set_device(self.device)
        self.dtype = _DTYPES[config.torch_dtype_name]
        torch.manual_seed(config.seed)
        backend = config.kernel_backend_name
        tuning = {}
        if backend == "tuned":  # the tuner measures at this model's shapes
            shapes = kernel_shapes(config, hf_config)
            tuning = dict(shapes=shapes, device=self.device, choices=config.kernel_choices)
        with phases.phase("kernel_tuning" if backend == "tuned" else "kernel_backend"):
            self.ops = get_backend(backend, **tuning)
        self.ranks: TPRanks | None = None
        if tp is None and config.tensor_parallel_size > 1:
            # after tuning: the other ranks find rank 0's choices in the tuning cache
            with phases.phase("tp_ranks"):
                self.ranks = TPRanks(type(self), config, model_path, max_model_len)
            tp = self.ranks.group
        self.tp = tp or TPGroup()
        try:
            self._load(config, hf_config, model_path, max_model_len, phases)
        except BaseException:
            self.close()  # no tensor-parallel rank outlives a checkpoint it refused
            raise

    def _load(self, config, hf_config, model_path, max_model_len: int, phases) -> None:
        with phases.phase("weights"):
            self.model = load_model(
                hf_config,
                model_path,
                self.ops,
                dtype=self.dtype,
                device=self.device,
                max_position=max_model_len,
                load_format=config.load_format,
                seed=config.seed,
                quantization=config.quantization,
                tp=self.tp,
            )
        attn = self.model.attention_layers()[0]
        # MI300 (gfx94x) stores e4m3fnuz, whose bits mean half an e4m3fn value
        self.kv_fp8_dtype = platform_fp8_dtype(self.device)
        k_scales, v_scales = self._kv_scales()
        self.kv_spec = KVCacheSpec(
            num_layers=len(self.model.attention_layers()),
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            block_size=config.block_size,
            dtype=self.kv_fp8_dtype if config.kv_cache_fp8 else self.dtype,
            k_scales=k_scales,
            v_scales=v_scales,
            tp_size=self.tp.size,
            tp_rank=self.tp.rank,
            total_kv_heads=attn.total_kv_heads,
        )
        self.sampler = Sampler()
        self.kv_cache = torch.empty(0)
        self.graph_runner: CUDAGraphRunner | None = None
        self.mixed_graphs: MixedGraphs | None = None

    def _kv_scales(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Settle each attention layer's k_scale / v_scale: the checkpoint's (the loader
        set them) or 1.0 for an FP8 cache, as vLLM does; None for a cache in the model's
        dtype, which stores values unscaled."""
        layers = self.model.attention_layers()
        if not self.config.kv_cache_fp8:
            if any(a.k_scale is not None or a.v_scale is not None for a in layers):
                log.warning(
                    "the checkpoint has k_scale / v_scale for an FP8 KV cache; unused: "
                    "kv_cache_dtype is auto (KV in %s)",
                    self.dtype,
                )
            for a in layers:
                a.k_scale = a.v_scale = None
            return (), ()
        # fnuz holds half the range: the same scale would clip at 240 instead of 448,
        # so the scales double (vLLM does the same)
        factor = 2.0 if self.kv_fp8_dtype == FP8_FNUZ_DTYPE else 1.0
        for a in layers:
            a.k_scale = factor * (1.0 if a.k_scale is None else a.k_scale)
            a.v_scale = factor * (1.0 if a.v_scale is None else a.v_scale)
        return tuple(a.k_scale for a in layers), tuple(a.v_scale for a in layers)

    # -- set-up (every rank) ------------------------------------------------------------

    def _mirror(self, method: str, *args) -> None:
        """Rank 0: have the other ranks make this call too (a no-op without TP)."""
        if self.ranks is not None:
            self.ranks.call(method, *args)

    def kv_memory_budget(self) -> int:
        """Bytes this rank gives its KV cache: kv_cache_memory_gb when set (on a GPU at
        most what is free less headroom for activations: more is a ValueError naming
        the flag), else 1 GiB on a CPU and that free share on a GPU. Rank 0 returns
        the smallest over the ranks (they hold equal shares, so the smallest decides)."""
        asked = self.config.kv_cache_memory_gb
        if self.device.type == "cuda":
            # an engine this process dropped (a test's eager twin, an LLM made again) may
            # still sit in torch's cache, which the driver counts as used
            gc.collect()
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int((free - (2 << 30)) * 0.9)
            if asked is not None:
                if asked * (1 << 30) > budget:
                    raise ValueError(
                        f"kv_cache_memory_gb {asked} (--kv-cache-memory-gb) is more than "
                        f"{self.device} has free for the KV cache "
                        f"({max(budget, 0) / (1 << 30):.1f} GiB after the weights and headroom)"
                    )
                budget = int(asked * (1 << 30))
        else:
            budget = int((1.0 if asked is None else asked) * (1 << 30))
        if self.ranks is not None:
            budget = min([budget, *self.ranks.gather("kv_memory_budget")])
        return budget

    def capture_cuda_graphs(self, max_model_len: int) -> None:
        """Capture decode graphs (after the KV cache exists). A no-op on CPU, with
        enforce_eager, or with a kernel backend that cannot be captured. Every rank
        captures the same sizes: each graph holds its rank's collectives."""
        c = self.config
        if (
            self.device.type != "cuda"
            or c.enforce_eager
            or c.kernel_backend_name not in GRAPH_BACKENDS
        ):
            return
        self._mirror("capture_cuda_graphs", max_model_len)
        self.graph_runner = CUDAGraphRunner(
            self.model,
            self.ops,
            max_batch=decode_graph_max_batch(min(c.max_num_seqs, c.cuda_graph_max_batch), self.ops),
            max_model_len=max_model_len,
            block_size=c.block_size,
            device=self.device,
        )
        self.mixed_graphs = self._mixed_graphs(max_model_len)
        with _on_device(self.device):
            # mixed steps first: their activations are the largest, and the decode
            # graphs then fit in the same memory pool
            pool = self.mixed_graphs.capture() if self.mixed_graphs is not None else None
            self.graph_runner.pool = pool
            self.graph_runner.capture()

    def _mixed_graphs(self, max_model_len: int) -> MixedGraphs | None:
        c = self.config
        max_tokens = c.mixed_graph_max_tokens
        sizes = mixed_capture_sizes(max_tokens)
        if not sizes:
            return None
        check = getattr(self.ops, "mixed_graph_blocker", None)
        reason = f"the {self.ops.name} backend" if check is None else check(sizes)
        if reason is not None:
            log.warning("mixed prefill/decode steps run eagerly: %s", reason)
            return None
        return MixedGraphs(
            self.model,
            self.ops,
            max_tokens=max_tokens,
            max_seqs=c.max_num_seqs,
            max_model_len=max_model_len,
            block_size=c.block_size,
            device=self.device,
        )

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._mirror("allocate_kv_cache", num_blocks)
        s = self.kv_spec
        self.kv_cache = zeroed_kv_tensor(
            (num_blocks, s.num_kv_heads, s.num_layers, 2, s.block_size, s.head_dim),
            s.dtype,
            self.device,
        )
        for i, layer in enumerate(self.model.attention_layers()):
            # the kernels' [num_blocks, block_size, heads, head_dim], as strided views
            layer.k_cache = self.kv_cache[:, :, i, 0].transpose(1, 2)
            layer.v_cache = self.kv_cache[:, :, i, 1].transpose(1, 2)

    def close(self) -> None:
        """Stop the other ranks (rank 0; idempotent)."""
        if self.ranks is not None:
            self.ranks.close()

    # -- steps (rank 0 decides; every rank runs the model) ------------------------------

    @torch.inference_mode()
    def execute(
        self, batch: list[ScheduledSeq], sampling: list[SamplingRequest]
    ) -> SamplerOutput | None:
        """Run one step. `sampling` lists, in batch order, the sequences whose prefill
        completes this step (they get a next token); returns None if there are none."""
        with _on_device(self.device):
            if self._graph_eligible(batch):
                seqs = [item.seq for item in batch]
                ids = [seq.token_ids[seq.num_computed_tokens] for seq in seqs]
                rows = decode_rows(seqs, self.config.block_size)
                self._mirror("run_graph", ids, *rows)
                return self.sampler(self.run_graph(ids, *rows), sampling)
            step = prepare_step(batch, self.config.block_size)
            size = self._mixed_bucket(step)
            if size is not None:
                self._mirror("run_mixed_graph", step, size)
                logits = self.run_mixed_graph(step, size)
                return self.sampler(logits, sampling) if step.logits_rows else None
            self._mirror("forward", step)
            prompt_logits, logits = self.forward(step)
            prompt_lps = self._prompt_logprobs(batch, prompt_logits)
            if logits is None:
                return SamplerOutput([], [], prompt_lps) if prompt_lps else None
            out = self.sampler(logits, sampling)
            out.prompt_logprobs = prompt_lps
            return out

    @torch.inference_mode()
    def forward(self, step: StepInput, device_input=None):
        """The model over one step: (logits of each prompt_rows range, logits of
        logits_rows or None). Every rank calls it with the same step. device_input =
        (tokens, (rows, sources)): input row rows[i] is tokens[sources[i]], a token
        sampled by the step before, not on the host yet (rank 0 only)."""
        with _on_device(self.device):
            dev = self.device
            meta = attention_metadata(step, self.config.block_size, dev)
            ids = torch.tensor(step.input_ids, dtype=torch.int64, device=dev)
            if device_input is not None:
                tokens, (rows, sources) = device_input
                src = torch.tensor(sources, dtype=torch.int64, device=dev)
                ids[torch.tensor(rows, dtype=torch.int64, device=dev)] = tokens[src]
            pos = torch.tensor(step.positions, dtype=torch.int64, device=dev)
            self.ops.prepare_attention(meta)
            hidden = self.model(ids, pos, meta)
            prompt = [self.model.compute_logits(hidden[a:b]) for a, b in step.prompt_rows]
            if not step.logits_rows:
                return prompt, None
            rows = torch.tensor(step.logits_rows, device=dev)
            return prompt, self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def run_graph(self, ids, pos, slots, lens, tables, device_input=None) -> torch.Tensor:
        with _on_device(self.device):
            return self.graph_runner.run(ids, pos, slots, lens, tables, device_input)

    @property
    def mixed_step_max_tokens(self) -> int:
        """The most tokens a step admitting prompts next to decode rows should hold:
        the largest captured mixed step where there are graphs."""
        if self.mixed_graphs is not None:
            return self.mixed_graphs.sizes[-1]
        return self.config.max_num_batched_tokens

    @torch.inference_mode()
    def mixed_on_device(
        self,
        seqs: list,
        admitted: list[ScheduledSeq],
        sampling: list[SamplingRequest],
        prev_tokens: torch.Tensor,
        prev_rows: list[int],
    ) -> DeviceTokens:
        """One step of decode rows (as decode_on_device: each input token is
        prev_tokens[prev_rows[i]]) followed by whole prompts that complete here; the
        samples (one per decode row, then one per prompt) stay on the device. Rank 0
        only (the engine keeps tensor parallelism on synchronous steps)."""
        step = pipelined_step(seqs, admitted, self.config.block_size)
        device_input = (prev_tokens, (list(range(len(seqs))), prev_rows))
        with _on_device(self.device):
            size = self._mixed_bucket(step)
            if size is not None:
                logits = self.mixed_graphs.run(step, size, device_input)
            else:
                logits = self.forward(step, device_input)[1]
            return DeviceTokens(self.sampler.sample(logits, sampling))

    @torch.inference_mode()
    def run_mixed_graph(self, step: StepInput, size: int) -> torch.Tensor:
        """The logits of step.logits_rows, from the captured mixed step of `size`
        tokens (every rank)."""
        with _on_device(self.device):
            return self.mixed_graphs.run(step, size)

    def _mixed_bucket(self, step: StepInput) -> int | None:
        """The captured mixed-step bucket for this step, or None: eager (no mixed
        graphs, too many tokens or sequences, or prompt logprobs, which need every
        prompt row's logits)."""
        if self.mixed_graphs is None or step.prompt_rows:
            return None
        return self.mixed_graphs.bucket(len(step.input_ids), len(step.seq_lens))

    def _prompt_logprobs(self, batch, logits: list) -> dict[str, list]:
        out = {}
        chunks = iter(logits)
        for seq, first, last in prompt_targets(batch):
            if first > last:
                continue
            logprobs = torch.log_softmax(next(chunks).float(), dim=-1)
            targets = seq.token_ids[first : last + 1]
            entries = prompt_logprobs(logprobs, targets, seq.params.prompt_logprobs)
            out[seq.seq_id] = list(zip(targets, entries))
        return out

    def _graph_eligible(self, batch: list[ScheduledSeq]) -> bool:
        g = self.graph_runner
        if g is None or not all(
            item.num_new_tokens == 1 and item.completes_prefill for item in batch
        ):
            return False
        return g.can_run(len(batch), max(item.seq.num_computed_tokens + 1 for item in batch))

    @torch.inference_mode()
    def decode_on_device(
        self,
        seqs: list,
        sampling: list[SamplingRequest],
        prev_tokens: torch.Tensor | None = None,
        prev_rows=None,
    ) -> DeviceTokens:
        """One decode step whose sampled tokens stay on the device, returned without
        waiting for it (sampling: one request per sequence, sampled by Sampler.sample
        alone). Each sequence computes the token at its position num_computed_tokens;
        its input id is that token, or with prev_tokens, prev_tokens[prev_rows[i]]:
        the previous step's samples, not on the host yet."""
        ids = None
        if prev_tokens is None:
            ids = [seq.token_ids[seq.num_computed_tokens] for seq in seqs]
        rows = decode_rows(seqs, self.config.block_size)
        self._mirror("decode_logits", ids, *rows)
        logits = self.decode_logits(ids, *rows, prev_tokens, prev_rows)
        with _on_device(self.device):
            return DeviceTokens(self.sampler.sample(logits, sampling))

    @torch.inference_mode()
    def decode_logits(
        self, ids, pos, slots, lens, tables, prev_tokens=None, prev_rows=None
    ) -> torch.Tensor:
        """The logits of one decode step (every rank). ids None: the input ids are
        rank 0's prev_tokens[prev_rows], broadcast to the other ranks on the device."""
        with _on_device(self.device):
            device_input = None
            if ids is None:
                if self.tp.size > 1:  # rank 0's samples, never through the host
                    n = len(pos)
                    x = (
                        prev_tokens[torch.tensor(prev_rows, device=self.device)]
                        if self.tp.is_driver
                        else torch.empty(n, dtype=torch.int64, device=self.device)
                    )
                    prev_tokens, prev_rows = self.tp.broadcast(x), list(range(n))
                device_input = (prev_tokens, prev_rows)
            g = self.graph_runner
            if g is not None and g.can_run(len(pos), max(lens)):
                return g.run(ids, pos, slots, lens, tables, device_input)
            meta = attention_metadata(
                StepInput([], pos, slots, list(range(len(pos) + 1)), lens, tables, [], []),
                self.config.block_size,
                self.device,
            )
            if device_input is None:
                input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
            else:
                input_ids = prev_tokens[torch.tensor(prev_rows, device=self.device)]
            positions = torch.tensor(pos, dtype=torch.int64, device=self.device)
            self.ops.prepare_attention(meta)
            hidden = self.model(input_ids, positions, meta)
            return self.model.compute_logits(hidden)


def _on_device(device: torch.device):
    # Triton launches on the current CUDA device: pin it per call, so several engines
    # on different GPUs can share one process.
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
