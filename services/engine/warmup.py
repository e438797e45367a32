"""Warm-up: before a worker reports SERVING, run every batch shape its configuration
can reach, so no kernel is compiled (Triton JIT, autotuning, lazy CUDA module loading)
on the serving path.

Two parts:
1. Synthetic batches straight through the model runner, with the exact shapes the
   scheduler can produce: prefill-only batches at a spread of token counts up to
   max_num_batched_tokens (with and without earlier context, one or several
   sequences, a chunk that does not finish its prompt), decode batches at every
   CUDA-graph size (and, where decode runs eagerly, at context lengths that make the
   attention heuristics pick each split count), and mixed decode + prefill batches.
   Decode batches go through both entry points (`execute`, sampled on the host, and
   `decode_on_device`, the async-scheduling path). Their sequences get blocks from the
   block manager but never hash them, so the prefix cache stays empty.
2. One request through the engine's API for the role (both: add + steps; prefill:
   prefill, first token, release; decode: reserve, admit, decode steps), for the
   Python paths around the kernels.

Nothing is left behind: free blocks (and their order), the prefix cache and its hit
counters, and the engine's shared sampling generator are as before (the warm-up's
sampled rows use a generator of their own), and no request reaches the worker's
metrics, which count gRPC calls. What the synthetic KV writes leave in free blocks is
never read: a block is written before it is attended to.

On a CPU nothing compiles (the torch backend is eager; Triton's interpreter does not
compile), so `plan()` there runs one small batch of each kind: the paths and the
accounting are exercised in a second or less. On a GPU it runs the full plan. What it
cannot cover: shapes outside the configuration (a request never exceeds
max_num_batched_tokens or max_model_len), decode contexts whose blocks do not fit in
the KV pool at once (logged and skipped), and Triton's specialisation of integer
arguments on divisibility by 16 beyond the token counts listed here (both parities are
run for prefill; other integer arguments are shapes fixed by the model)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from services.engine.sampler import SamplingRequest
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import ScheduledSeq
from services.engine.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)

WARMUP_REQUEST_ID = "pdserve-warmup"


@dataclass(frozen=True)
class Row:
    """One sequence of a batch: query_len new tokens after context_len computed ones;
    completes: the chunk ends the prompt, so the row is sampled."""

    query_len: int
    context_len: int = 0
    completes: bool = True


@dataclass(frozen=True)
class BatchShape:
    rows: tuple[Row, ...]
    path: str = "execute"  # or "device": ModelRunner.decode_on_device
    sampled: str = "greedy"  # or "random": temperature / top-k / top-p / logprobs

    @property
    def kind(self) -> str:
        """As the attention dispatch sees it: decode (one query each), prefill (several
        each) or mixed."""
        if all(r.query_len == 1 for r in self.rows):
            return "decode"
        if all(r.query_len > 1 for r in self.rows):
            return "prefill"
        return "mixed"

    @property
    def num_tokens(self) -> int:
        return sum(r.query_len for r in self.rows)

    @property
    def max_seq_len(self) -> int:
        return max(r.context_len + r.query_len for r in self.rows)

    def describe(self) -> dict:
        return dict(
            kind=self.kind,
            num_seqs=len(self.rows),
            num_tokens=self.num_tokens,
            max_seq_len=self.max_seq_len,
            path=self.path,
            sampled=self.sampled,
        )


@dataclass
class WarmupReport:
    shapes: list[BatchShape]
    skipped: list[tuple[BatchShape, str]]
    role_path: str
    seconds: float

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.shapes:
            out[s.kind] = out.get(s.kind, 0) + 1
        return out

    def summary(self) -> dict:
        return dict(
            seconds=round(self.seconds, 3),
            kinds=self.kinds(),
            role_path=self.role_path,
            shapes=[s.describe() for s in self.shapes],
            skipped=len(self.skipped),
        )


def _spread(lo: int, hi: int, factor: int = 2) -> list[int]:
    """lo, lo * factor, ... below hi, then hi (empty if hi < lo)."""
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= factor
    return out + [hi] if hi >= lo else out


def plan(
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    block_size: int,
    graph_sizes: list[int],
    full: bool,
    device_decode: bool = True,
    role: str = "both",
    moe: tuple[int, int] | None = None,
) -> list[BatchShape]:
    """The batches to run. graph_sizes: the captured decode batch sizes ([] when decode
    runs eagerly). full: every size the heuristics distinguish (GPU), else one small
    batch of each kind (CPU). device_decode: decode batches also go through
    decode_on_device (async scheduling is on). moe: (num_experts, top_k) of a
    mixture of experts, whose launch settings change with tokens per expert. role: a prefill worker runs only
    prefill-only batches."""
    shapes = _plan(
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        block_size,
        graph_sizes,
        full,
        device_decode,
        moe,
    )
    if role != "prefill":
        return shapes
    # a prefill worker's sequences stop at their first token: no decode rows, ever
    cap = min(max_num_batched_tokens, max_model_len - 1)
    shapes = [s for s in shapes if s.kind == "prefill"]
    return shapes + [BatchShape((Row(min(cap, 17)),), sampled="random")] if cap >= 2 else shapes


def _plan(
    max_num_seqs,
    max_num_batched_tokens,
    max_model_len,
    block_size,
    graph_sizes,
    full,
    device_decode,
    moe,
) -> list[BatchShape]:
    cap = min(max_num_batched_tokens, max_model_len - 1)  # longest prefill chunk
    if not full:
        n = min(cap, 2 * block_size + 3)  # crosses a block boundary, not a multiple of 16
        shapes = [BatchShape((Row(n),)), BatchShape((Row(1, n),))]
        if device_decode:
            shapes.append(BatchShape((Row(1, n),), "device"))
        if cap >= 2:
            shapes.append(BatchShape((Row(1, n), Row(min(cap - 1, n))), sampled="random"))
        return shapes

    shapes: list[BatchShape] = []
    # Prefill-only: token counts doubling up to the budget (attention's BLOCK_M and the
    # GEMM token classes switch at 64 / 128 / 256 rows), one count that is not a
    # multiple of 16 (Triton specialises integer arguments on it), MoE thresholds.
    counts = set(_spread(16, cap)) | {min(cap, 17)}
    if moe is not None:
        experts, top_k = moe
        counts |= {min(cap, max(2, -(-int(pe * experts) // top_k))) for pe in (4, 16, 256, 1024)}
    for n in sorted(c for c in counts if c >= 2):
        shapes.append(BatchShape((Row(n),)))
    if cap >= 64 and max_num_seqs >= 4:  # several prompts in one batch
        shapes.append(BatchShape(tuple(Row(cap // 4) for _ in range(4))))
    for ctx in _spread(2048, max_model_len - 65, 4):  # a later chunk of a long prompt
        shapes.append(BatchShape((Row(64, ctx),)))
    if cap >= 2:
        shapes.append(BatchShape((Row(cap, 0, completes=False),)))  # a chunk mid-prompt
    # Decode: every graph size (replays at the graph's fixed attention config); where
    # decode runs eagerly (no graphs, or more sequences than the largest graph), every
    # size up to 8 (the GEMV's row counts) and the token-class bounds, each at context
    # lengths that step through the split counts.
    eager = [b for b in sorted(set(range(1, 9)) | {16, 64, 256, max_num_seqs}) if b <= max_num_seqs]
    if graph_sizes:
        eager = [b for b in eager if b > graph_sizes[-1]]
    contexts = _spread(block_size, max_model_len - 1)
    paths = ("execute", "device") if device_decode else ("execute",)
    for b in graph_sizes:
        for path in paths:
            shapes.append(BatchShape(tuple(Row(1, block_size) for _ in range(b)), path))
    for b in eager:
        for ctx in contexts:
            for path in paths:
                shapes.append(BatchShape(tuple(Row(1, ctx) for _ in range(b)), path))
    # Mixed: decodes plus a prefill chunk filling the rest of the budget (or a short one).
    for d in sorted({1, min(8, max_num_seqs - 1), max_num_seqs - 1}):
        if d < 1 or cap - d < 2:
            continue
        for chunk in sorted({min(64, cap - d), cap - d}):
            rows = tuple(Row(1, block_size) for _ in range(d)) + (Row(chunk),)
            shapes.append(BatchShape(rows))
    # The sampler's non-greedy path (top-k / top-p / logprobs) on a small batch
    shapes.append(BatchShape((Row(1, block_size), Row(min(cap, 17))), sampled="random"))
    return shapes


def plan_for(engine) -> list[BatchShape]:
    config, runner = engine.config, engine.runner
    graphs = runner.graph_runner
    hf = engine.hf_config
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
    top_k = getattr(hf, "num_experts_per_tok", None)
    return plan(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        block_size=config.block_size,
        graph_sizes=list(graphs.sizes) if graphs is not None else [],
        full=runner.device.type == "cuda",
        device_decode=engine._async,
        role=config.role,
        moe=(int(experts), int(top_k)) if experts and top_k else None,
    )


def warm_up(engine, shapes: list[BatchShape] | None = None) -> WarmupReport:
    """Run `shapes` (default: plan_for(engine)) and the role's request path on a freshly
    started engine (no requests, empty prefix cache); leaves its state as it was."""
    started = time.perf_counter()
    bm = engine.block_manager
    if engine.requests or engine.has_unfinished_requests() or bm.hash_to_block:
        raise RuntimeError("warm-up needs a fresh engine: no requests, empty prefix cache")
    shapes = plan_for(engine) if shapes is None else shapes
    free_order = list(bm.free_blocks)
    counters = (bm.prefix_hits, bm.prefix_queries, engine.scheduler.num_preemptions)
    generator = torch.Generator(engine.runner.device).manual_seed(0)
    ran, skipped = [], []
    last_log = time.perf_counter()
    try:
        for i, shape in enumerate(shapes):
            why = _run_batch(engine, shape, generator)
            if why is None:
                ran.append(shape)
            else:
                skipped.append((shape, why))
                log.info("warm-up: skipped %s: %s", shape.describe(), why)
            if time.perf_counter() - last_log > 10:
                log.info("warm-up: %d / %d batches", i + 1, len(shapes))
                last_log = time.perf_counter()
        role_path = _run_role_path(engine)
        _prepare_structured_output(engine)
    finally:
        # back to the exact starting state: nothing hashed, blocks in their LRU order
        bm.reset_prefix_cache()
        if sorted(bm.free_blocks) != sorted(free_order):
            raise RuntimeError("warm-up leaked KV blocks")
        bm.free_blocks = OrderedDict.fromkeys(free_order)
        bm.prefix_hits, bm.prefix_queries, engine.scheduler.num_preemptions = counters
    report = WarmupReport(ran, skipped, role_path, time.perf_counter() - started)
    log.info(
        "warm-up: %d batches (%s), %d skipped, role path %s, %.2fs",
        len(ran),
        ", ".join(f"{k} {n}" for k, n in sorted(report.kinds().items())),
        len(skipped),
        role_path,
        report.seconds,
    )
    return report


def _prepare_structured_output(engine) -> None:
    """Import the grammar library and build the tokenizer's grammar tables now (about
    2 s on first use), not in the first structured request's validation."""
    if engine.tokenizer is None:
        return
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        log.warning(
            "structured outputs are unavailable: xgrammar is not installed "
            "(pip install 'pdserve[worker]'); such requests are refused"
        )
        return
    from services.engine.sampling_params import StructuredOutput

    engine.grammars.compile(StructuredOutput("json_object", ""))


def _token_ids(n: int, vocab: int, salt: int) -> list[int]:
    # spread over the vocabulary (embedding rows), deterministic
    return [(salt * 7919 + i * 104729) % vocab for i in range(n)]


def _run_batch(engine, shape: BatchShape, generator: torch.Generator) -> str | None:
    """Runs one synthetic batch; returns why it was skipped, or None."""
    bm, runner = engine.block_manager, engine.runner
    vocab = engine.hf_config.vocab_size
    need = sum(bm.blocks_needed(r.context_len + r.query_len) for r in shape.rows)
    if need > bm.num_free_blocks:
        return f"needs {need} KV blocks, {bm.num_free_blocks} free"
    if shape.sampled == "random":
        params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, logprobs=5, max_tokens=1)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=1)
    seqs = []
    try:
        for i, r in enumerate(shape.rows):
            n = r.context_len + r.query_len + (0 if r.completes else 1)
            seq = Sequence(f"{WARMUP_REQUEST_ID}-{i}", _token_ids(n, vocab, i), params)
            seqs.append(seq)
            if not bm.allocate(seq, r.context_len + r.query_len):
                return "no free KV blocks"
            seq.num_computed_tokens = r.context_len
            seq.status = SequenceStatus.RUNNING
        batch = [ScheduledSeq(seq, r.query_len) for seq, r in zip(seqs, shape.rows)]
        gen = generator if shape.sampled == "random" else None
        sampling = [
            SamplingRequest(
                params=seq.params,
                token_ids=seq.token_ids,
                num_prompt_tokens=seq.num_prompt_tokens,
                stop_token_ids=[],
                generator=gen,
            )
            for seq, r in zip(seqs, shape.rows)
            if r.completes
        ]
        if shape.path == "device":
            runner.decode_on_device(seqs, sampling).tolist()
        else:
            runner.execute(batch, sampling)
        return None
    finally:
        for seq in seqs:
            bm.free(seq)


def _run_role_path(engine) -> str:
    """One short greedy request through the engine's own API for its role."""
    role = engine.config.role
    vocab = engine.hf_config.vocab_size
    n = max(1, min(2 * engine.config.block_size + 1, engine.max_model_len - 4))
    prompt = _token_ids(n, vocab, 99)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    rid = WARMUP_REQUEST_ID
    try:
        if role == "decode":
            engine.reserve_remote_kv(rid, prompt, params)
            # the KV "arrived": blocks hold whatever they hold; only shapes matter here
            engine.admit_remote(rid, prompt[-1])
        else:
            engine.add_request(rid, prompt, params)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            if steps > 64:
                raise RuntimeError("warm-up request did not finish in 64 steps")
        if role == "prefill":
            engine.release(rid)
        return f"{role}: {n}-token prompt, {steps} steps"
    finally:
        engine.abort_request(rid)  # a no-op once it has finished
